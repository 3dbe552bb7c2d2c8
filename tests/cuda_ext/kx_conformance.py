"""The checks every graphopt op passes on a sample call: its fake gives the real output's shapes,
dtypes and strides, and ``torch.library.opcheck`` (schema, fake tensor, AOT dispatch with dynamic
shapes). test_registration.py runs them on every bundled op; a new op's test calls
:func:`check_op` with a call of its own."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def check_fake(name: str, args: tuple) -> None:
    real = getattr(torch.ops.graphopt, name)(*args)
    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor)
                      else [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a]
                      if isinstance(a, list) else a for a in args)
        fake = getattr(torch.ops.graphopt, name)(*fargs)
    real = real if isinstance(real, (tuple, list)) else [real]
    fake = fake if isinstance(fake, (tuple, list)) else [fake]
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


def check_opcheck(name: str, args: tuple) -> None:
    torch.library.opcheck(getattr(torch.ops.graphopt, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def check_op(name: str, args: tuple) -> None:
    """Both checks on ``torch.ops.graphopt.<name>(*args)``."""
    check_fake(name, args)
    check_opcheck(name, args)
