"""Issue 27's correctness items on a device: which passes apply or are reverted, and whether CUDA
graphs replay, for models outside the zoo (torchvision Swin-T and EfficientNet-B0, a Hugging Face
Swin built from a small config, and a model that builds its masks on the host in forward).

    python benchmarks/diag/diag_issue27.py --out DIR [--device cuda] [--dtype fp32|bf16] [--only swin_t,...]

Per model: the passes applied, each reverted pass with its (one-line) note, the accuracy check,
the CUDA-graph decision and, after a few calls, the runner's replay count. Writes
diag_issue27_<date>.json under --out and prints one line per model.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class HostMasks(nn.Module):
    """Swin-style attention whose relative-position table and shifted-window mask the forward builds
    on the host (arange, zeros and slice assignments) and moves to the input's device."""

    def __init__(self, dim=96, heads=3, window=7):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)

    def forward(self, x):  # x: [windows, window * window, dim]
        w, n = self.window, self.window * self.window
        coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (w - 1)
        index = rel[..., 0] * (2 * w - 1) + rel[..., 1]
        bias = self.table[index.to(x.device).flatten()].view(n, n, -1).permute(2, 0, 1)
        mask = torch.zeros(n, n)
        mask[: n // 2, n // 2:] = -100.0
        mask[n // 2:, : n // 2] = -100.0
        b, _, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5 + bias + mask.to(x.device)
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def build(name: str):
    gen = torch.Generator().manual_seed(0)
    if name in ("swin_t", "efficientnet_b0"):
        import torchvision

        return torchvision.models.get_model(name, weights=None).eval(), (torch.randn(1, 3, 224, 224, generator=gen),)
    if name == "hf_swin":
        from transformers import SwinConfig, SwinModel

        cfg = SwinConfig(image_size=224, embed_dim=48, depths=[2, 2], num_heads=[3, 6], window_size=7)
        return SwinModel(cfg).eval(), {"pixel_values": torch.randn(1, 3, 224, 224, generator=gen)}
    if name == "host_masks":
        return HostMasks().eval(), (torch.randn(64, 49, 96, generator=gen),)
    raise SystemExit(f"unknown model {name}")


def to(obj, device, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, dict):
        return {k: to(v, device, dtype) for k, v in obj.items()}
    return tuple(to(v, device, dtype) for v in obj)


def main(argv=None) -> int:
    import graphopt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--only", default="swin_t,efficientnet_b0,hf_swin,host_masks")
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    rows = []
    for name in a.only.split(","):
        model, inputs = build(name)
        model, inputs = model.to(a.device, dtype), to(inputs, a.device, dtype)
        row = {"model": name, "device": a.device, "dtype": a.dtype}
        try:
            opt = graphopt.optimize(model, inputs)
            call = (lambda: opt(**inputs)) if isinstance(inputs, dict) else (lambda: opt(*inputs))
            with torch.no_grad():
                for _ in range(3):
                    call()
            rep = opt.report
            row.update(applied=[p.name for p in rep.passes if p.status == "applied"],
                       reverted={p.name: p.notes for p in rep.passes if p.status == "reverted"},
                       accuracy=rep.accuracy.get("passed"), cuda_graph=opt.runner.decision.note(),
                       stats=dict(getattr(opt.runner, "stats", {}) or {}))
        except Exception as e:  # reported, the other models still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"diag_issue27_{dt.datetime.now():%Y-%m-%d_%H%M%S}.json"
    path.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
