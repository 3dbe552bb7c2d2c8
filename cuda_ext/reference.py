"""Every op's reference implementation, by op name: ``reference.bias_act`` is
``graphopt.cuda_ext.ops.bias_act.reference``.

The references define what each op computes. Tests run them on fp64 inputs as ground truth; the
CPU implementation of every op is its reference (and the CUDA one where no kernel serves). For
bf16/fp16 inputs the math is done in fp32 and rounded once, except where the op's contract
reproduces a model's intermediate roundings (``add_rms_norm`` follows Hugging Face's
LlamaRMSNorm). Outputs are fresh tensors (custom ops may not return views of their inputs).
"""
from __future__ import annotations

from .common import compute_dtype  # noqa: F401  (the reference numerics' compute dtype)


def __getattr__(name: str):
    from .registry import all_ops

    op = all_ops().get(name)
    if op is None:
        raise AttributeError(f"graphopt.cuda_ext.reference has no op {name!r}")
    return op.reference


def __dir__():
    from .registry import all_ops

    return sorted(list(globals()) + list(all_ops()))
