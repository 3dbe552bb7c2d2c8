# Answered: What is the fastest form of ResNet's 3-channel stem? A 4x4 stride-1 convolution over 2x2 pixel blocks, 0.504 -> 0.288 ms: conv_space_to_depth (results/archive/diag_stem_2026-11-30_0304_h200.json).
"""ResNet's stem (7x7 stride-2 convolution of a 3-channel image) in the forms it could be lowered to.

    python benchmarks/diag/diag_stem.py [--batch 64] [--out DIR]

cuDNN runs ResNet-50's stem at bs64 bf16 channels_last in about 0.5 ms (20% of the optimized
model; diag_resnet_convs.py), padded to 8 channels or in NCHW no faster. Times (CUDA events,
median), each checked against the convolution in fp32:

* ``cudnn``: conv2d + bias + ReLU as lowered (graphopt::conv_bias_relu);
* ``im2col``: the patches gathered into a [N*Ho*Wo, K] matrix (one copy) and one GEMM with the
  bias + ReLU epilogue (``aten._addmm_activation``), K = 147 and K padded to 152;
* ``s2d``: space-to-depth: the padded image as 2x2 blocks (12 channels, padded to 16) and a 4x4
  stride-1 convolution with the weight rearranged (exact: the 8x8 window's extra row/column has
  zero weight).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import diag_resnet_convs  # noqa: E402


def _time(fn, reps=7, inner=20):
    return diag_resnet_convs._time(fn, torch.device("cuda"), reps, inner)


def im2col_weight(w, kpad):
    co, ci, kh, kw = w.shape
    wk = w.permute(0, 2, 3, 1).reshape(co, kh * kw * ci)
    if kpad > wk.shape[1]:
        wk = F.pad(wk, (0, kpad - wk.shape[1]))
    return wk.t()  # [K, Co] as a transposed view: cuBLAS takes it without a copy


def im2col(x, kh, kw, stride, pad, kpad):
    n, c, h, w = x.shape
    ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    xp = F.pad(x, (pad, pad, pad, pad))                       # channels_last in, channels_last out
    win = xp.unfold(2, kh, stride).unfold(3, kw, stride)      # [N, C, Ho, Wo, kh, kw] view
    cols = win.permute(0, 2, 3, 4, 5, 1)                      # [N, Ho, Wo, kh, kw, C]
    if kpad > kh * kw * c:
        out = x.new_zeros(n * ho * wo, kpad)
        out[:, :kh * kw * c].view(n, ho, wo, kh, kw, c).copy_(cols)
        return out, ho, wo
    return cols.reshape(n * ho * wo, kh * kw * c), ho, wo


def stem_im2col(x, wt, bias, kpad):
    cols, ho, wo = im2col(x, 7, 7, 2, 3, kpad)
    y = torch.ops.aten._addmm_activation(bias, cols, wt)     # relu(cols @ wt + bias), cuBLASLt epilogue
    return y.view(x.shape[0], ho, wo, -1).permute(0, 3, 1, 2)  # channels_last [N, Co, Ho, Wo]


def s2d_weight(w, cpad=16):
    co, ci, kh, kw = w.shape                                  # 7x7 -> 8x8 (a zero last row/col)
    w8 = F.pad(w, (0, 8 - kw, 0, 8 - kh))
    # W'[co, (dy, dx, ci), by, bx] = W8[co, ci, 2*by + dy, 2*bx + dx]
    ws = w8.view(co, ci, 4, 2, 4, 2).permute(0, 3, 5, 1, 2, 4).reshape(co, 4 * ci, 4, 4)
    if cpad > 4 * ci:
        ws = F.pad(ws, (0, 0, 0, 0, 0, cpad - 4 * ci))
    return ws.contiguous(memory_format=torch.channels_last)


def s2d(x, cpad=16):
    n, c, h, w = x.shape                                      # pad 3 (the conv's) + 3 to make 2x2 blocks
    hp, wp = h + 6 + (h + 6) % 2, w + 6 + (w + 6) % 2
    xp = F.pad(x, (3, wp - w - 3, 3, hp - h - 3))
    # [N, C, Hb, 2, Wb, 2] -> [N, (dy, dx, C), Hb, Wb], channels last
    blocks = xp.view(n, c, hp // 2, 2, wp // 2, 2).permute(0, 3, 5, 1, 2, 4)
    out = x.new_zeros((n, hp // 2, wp // 2, cpad)).permute(0, 3, 1, 2)
    out[:, :4 * c].copy_(blocks.reshape(n, 4 * c, hp // 2, wp // 2))
    return out


def stem_s2d(x, ws, bias):
    return torch.ops.graphopt.conv_bias_relu.default(s2d(x, ws.shape[1]), ws, bias, None, [1, 1], [0, 0], [1, 1], 1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    import graphopt.cuda_ext  # noqa: F401  registers graphopt::conv_bias_relu
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(a.batch, 3, 224, 224, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 3, 7, 7, device=dev, dtype=dt) * 0.1).contiguous(memory_format=torch.channels_last)
    b = torch.randn(64, device=dev, dtype=dt)
    ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), 2, 3))
    g = torch.ops.graphopt.conv_bias_relu.default
    rows = {}
    with torch.inference_mode():
        cands = {"cudnn": lambda: g(x, w, b, None, [2, 2], [3, 3], [1, 1], 1)}
        for kp in (147, 152):
            wt = im2col_weight(w, kp)
            cands[f"im2col_k{kp}"] = (lambda wt=wt, kp=kp: stem_im2col(x, wt, b, kp))
            cols = im2col(x, 7, 7, 2, 3, kp)[0]
            rows[f"im2col_k{kp}_gather_ms"] = _time(lambda kp=kp: im2col(x, 7, 7, 2, 3, kp))
            rows[f"im2col_k{kp}_gemm_ms"] = _time(lambda cols=cols, wt=wt: torch.ops.aten._addmm_activation(b, cols, wt))
        for cp in (12, 16):
            ws = s2d_weight(w, cp)
            cands[f"s2d_c{cp}"] = (lambda ws=ws: stem_s2d(x, ws, b))
            xs = s2d(x, cp)
            rows[f"s2d_c{cp}_transform_ms"] = _time(lambda cp=cp: s2d(x, cp))
            rows[f"s2d_c{cp}_conv_ms"] = _time(lambda xs=xs, ws=ws: g(xs, ws, b, None, [1, 1], [0, 0], [1, 1], 1))
        for k, fn in cands.items():
            y = fn()
            err = float((y.float() - ref).abs().max())
            rows[f"{k}_ms"] = _time(fn)
            rows[f"{k}_maxerr"] = err
            rows[f"{k}_channels_last"] = bool(y.is_contiguous(memory_format=torch.channels_last))
            print(f"{k:14s} {rows[k + '_ms']:.4f} ms  max err {err:.4f}  channels_last {rows[k + '_channels_last']}",
                  flush=True)
    head = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "batch": a.batch}
    print(json.dumps(rows, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_stem.json").write_text(json.dumps({"header": head, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
