"""graphopt's passes, one module per pass (``graphopt.passes.<pass id>``).

Importing this package registers every pass with :mod:`graphopt.pipeline`; the order they
run in is declared there, in ``PIPELINE``.
"""

from . import eliminate_dead_code, fold_constants, fold_conv_bn  # noqa: F401
