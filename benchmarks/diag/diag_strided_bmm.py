# Answered: Is graphopt::strided_bmm (lower_strided_bmm) faster than aten's batched matmul with its copies, and than Inductor's, on per-head products of split projections, and is it priced right? (results/diag_strided_bmm_<date>.md)
"""Per-head products as models write them, each way of running them, and the cost model's price.

    python benchmarks/diag/diag_strided_bmm.py --out DIR [--no-compile] [--nodes]

Each case is a small module: q, k, v split out of one projection (batch strides that do not fold),
then products over the heads, then the heads merged and projected. Timed replayed from a CUDA
graph (µs per call, median), bf16: eager (aten's copies of the operands, cuBLAS, the merge's copy),
graphopt after ``lower_strided_bmm`` alone, torch.compile (default mode), and the cost model's
prediction of both graphs on this device's profile; every result checked against float64. ``--nodes``:
each node's kernel time beside its price, in both graphs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_col2im import run_cases  # noqa: E402


class FactorAttention(nn.Module):
    """CoaT's factorized attention: softmax(k) over tokens, k^T v per head, q times that, heads merged."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.proj = heads, nn.Linear(dim, dim)

    def forward(self, qkv):  # the projection's output [B, N, 3C]
        B, N, C3 = qkv.shape
        C = C3 // 3
        q, k, v = qkv.reshape(B, N, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        kv = k.softmax(dim=2).transpose(-1, -2) @ v
        y = (q * 0.25) @ kv
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class ScoresTimesV(nn.Module):
    """Scores of short windows computed by hand (no softmax: a linear attention), read back per head."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.proj = heads, nn.Linear(dim, dim)

    def forward(self, qkv):
        B, N, C3 = qkv.shape
        C = C3 // 3
        q, k, v = qkv.reshape(B, N, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = torch.relu(q @ k.transpose(-1, -2)) @ v
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


def _case(cls, B, N, C, h):
    return lambda: (cls(C, h), (torch.randn(B, N, 3 * C),))


CASES = [("CoaT-Lite Tiny stage 1 (bs64, 3137 tokens, 8 heads of 8)", _case(FactorAttention, 64, 3137, 64, 8)),
         ("CoaT-Tiny stage 1 (bs64, 3137 tokens, 8 heads of 19)", _case(FactorAttention, 64, 3137, 152, 8)),
         ("CoaT-Tiny stage 2 (bs64, 785 tokens)", _case(FactorAttention, 64, 785, 152, 8)),
         ("CoaT-Lite Small stage 3 (bs64, 197 tokens, 8 heads of 40)", _case(FactorAttention, 64, 197, 320, 8)),
         ("factorized, bs8, 8 heads of 64", _case(FactorAttention, 8, 1024, 512, 8)),
         ("linear attention over 64 tokens, 4 heads of 32", _case(ScoresTimesV, 256, 64, 128, 4)),
         ("factorized, bs64, 50 tokens, 8 heads of 64", _case(FactorAttention, 64, 50, 512, 8)),
         ("factorized, bs1, 3137 tokens, 8 heads of 19", _case(FactorAttention, 1, 3137, 152, 8)),
         ("factorized, bs32, 785 tokens, 8 heads of 32", _case(FactorAttention, 32, 785, 256, 8)),
         ("linear attention, bs64, 196 tokens, 6 heads of 64", _case(ScoresTimesV, 64, 196, 384, 6))]


def main(argv=None) -> int:
    return run_cases(__doc__, argv, CASES, ("lower_strided_bmm",), "diag_strided_bmm",
                     "# Per-head products: aten, graphopt::strided_bmm, torch.compile")


if __name__ == "__main__":
    sys.exit(main())
