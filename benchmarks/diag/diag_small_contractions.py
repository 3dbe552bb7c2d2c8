# Answered: What do small contractions and tiny-head attention take? SDPA on 50176 heads of 16 positions (TNT) 964 us against short_attention's 91 (any head dim now), its floors in the cost model; k <= 12 contractions unrolled into one pointwise kernel lose to aten's bmm except VOLO's (154 against 373 us), the tile walk no faster than the flat one (results/diag_small_contractions_2026-12-06_170045.md).
"""Small batched contractions and tiny-head attention: what each way of running them takes.

    python benchmarks/diag/diag_small_contractions.py --out DIR

Three groups of cases, each timed replayed from a CUDA graph (µs per call, median):
* ``contract``: a batched matmul contracting k = 4..12 with its operands as models lay them out
  (CoaT's factor attention reads q from a permuted qkv; VOLO's outlooker reads v from an unfold):
  aten.matmul as eager runs it (copies included), and the same product unrolled into one
  fused_pointwise program (k column slices times k row slices, summed in float32) run by the
  flat walk (a div/mod per element) and by the [rows, last dim] tile walk (a div/mod per row).
* ``broadcast``: a rank-3/4 product with an operand broadcast over a middle dim, flat walk against
  tile walk, for last dims of 4..64.
* ``attention``: attention over few keys with a head dim not a multiple of 8 (TNT's inner
  transformer: 16 pixels, head dim 6) and others: SDPA as dispatched, each SDPA backend that takes
  it, and graphopt::short_attention.
Every result is checked against float64; "err" is the largest error over the largest reference value.
Writes diag_small_contractions_<date>.{json,md} under --out.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.cuda_ext import pointwise_triton  # noqa: E402
from graphopt.cuda_ext.attention_triton import attention_triton  # noqa: E402
from graphopt.cuda_ext.pointwise import Program  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import rel_err, replayed_us, measure_row, out_dir, table_lines, write_rows  # noqa: E402

BF = torch.bfloat16


def _coat(dev, B=64, N=3137, H=8, D=8):
    """q [B, H, N, D] read from a [B, N, 3, H, D] qkv; kv [B, H, D, D] contiguous."""
    qkv = torch.randn(B, N, 3, H, D, device=dev, dtype=BF)
    q = qkv.permute(2, 0, 3, 1, 4)[0]
    return q, torch.randn(B, H, D, D, device=dev, dtype=BF) * 0.1


def _volo(dev, B=64, H=6, L=196, K=9, C=32):
    """attn [B, H, L, K, K] contiguous; v [B, H, L, K, C] read from an unfold [B, H*C*K, L]."""
    cols = torch.randn(B, H * C * K, L, device=dev, dtype=BF)
    v = cols.reshape(B, H, C, K, L).permute(0, 1, 4, 3, 2)
    return torch.randn(B, H, L, K, K, device=dev, dtype=BF).softmax(-1), v


def _plain(dev, batch, m, k, n):
    return torch.randn(*batch, m, k, device=dev, dtype=BF), torch.randn(*batch, k, n, device=dev, dtype=BF)


CONTRACT = [("CoaT-Lite factor attention q@kv", _coat, {}),
            ("CoaT-Lite stage 2 q@kv (D=16)", _coat, dict(N=785, D=16)),
            ("VOLO outlooker attn@v", _volo, {}),
            ("plain [4096,64,4]@[4,32]", lambda dev: _plain(dev, (4096,), 64, 4, 32), {}),
            ("plain [512,8,196,12]@[12,12]", lambda dev: _plain(dev, (512, 8), 196, 12, 12), {})]


def _unrolled(a, b):
    """The program and its inputs: sum over i of a[..., i:i+1] * b[..., i:i+1, :] in float32."""
    k = a.shape[-1]
    p = Program()
    acc = None
    ins = []
    for i in range(k):
        ins += [a.select(-1, i).unsqueeze(-1), b.select(-2, i).unsqueeze(-2)]
        t = p.cast(p.input(2 * i), torch.float32) * p.cast(p.input(2 * i + 1), torch.float32)
        acc = t if acc is None else acc + t
    p.output(acc, a.dtype)
    return p.source, ins


def _walk(min_last):
    """Run fused_pointwise plans made with this tile-walk threshold (fresh plans)."""
    pointwise_triton.TILE2D_MIN_LAST = min_last
    pointwise_triton._plans.clear()


def contract_row(name, make, kw, dev):
    a, b = make(dev, **kw)
    ref = a.double() @ b.double()
    row = {"group": "contract", "case": name, "shape": f"{tuple(a.shape)}@{tuple(b.shape)}",
           "aten_us": replayed_us(lambda: torch.matmul(a, b)), "aten_err": rel_err(torch.matmul(a, b), ref)}
    src, ins = _unrolled(a, b)
    run = pointwise_triton.fused_pointwise_triton
    for label, thr in (("flat", 1 << 30), ("tile", 1)):
        _walk(thr)
        row[f"{label}_us"] = replayed_us(lambda: run(src, ins))
        row[f"{label}_err"] = rel_err(run(src, ins)[0], ref)
    _walk(64)
    return row


BROADCAST = [((64, 196, 9, 32), (64, 196, 1, 32)), ((64, 8, 3137, 8), (64, 8, 1, 8)),
             ((12544, 16, 4, 6), (12544, 1, 4, 6)), ((64, 56, 56, 4), (64, 1, 56, 4)),
             ((256, 49, 6, 16), (256, 1, 6, 16)), ((64, 197, 6, 64), (64, 1, 6, 64))]


def broadcast_row(xs, ys, dev):
    x, y = torch.randn(xs, device=dev, dtype=BF), torch.randn(ys, device=dev, dtype=BF)
    p = Program()
    p.output(p.cast(p.input(0), torch.float32) * p.cast(p.input(1), torch.float32) + 1.0, BF)
    src = p.source
    ref = x.double() * y.double() + 1.0
    run = pointwise_triton.fused_pointwise_triton
    row = {"group": "broadcast", "case": f"{xs} * {ys}", "shape": str(xs),
           "aten_us": replayed_us(lambda: x * y + 1.0)}
    for label, thr in (("flat", 1 << 30), ("tile", 1)):
        _walk(thr)
        row[f"{label}_us"] = replayed_us(lambda: run(src, [x, y]))
        row[f"{label}_err"] = rel_err(run(src, [x, y])[0], ref)
    _walk(64)
    return row


# (name, batch, heads, seq, head dim): q, k, v read from a fused [batch, seq, 3, heads, head dim] projection
ATTENTION = [("TNT-S inner", 12544, 4, 16, 6), ("head dim 12, 49 keys", 4096, 2, 49, 12),
             ("head dim 20, 64 keys", 512, 8, 64, 20), ("head dim 24, 197 keys", 64, 16, 197, 24),
             ("head dim 32, 16 keys", 8192, 4, 16, 32)]


def attention_row(name, B, H, S, D, dev):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qkv = torch.randn(B, S, 3, H, D, device=dev, dtype=BF)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    row = {"group": "attention", "case": name, "shape": f"{(B, H, S, D)}"}
    row["sdpa_us"] = replayed_us(lambda: F.scaled_dot_product_attention(q, k, v))
    for label, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                      ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([be]):
                row[f"{label}_us"] = replayed_us(lambda: F.scaled_dot_product_attention(q, k, v))
        except Exception as e:  # noqa: BLE001 - a backend that does not take the shape
            row[f"{label}_us"] = f"({type(e).__name__})"
    scale = D ** -0.5
    row["short_us"] = replayed_us(lambda: attention_triton(q, k, v, None, scale, False))
    row["short_err"] = rel_err(attention_triton(q, k, v, None, scale, False), ref)
    return row


def _f(key):
    return lambda r: (f"{r[key]:.1f}" if isinstance(r[key], float) and key.endswith("_us")
                      else f"{r[key]:.1e}" if isinstance(r[key], float) else str(r[key]))


def main(argv=None) -> int:
    out = out_dir(__doc__, argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows: list = []
    for name, make, kw in CONTRACT:
        measure_row(rows, {"group": "contract", "case": name}, lambda r: r.update(contract_row(name, make, kw, dev)))
    for xs, ys in BROADCAST:
        measure_row(rows, {"group": "broadcast", "case": str(xs)}, lambda r: r.update(broadcast_row(xs, ys, dev)))
    for name, B, H, S, D in ATTENTION:
        measure_row(rows, {"group": "attention", "case": name},
                    lambda r: r.update(attention_row(name, B, H, S, D, dev)))
    cols = [("case", _f("case"), False), ("shape", _f("shape"), False), ("aten µs", _f("aten_us"), True),
            ("flat µs", _f("flat_us"), True), ("tile µs", _f("tile_us"), True), ("flat err", _f("flat_err"), True),
            ("tile err", _f("tile_err"), True), ("note", lambda r: "", False)]
    acols = [("case", _f("case"), False), ("shape", _f("shape"), False), ("SDPA µs", _f("sdpa_us"), True),
             ("flash", _f("flash_us"), True), ("efficient", _f("efficient_us"), True), ("cuDNN", _f("cudnn_us"), True),
             ("math", _f("math_us"), True), ("short_attention µs", _f("short_us"), True),
             ("err", _f("short_err"), True), ("note", lambda r: "", False)]
    props = torch.cuda.get_device_properties(dev)
    head = f"{props.name}, torch {torch.__version__}, bf16; µs per call replayed from a CUDA graph (median)."
    lines = table_lines("# Small contractions, broadcasts and tiny-head attention", head, cols,
                        [r for r in rows if r["group"] != "attention"])
    lines += [""] + table_lines("## Attention", "", acols, [r for r in rows if r["group"] == "attention"])[2:]
    write_rows(out, "diag_small_contractions", rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
