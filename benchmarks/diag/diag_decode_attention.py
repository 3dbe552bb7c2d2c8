"""Decode-step attention: graphopt::decode_attention against SDPA and the cache-read floor.

    python benchmarks/diag/diag_decode_attention.py --out DIR [--quick]

One query position per sequence (bf16, head dim 128) over a static cache of 4096 + 256 positions
with 128, 1024 or 4096 positions of past, batch 1, 8 and 32, for Llama-3-8B's heads (32 query, 8
key/value) and GLM-4-9B's (32 / 2). Each variant makes one call per layer over that layer's own
cache (enough layers that the caches outgrow the L2 cache, as a decode step's weights flush it),
captured once into a CUDA graph and replayed; times are per call:

* ``decode kv_len``: graphopt::decode_attention with kv_len = past + 1 and the bool mask (what
  lower_decode_attention emits); ``decode mask``: the mask alone (the whole cache is read);
  ``decode sN``: kv_len with N key splits (the split heuristic's neighbours, at batch 1);
* ``sdpa repeat_kv``: what the exported Hugging Face graph runs: K/V repeated to the query heads
  (a copy), then SDPA with the bool mask, torch's choice of kernel;
* ``sdpa gqa <backend>``: SDPA with ``enable_gqa=True`` and the mask, one backend forced (a backend
  that refuses is reported with torch's reason); ``sdpa packed``: Hugging Face's eager q_len = 1
  spelling (the group's query heads as query rows over one K/V head);
* floors: the K/V bytes of the whole cache and of the past alone at the measured copy bandwidth.

Each graphopt result is checked against SDPA in float32 (max abs error). Writes
diag_decode_attention_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from graphopt.cuda_ext import decode_attention_triton as dat  # noqa: E402
from _timing import captured, graph_us_per_call, measure_row, table_lines, write_rows  # noqa: E402

HEADS = {"llama3-8b": (32, 8), "glm4-9b": (32, 2)}
D = 128
CACHE = 4096 + 256
L2_BYTES = 60e6  # the H200's L2 is 50 MB: the caches of the layers one graph reads together exceed it


def copy_bandwidth() -> float:
    """Bytes per second a 1 GiB device-to-device copy moves (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = graph_us_per_call(lambda: dst.copy_(src), 1, replays=3, reps=10)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def _layers(B, Hkv) -> int:
    per = 2 * B * Hkv * CACHE * D * 2
    return max(2, min(32, math.ceil(L2_BYTES * 4 / per)))


def _case(B, Hq, Hkv, past, layers):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ks = [torch.randn(B, Hkv, CACHE, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    vs = [torch.randn(B, Hkv, CACHE, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    pos = torch.full((B,), past, device="cuda")
    mask = (torch.arange(CACHE, device="cuda")[None, None, None, :] <= pos[:, None, None, None])  # [B, 1, 1, L]
    kv_len = (pos + 1).to(torch.int64)
    return q, ks, vs, mask, kv_len


def _variants(q, ks, vs, mask, kv_len, Hq, Hkv, B, splits_sweep):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = Hq // Hkv
    scale = D ** -0.5
    out = {
        "decode kv_len": lambda i: torch.ops.graphopt.decode_attention(q, ks[i], vs[i], mask, kv_len, scale),
        "decode mask": lambda i: torch.ops.graphopt.decode_attention(q, ks[i], vs[i], mask, None, scale),
    }
    for s in splits_sweep:
        out[f"decode s{s}"] = lambda i, s=s: dat.decode_attention_triton(q, ks[i], vs[i], mask, kv_len, scale, splits=s)

    def repeat(x):  # transformers' repeat_kv
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    out["sdpa repeat_kv"] = lambda i: F.scaled_dot_product_attention(q, repeat(ks[i]), repeat(vs[i]), attn_mask=mask,
                                                                      scale=scale)
    for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
        def f(i, be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask, scale=scale, enable_gqa=True)
        out[f"sdpa gqa {name}"] = f
    qp = q.reshape(B, Hkv, n, D)  # Hugging Face's pack_gqa for one query position
    out["sdpa packed"] = lambda i: F.scaled_dot_product_attention(qp, ks[i], vs[i], attn_mask=mask, scale=scale)
    return out


def _error(fn, q, k, v, mask, kv_len) -> float:
    keep = mask & (torch.arange(CACHE, device="cuda") < kv_len[:, None, None, None])
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, enable_gqa=True)
    return float((fn(0).float() - ref).abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="batch 1 and 8, past 1024 only")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows: list = []
    batches, pasts = ((1, 8), (1024,)) if a.quick else ((1, 8, 32), (128, 1024, 4096))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model, (Hq, Hkv) in HEADS.items():
        for B in batches:
            layers = _layers(B, Hkv)
            q, ks, vs, mask, kv_len = _case(B, Hq, Hkv, pasts[-1], layers)
            for past in pasts:
                mask.copy_(torch.arange(CACHE, device="cuda")[None, None, None, :] <= past)
                kv_len.fill_(past + 1)
                kv_bytes = 2 * B * Hkv * D * 2
                auto = dat.plan(q.shape, ks[0].shape, sms)["splits"]
                sweep = sorted({max(1, auto // 2), auto * 2} - {auto}) if B == 1 and auto > 1 else []
                fns = _variants(q, ks, vs, mask, kv_len, Hq, Hkv, B, sweep)
                base = {"model": model, "batch": B, "past": past, "cache": CACHE, "layers": layers, "splits": auto,
                        "floor_cache_us": kv_bytes * CACHE / bw * 1e6, "floor_past_us": kv_bytes * (past + 1) / bw * 1e6}
                for name, fn in fns.items():
                    def measure(row, fn=fn, name=name):
                        row["us"] = graph_us_per_call(lambda: [fn(i) for i in range(layers)], layers, replays=3, reps=10)
                        if name.startswith("decode"):
                            row["max_abs_err"] = _error(fn, q, ks[0], vs[0], mask,
                                                        kv_len if "mask" not in name else torch.full_like(kv_len, CACHE))
                    measure_row(rows, dict(base, variant=name), measure)
            del q, ks, vs
            torch.cuda.empty_cache()
    # one table row per case: every variant's µs
    cases: dict = {}
    for r in rows:
        key = (r["model"], r["batch"], r["past"])
        c = cases.setdefault(key, dict((k, r[k]) for k in ("model", "batch", "past", "splits", "floor_cache_us",
                                                            "floor_past_us")))
        c[r["variant"]] = f"{r['us']:.1f}" if "us" in r else "refused"
    names = sorted({r["variant"] for r in rows}, key=lambda v: (not v.startswith("decode"), v))
    cols = [("model", lambda r: r["model"], False), ("B", lambda r: str(r["batch"]), True),
            ("past", lambda r: str(r["past"]), True), ("splits", lambda r: str(r["splits"]), True),
            ("floor cache µs", lambda r: f"{r['floor_cache_us']:.1f}", True),
            ("floor past µs", lambda r: f"{r['floor_past_us']:.1f}", True)]
    cols += [(v, lambda r, v=v: r[v], True) for v in names]
    intro = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s; "
             f"µs per call replayed from a CUDA graph (one call per layer, each over its own {CACHE}-position cache); "
             "errors and refusals per row in the JSON")
    lines = table_lines("# Decode attention: graphopt::decode_attention vs SDPA", intro, cols, list(cases.values()))
    errs = [r for r in rows if "error" in r]
    if errs:
        lines += ["", "Refused or failed:", ""] + sorted({f"* {r['variant']}: {r['error']}" for r in errs})
    worst = max((r.get("max_abs_err", 0.0) for r in rows), default=0.0)
    lines += ["", f"Largest |graphopt - fp32 SDPA| over all cases: {worst:.2e}"]
    write_rows(a.out, "diag_decode_attention", rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
