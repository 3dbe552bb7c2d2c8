"""graphopt's passes, one module per pass (``graphopt.passes.<pass id>``).

Importing this package imports every module in it, which registers each pass with
:mod:`graphopt.pipeline`; the order they run in is declared there, in ``PIPELINE``.
"""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
