"""Fuzzing the passes (issue 10.2): random small programs from a grammar of the ops our passes
touch, optimized by random pass subsets, checked against eager by the accuracy rule.

A program is data (:class:`Program`: shapes, input dtypes, a tuple of op specs, outputs) so
hypothesis can shrink it; :class:`ProgramModule` is a small interpreter whose forward walks the
spec. :func:`programs` is the hypothesis strategy, :func:`check_program` the property (raises
:class:`FuzzFailure` naming the stage and passes), :func:`regression_source` renders a shrunk
failure as a standalone test file.

Op specs (value indices are absolute: inputs first, then one value per op):
  ("linear", src, out, bias)           ("matmul_w", src, n)           ("bmm", a, b)  a @ b^T
  ("conv", src, out_ch, k, bias, bn)   3-D src (B,C,L) viewed as (B,C,2,L/2), conv2d, flattened back
  ("mixconv", src, mode)               3-D src (B,C,L) viewed as (B,C,2,L/2), split along channels, a convolution of each
                                       piece, concatenated back (MixNet's): mode "depthwise" (kernels 3 and 5, same
                                       padding, groups = channels) or "pointwise" (two 1x1 over the halves), flattened back
  ("resample", src, align, factor)     3-D src (B,C,L), L % 4 == 0, viewed as (B,C,2,L/2): bilinear down to
                                       (1,L/4) (by scale factor 0.5 where ``factor``, else by size) and back up by
                                       size, align_corners or not, flattened back
  ("repconv", src, groups, form)      3-D src (B,C,L) viewed as (B,C,2,L/2): a reparameterizable block's branches of
                                       one input added, groups "dense" (1) or "depthwise" (C): a 3x3 conv with its
                                       BatchNorm + a 1x1 conv with its BatchNorm + the input's BatchNorm (form "sum"),
                                       or x + gamma * (3x3 conv + BatchNorm of x - another BatchNorm of x) ("mixer"),
                                       flattened back
  ("tokenmix", src, hidden, form)      3-D src [B, S, D]: a linear over the tokens S (transposed last and back):
                                       form "mlp" fc2(gelu(fc1(x^T)))^T with biases (MLP-Mixer's), "glu" the same with
                                       fc1 twice as wide, chunked along the last dim, a * silu(g) (gMixer's), "gate"
                                       x * fc(x^T)^T (gMLP's gating), "plain" relu(x)^T through fc without bias
  ("convattn", src, heads)             3-D src (B,C,L) viewed as (B,C,2,L/2): attention over the pixels with 1x1
                                       convolutions for qkv and the output (CoAtNet's, BoTNet's): qkv viewed as heads,
                                       chunked, transposed and copied into SDPA, its output folded back into (B,C,2,L/2) by a
                                       reshape (a copy with two heads), projected, flattened back
  ("se", src, gate)                    3-D src (B,C,L) viewed as (B,C,2,L/2): conv2d, squeeze-and-excitation's
                                       per-channel scale (mean over the pixels, sigmoid | hardsigmoid,
                                       a broadcast mul), conv2d, flattened back
  ("group_norm", src, groups, affine, act, four_d)  F.group_norm of a 3-D src (four_d: viewed as
                                       (B,C,2,L/2), channels_last, flattened back), then act (or none)
  ("layer_norm", src, affine)          ("rms_norm", src)  HF style: pow/mean/rsqrt/mul weight
  ("act", src, kind)                   ("softmax", src)
  ("binary", op, a, kind, arg)         kind "value" (arg: index), "param" (arg: shape), "scalar" (arg: float)
  ("transpose", src) ("permute", src, perm) ("contiguous", src) ("merge", src) ("split", src)
  ("roll", src, dim, h): torch.cat of the slices [h:] and [:h] along dim (a concatenation of strided pieces)
  ("headprod", src, h)                 3-D src [B, S, D]: q, k, v as h heads split out of cat((x, x/2, -x), -1) (batch
                                       strides that do not fold), k's softmax over S, k^T v, q @ that, heads
                                       merged back to [B, S, D] (CoaT's factorized attention)
  ("catslice", src, dim, k, mode)      y = cat((head, x), dim), head x's first slice along dim halved and expanded
                                       to k; read back by mode: "slice" (x's range plus head's first), "split"
                                       (torch.split into [k, n]), "select" (x's range minus head's last),
                                       "span" (a range across both pieces); x's shape
  ("pad", src, dim, lo, hi, value)     F.pad of src along dim (lo before, hi after) with a constant
  ("unfold", src, k, padding, stride)  F.unfold (im2col) of a 3-D src (B,C,L) viewed as (B,C,2,L/2): [B, C*k*k, windows]
  ("fold", src, k, padding, stride)    F.fold (col2im) of a 3-D src (B,C*k*k,L) as L windows in one row of the
                                       smallest image they tile, [B, C, H, W] flattened back to [B, C, H*W]
  ("attention", q, k, v, causal)       q @ k^T * scale [masked_fill causal] -> softmax -> @ v
  ("mha", src, heads, causal)          q/k/v projections, heads split, attention, out projection
  ("swiglu", src, hidden)              down(silu(gate(x)) * up(x))
  ("gate", src, pre, spelling)         src's last dim (even) touched by a pointwise op, then split in two and
                                       silu(a) * b: pre "masked" (rows where src's first column > 0.5 zeroed by
                                       masked_fill, grouped-GEMM experts' padding rows), "bias" (a parameter of the
                                       whole width added), "scale"; spelling "chunk" | "split" | "slices"
  ("attn_block", src, hq, hkv, mask, spelling)  a Llama-style block on [B, S, D]: q/k/v projections (k/v
                                       to hkv heads), heads split, attention ("manual": repeat_kv then
                                       matmul/softmax, mask as attention's; "sdpa": enable_gqa, mask as
                                       sdpa's; "keys_last": as manual with hkv = hq, K^T made straight from
                                       the projection by one permute to [B, H, D, S], LeViT's), heads
                                       merged, out projection
  ("cast", src, "bf16" | "f32")
  ("reduce", src, kind, dim, keepdim)  kind sum | mean | amax | var, over any dim
  ("softmax_dim", src, kind, dim, keepdim)  kind softmax | log_softmax | logsumexp (keepdim: logsumexp's)
  ("unsqueeze", src, dim)              a new size-1 dim (broadcasting across ranks follows)
  ("heads", src, h)                    [.., S, D] -> [.., h, S, D/h] (unflatten, transpose); ("merge_heads", src) back
  ("attention", q, k, v, mask)         mask False | True (causal) | (kind, shape): kind "bias" (a float
                                       parameter: a per-head relative position bias), "pad" (0 / finfo.min
                                       over keys, [B, 1, .., Sk]), "window" (0 / -100 blocks, Swin's), "bool"
                                       (a keep-mask through masked_fill); shape broadcasts to the scores
  ("sdpa", q, k, v, mask)              F.scaled_dot_product_attention (fp32 or bf16); mask None | "causal" |
                                       (kind, shape)
  (attention or sdpa, q, k, v, mask, n)  grouped-query: k/v [.., Hq/n, S, D]; attention repeats them
                                       to q's heads as HF's repeat_kv does (unsqueeze, expand, reshape),
                                       sdpa passes enable_gqa=True
  (attention or sdpa, q, k, v, mask, n, "broadcast")  multi-query: k/v of one head broadcast over q's
                                       heads (matmul's and SDPA's own broadcast; no repeat, no enable_gqa)
  ("norm", src, kind)                  LayerNorm / RMSNorm spellings: ln_module, ln_manual, ln_var, rms_plain,
                                       rms_gemma (1 + w), rms_torch (F.rms_norm)
  ("inplace", src, kind)               on a fresh copy: add_, mul_, relu_, masked_fill_, slice_fill
                                       (y[..., :k] = c), slice_add (y[..., :k] += 1)
  ("dropout", src, spelling)           eval-mode dropout: module, module_inplace, functional,
                                       functional_inplace, torch, feature, alpha, native
  ("host_const", src, kind)            a tensor the forward builds on the host and moves to x's device:
                                       arange_bias, slice_mask (zeros + slice assignment), scalar
"""

from __future__ import annotations

import hashlib
import math
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTS = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "hardswish", "leaky_relu:0.2")
BINOPS = ("add", "mul", "sub", "div")
# assign_precision lowers to bf16 by design; its numerics are guarded by the accuracy rule at
# bf16 tolerance, so it is fuzzed end to end through graphopt.optimize (with the guard) only
STRICT_EXCLUDED = ("assign_precision",)
_DT = {"f32": torch.float32, "bf16": torch.bfloat16}


class FuzzFailure(AssertionError):
    """A fuzzed program broke: ``stage`` is capture | passes | run | accuracy | optimize, or program
    (a generator bug: the program does not run eagerly)."""

    def __init__(self, stage: str, message: str, pass_name: str = ""):
        super().__init__(f"[{stage}] {message}")
        self.stage, self.pass_name = stage, pass_name

    def signature(self) -> tuple:
        """what dedups failures in a campaign: the stage, the pass and the error's type"""
        first = str(self).splitlines()[0]
        kind = first.split(" raised ")[-1].split(":")[0] if " raised " in first else self.stage
        return (self.stage, self.pass_name, kind)


@dataclass(frozen=True)
class Program:
    B: int
    S: int
    D: int
    inputs: tuple  # dtype names, e.g. ("f32", "bf16"); every input has shape (B, S, D)
    ops: tuple
    outputs: tuple  # value indices
    seed: int = 0

    def uses_bf16(self) -> bool:
        return "bf16" in self.inputs or any(op[0] == "cast" and op[2] == "bf16" for op in self.ops)


# --------------------------------------------------------------------------- the interpreter


class ProgramModule(nn.Module):
    """An nn.Module whose forward interprets a Program. Parameters are drawn from a generator
    seeded with ``program.seed``, so a program always renders to the same module."""

    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        g = torch.Generator().manual_seed(program.seed)
        self.params = nn.ParameterDict()
        self.mods = nn.ModuleDict()
        # the model's float dtype: fp32, float64 in the fp64 reference (an upcast follows it)
        self.register_buffer("anchor", torch.zeros(()))
        shapes = [(program.B, program.S, program.D)] * len(program.inputs)

        def p(name, *shape, scale=None, offset=0.0):
            fan = shape[-1] if shape else 1
            t = torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(fan)) + offset
            self.params[name] = nn.Parameter(t)

        for i, op in enumerate(program.ops):
            kind, key = op[0], f"o{i}"
            src = shapes[op[1]] if isinstance(op[1], int) else None
            out = None
            if kind == "linear":
                _, s, n, bias = op
                p(key + "_w", n, src[-1])
                if bias:
                    p(key + "_b", n, scale=0.1)
                out = src[:-1] + (n,)
            elif kind == "matmul_w":
                _, s, n = op
                p(key + "_w", src[-1], n, scale=1 / math.sqrt(src[-1]))
                out = src[:-1] + (n,)
            elif kind == "bmm":
                out = src[:-1] + (src[-2],)
            elif kind == "conv":
                _, s, oc, k, bias, bn = op
                conv = nn.Conv2d(src[1], oc, k, padding=k // 2, bias=bias)
                with torch.no_grad():
                    conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / math.sqrt(src[1] * k * k))
                    if bias:
                        conv.bias.copy_(torch.randn(oc, generator=g) * 0.1)
                seq = [conv] + ([_batch_norm(oc, g)] if bn else [])
                self.mods[key] = nn.Sequential(*seq)
                out = (src[0], oc, src[2])
            elif kind == "mixconv":
                c, h = src[1], src[1] // 2
                pieces = [(h, 3), (c - h, 5)] if op[2] == "depthwise" else [(h, 1), (c - h, 1)]
                convs = []
                for ci, k in pieces:
                    conv = nn.Conv2d(ci, ci, k, padding=k // 2, groups=ci if op[2] == "depthwise" else 1)
                    with torch.no_grad():
                        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / math.sqrt(conv.weight[0].numel()))
                        conv.bias.copy_(torch.randn(ci, generator=g) * 0.1)
                    convs.append(conv)
                self.mods[key] = nn.ModuleList(convs)
                out = src
            elif kind == "resample":
                out = src
            elif kind == "gate":
                if op[2] == "bias":
                    p(key + "_b", src[-1], scale=0.1)
                out = src[:-1] + (src[-1] // 2,)
            elif kind == "tokenmix":
                _, _, hid, form = op
                sq = src[1]
                wide = {"mlp": hid, "glu": 2 * hid}.get(form, sq)
                p(key + "_w1", wide, sq)
                if form != "plain":
                    p(key + "_b1", wide, scale=0.1)
                if form in ("mlp", "glu"):
                    p(key + "_w2", sq, hid)
                    p(key + "_b2", sq, scale=0.1)
                out = src
            elif kind == "repconv":
                _, _, groups, form = op
                c = src[1]
                gr = 1 if groups == "dense" else c
                for part, k in (("k3", 3), ("k1", 1)):
                    conv = nn.Conv2d(c, c, k, padding=k // 2, groups=gr, bias=False)
                    with torch.no_grad():
                        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / math.sqrt(conv.weight[0].numel()))
                    self.mods[f"{key}_{part}"] = nn.Sequential(conv, _batch_norm(c, g))
                self.mods[f"{key}_id"], self.mods[f"{key}_norm"] = _batch_norm(c, g), _batch_norm(c, g)
                p(key + "_gamma", c, 1, 1, scale=0.5, offset=1.0)
                out = src
            elif kind == "convattn":
                c = src[1]
                for part, oc in (("qkv", 3 * c), ("proj", c)):
                    conv = nn.Conv2d(c, oc, 1)
                    with torch.no_grad():
                        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / math.sqrt(c))
                        conv.bias.copy_(torch.randn(oc, generator=g) * 0.1)
                    self.mods[f"{key}_{part}"] = conv
                out = src
            elif kind == "se":
                for part in ("a", "b"):
                    conv = nn.Conv2d(src[1], src[1], 3, padding=1)
                    with torch.no_grad():
                        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / math.sqrt(src[1] * 9))
                        conv.bias.copy_(torch.randn(src[1], generator=g) * 0.1)
                    self.mods[f"{key}_{part}"] = conv
                out = src
            elif kind == "group_norm":
                if op[3]:
                    p(key + "_w", src[1], scale=0.5)
                    p(key + "_b", src[1], scale=0.1)
                out = src
            elif kind == "layer_norm":
                if op[2]:
                    p(key + "_w", src[-1], scale=0.1, offset=1.0)
                    p(key + "_b", src[-1], scale=0.1)
                out = src
            elif kind == "rms_norm":
                p(key + "_w", src[-1], scale=0.1, offset=1.0)
                out = src
            elif kind in ("act", "softmax", "contiguous", "cast"):
                out = src
            elif kind == "binary":
                _, bop, a, bk, arg = op
                sa = shapes[a]
                if bk == "param":
                    t = torch.randn(*arg, generator=g) * 0.5
                    if bop == "div":
                        t = 0.5 + torch.rand(*arg, generator=g)
                    self.params[key + "_p"] = nn.Parameter(t)
                    out = tuple(torch.broadcast_shapes(sa, tuple(arg)))
                elif bk == "value":
                    out = tuple(torch.broadcast_shapes(sa, shapes[arg]))
                else:
                    out = sa
            elif kind == "pad":
                _, _, dim, lo, hi, _ = op
                out = src[:dim] + (src[dim] + lo + hi,) + src[dim + 1:]
            elif kind == "unfold":
                _, _, k, pad, stride = op
                oh, ow = (2 + 2 * pad - k) // stride + 1, (src[2] // 2 + 2 * pad - k) // stride + 1
                out = (src[0], src[1] * k * k, oh * ow)
            elif kind == "fold":
                _, _, k, pad, stride = op
                h, w = _fold_size(src[2], k, pad, stride)
                out = (src[0], src[1] // (k * k), h * w)
            elif kind == "transpose":
                out = src[:-2] + (src[-1], src[-2])
            elif kind == "permute":
                out = tuple(src[d] for d in op[2])
            elif kind == "merge":
                out = src[:-2] + (src[-2] * src[-1],)
            elif kind == "split":
                out = src[:-1] + (2, src[-1] // 2)
            elif kind in ("roll", "catslice", "headprod"):
                out = src
            elif kind == "attention":
                q, k, v, mask = op[1:5]
                self._make_mask(key, shapes[q][-2], mask, g)
                out = shapes[q]
            elif kind == "sdpa":
                q, k, v, mask = op[1:5]
                if mask not in (None, "causal"):
                    self._make_mask(key, shapes[q][-2], mask, g)
                out = shapes[q][:-1] + (shapes[v][-1],)
            elif kind in ("reduce", "softmax_dim"):
                _, s, rk, dim, keep = op
                out = _reduced(src, dim, keep) if kind == "reduce" or rk == "logsumexp" else src
            elif kind == "unsqueeze":
                d = op[2] % (len(src) + 1)
                out = src[:d] + (1,) + src[d:]
            elif kind == "heads":
                out = src[:-2] + (op[2], src[-2], src[-1] // op[2])
            elif kind == "merge_heads":
                out = src[:-3] + (src[-2], src[-3] * src[-1])
            elif kind == "norm":
                nk = op[2]
                if nk == "ln_module":
                    ln = nn.LayerNorm(src[-1])
                    with torch.no_grad():
                        ln.weight.copy_(1 + 0.1 * torch.randn(src[-1], generator=g))
                        ln.bias.copy_(0.1 * torch.randn(src[-1], generator=g))
                    self.mods[key] = ln
                elif nk in ("ln_manual", "ln_var"):
                    p(key + "_w", src[-1], scale=0.1, offset=1.0)
                    p(key + "_b", src[-1], scale=0.1)
                else:
                    p(key + "_w", src[-1], scale=0.1, offset=0.0 if nk == "rms_gemma" else 1.0)
                out = src
            elif kind == "dropout":
                if op[2] in ("module", "module_inplace"):
                    self.mods[key] = nn.Dropout(0.3, inplace=op[2] == "module_inplace")
                out = src
            elif kind in ("inplace", "host_const"):
                out = src
            elif kind == "mha":
                _, s, h, causal = op
                d = src[-1]
                for nm in ("q", "k", "v", "o"):
                    p(f"{key}_{nm}w", d, d)
                    p(f"{key}_{nm}b", d, scale=0.1)
                if causal:
                    self.register_buffer(key + "_mask", torch.ones(src[1], src[1], dtype=torch.bool).triu(1))
                out = src
            elif kind == "attn_block":
                _, s, hq, hkv, mask, spelling = op
                d, hd = src[-1], src[-1] // hq
                for nm, rows in (("q", d), ("k", hkv * hd), ("v", hkv * hd), ("o", d)):
                    p(f"{key}_{nm}w", rows, d)
                if mask not in (None, "causal"):
                    self._make_mask(key, src[-2], mask, g)
                out = src
            elif kind == "swiglu":
                _, s, hid = op
                p(key + "_g", hid, src[-1])
                p(key + "_u", hid, src[-1])
                p(key + "_d", src[-1], hid)
                out = src
            else:
                raise ValueError(f"unknown op {kind!r}")
            shapes.append(out)
        self.shapes = shapes

    def _make_mask(self, key: str, n: int, mask, g) -> None:
        """The tensor an attention mask spec reads: ``key_mask``, a buffer or a parameter."""
        if mask is True:
            self.register_buffer(key + "_mask", torch.ones(n, n, dtype=torch.bool).triu(1))
        if not isinstance(mask, tuple):
            return
        mk, shape = mask
        if mk == "bias":
            self.params[key + "_mask"] = nn.Parameter(torch.randn(*shape, generator=g) * 0.5)
            return
        if mk == "window":  # Swin's: 0 within a window, -100 across; each leading index its own windows
            i = torch.arange(shape[-2])[:, None]
            j = torch.arange(shape[-1])[None, :]
            lead = math.prod(shape[:-2])
            w = torch.stack([torch.where((i + o) // 2 == (j + o) // 2, 0.0, -100.0) for o in range(lead)])
            self.register_buffer(key + "_mask", w.reshape(shape))
            return
        keep = torch.rand(*shape, generator=g) > 0.4
        keep[..., 0] = True  # every query keeps a key: no all-masked row
        if mk == "pad":
            self.register_buffer(key + "_mask", torch.where(keep, 0.0, torch.finfo(torch.float32).min))
        elif mk == "bool":
            self.register_buffer(key + "_mask", keep)
        else:
            raise ValueError(f"unknown mask kind {mk!r}")

    def _mask_tensor(self, key: str):
        return self.params[key + "_mask"] if key + "_mask" in self.params else getattr(self, key + "_mask")

    def forward(self, x0, x1=None):
        P, prog = self.params, self.program
        env = [x0, x1][: len(prog.inputs)]
        for i, op in enumerate(prog.ops):
            kind, key = op[0], f"o{i}"
            x = env[op[1]] if isinstance(op[1], int) else None
            if kind == "linear":
                y = F.linear(x, P[key + "_w"], P[key + "_b"] if op[3] else None)
            elif kind == "matmul_w":
                y = torch.matmul(x, P[key + "_w"])
            elif kind == "bmm":  # (the .to is a no-op in the model; the fp64 reference keeps a cast's bf16)
                y = x @ env[op[2]].to(x.dtype).transpose(-1, -2)
            elif kind == "conv":
                b, c, n = x.shape
                y = self.mods[key](x.reshape(b, c, 2, n // 2)).flatten(2)
            elif kind == "mixconv":
                b, c, n = x.shape
                parts = torch.split(x.reshape(b, c, 2, n // 2), [m.in_channels for m in self.mods[key]], 1)
                y = torch.cat([m(t) for m, t in zip(self.mods[key], parts)], 1).flatten(2)
            elif kind == "gate":
                _, _, pre, spelling = op
                h = x.shape[-1] // 2
                t = (x.masked_fill(x[..., :1] > 0.5, 0.0) if pre == "masked" else x + P[key + "_b"] if pre == "bias"
                     else x * 0.5)
                a, b = (t.chunk(2, -1) if spelling == "chunk" else t.split(h, -1) if spelling == "split"
                        else (t[..., :h], t[..., h:]))
                y = F.silu(a) * b
            elif kind == "resample":
                b, c, n = x.shape
                img = x.reshape(b, c, 2, n // 2)
                if op[3]:
                    down = F.interpolate(img, scale_factor=0.5, mode="bilinear", align_corners=op[2],
                                         recompute_scale_factor=False)
                else:
                    down = F.interpolate(img, size=(1, n // 4), mode="bilinear", align_corners=op[2])
                y = F.interpolate(down, size=(2, n // 2), mode="bilinear", align_corners=op[2]).flatten(2)
            elif kind == "unfold":
                b, c, n = x.shape
                y = F.unfold(x.reshape(b, c, 2, n // 2), op[2], padding=op[3], stride=op[4])
            elif kind == "fold":
                y = F.fold(x, _fold_size(x.shape[2], op[2], op[3], op[4]), op[2], padding=op[3], stride=op[4]).flatten(2)
            elif kind == "tokenmix":
                form = op[3]
                if form == "mlp":
                    h = F.gelu(F.linear(x.transpose(1, 2), P[key + "_w1"], P[key + "_b1"]))
                    y = F.linear(h, P[key + "_w2"], P[key + "_b2"]).transpose(1, 2)
                elif form == "glu":
                    a, gt = F.linear(x.transpose(1, 2), P[key + "_w1"], P[key + "_b1"]).chunk(2, dim=-1)
                    y = F.linear(a * F.silu(gt), P[key + "_w2"], P[key + "_b2"]).transpose(1, 2)
                elif form == "gate":
                    y = x * F.linear(x.transpose(1, 2), P[key + "_w1"], P[key + "_b1"]).transpose(1, 2)
                else:
                    y = F.linear(torch.relu(x).transpose(1, 2), P[key + "_w1"]).transpose(1, 2)
            elif kind == "repconv":
                b, c, n = x.shape
                h = x.reshape(b, c, 2, n // 2)
                if op[3] == "sum":
                    y = self.mods[key + "_k3"](h) + self.mods[key + "_k1"](h) + self.mods[key + "_id"](h)
                else:
                    y = h + P[key + "_gamma"] * (self.mods[key + "_k3"](h) + self.mods[key + "_id"](h)
                                                 - self.mods[key + "_norm"](h))
                y = y.flatten(2)
            elif kind == "convattn":
                b, c, n = x.shape
                heads = op[2]
                q, k, v = self.mods[key + "_qkv"](x.reshape(b, c, 2, n // 2)).view(b, heads, 3 * c // heads, n).chunk(3, 2)
                q, k, v = (t.transpose(-1, -2).contiguous() for t in (q, k, v))  # (timm's Attention2d)
                a = F.scaled_dot_product_attention(q, k, v)
                y = self.mods[key + "_proj"](a.transpose(-1, -2).reshape(b, c, 2, n // 2)).flatten(2)
            elif kind == "se":
                b, c, n = x.shape
                h = self.mods[key + "_a"](x.reshape(b, c, 2, n // 2))
                gate = h.mean((2, 3), keepdim=True)
                gate = torch.sigmoid(gate) if op[2] == "sigmoid" else F.hardsigmoid(gate)
                y = self.mods[key + "_b"](h * gate).flatten(2)
            elif kind == "group_norm":
                _, _, groups, affine, act, four_d = op
                b, c, n = x.shape
                h = x.reshape(b, c, 2, n // 2).contiguous(memory_format=torch.channels_last) if four_d else x
                h = F.group_norm(h, groups, P[key + "_w"] if affine else None, P[key + "_b"] if affine else None, 1e-5)
                y = (_act(h, act) if act != "none" else h).reshape(b, c, n)
            elif kind == "layer_norm":
                w, bb = (P[key + "_w"], P[key + "_b"]) if op[2] else (None, None)
                y = F.layer_norm(x, (x.shape[-1],), w, bb, 1e-5)
            elif kind == "rms_norm":
                dt = x.dtype
                h = x.to(self.anchor.dtype)
                var = h.pow(2).mean(-1, keepdim=True)
                h = h * torch.rsqrt(var + 1e-6)
                y = P[key + "_w"] * h.to(dt)
            elif kind == "act":
                y = _act(x, op[2])
            elif kind == "softmax":
                y = torch.softmax(x, dim=-1)
            elif kind == "binary":
                _, bop, a, bk, arg = op
                other = P[key + "_p"] if bk == "param" else env[arg] if bk == "value" else arg
                y = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "div": torch.div}[bop](env[a], other)
            elif kind == "transpose":
                y = x.transpose(-1, -2)
            elif kind == "permute":
                y = x.permute(*op[2])
            elif kind == "contiguous":
                y = x.contiguous()
            elif kind == "merge":
                y = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
            elif kind == "split":
                y = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
            elif kind == "pad":
                _, _, dim, lo, hi, value = op
                y = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [lo, hi], value=value)
            elif kind == "roll":  # a concatenation of two strided slices: the tail along a dim, then the head
                _, _, dim, h = op
                y = torch.cat((x.narrow(dim, h, x.shape[dim] - h), x.narrow(dim, 0, h)), dim)
            elif kind == "headprod":  # per-head products of a split projection, heads merged back
                b, n, d = x.shape
                h = op[2]
                q, k, v = torch.cat((x, x * 0.5, -x), -1).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
                y = (q @ (k.softmax(dim=2).transpose(-1, -2) @ v)).transpose(1, 2).reshape(b, n, d)
            elif kind == "catslice":  # a head joined to x and read back as slices, selects or split items
                _, _, dim, k, mode = op
                n = x.shape[dim]
                head = (x.narrow(dim, 0, 1) * 0.5).expand(*x.shape[:dim], k, *x.shape[dim + 1:])
                cat = torch.cat((head, x), dim)
                if mode == "slice":
                    y = cat.narrow(dim, k, n) + cat.narrow(dim, 0, 1)
                elif mode == "split":
                    a, b = torch.split(cat, [k, n], dim)
                    y = b * 2 + a.sum(dim, keepdim=True)
                elif mode == "select":
                    y = cat.narrow(dim, k, n) - cat.select(dim, k - 1).unsqueeze(dim)
                else:
                    y = cat.narrow(dim, k - 1, n)
            elif kind in ("attention", "sdpa"):
                q, k, v, mask = op[1:5]
                y = self._attend(key, env[q], env[k], env[v], mask, _n_rep(op), kind == "sdpa",
                                 broadcast=len(op) > 6 and op[6] == "broadcast")
            elif kind == "attn_block":
                _, _, hq, hkv, mask, spelling = op
                b, n, d = x.shape

                def heads(nm, h):
                    return F.linear(x, P[f"{key}_{nm}w"]).view(b, n, h, d // hq).transpose(1, 2)

                kt = None
                if spelling == "keys_last":  # [B, S, H, Dh] permuted straight to [B, H, Dh, S]
                    kt = F.linear(x, P[f"{key}_kw"]).view(b, n, hkv, d // hq).permute(0, 2, 3, 1)
                a = self._attend(key, heads("q", hq), None if kt is not None else heads("k", hkv), heads("v", hkv),
                                 mask, hq // hkv, spelling == "sdpa", kt=kt)
                y = F.linear(a.transpose(1, 2).reshape(b, n, d), P[key + "_ow"])
            elif kind == "reduce":
                _, _, rk, dim, keep = op
                if rk == "var":
                    y = torch.var(x, dim, keepdim=keep, correction=1 if x.shape[dim] > 1 else 0)
                else:
                    y = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}[rk](x, dim, keepdim=keep)
            elif kind == "softmax_dim":
                _, _, rk, dim, keep = op
                if rk == "logsumexp":
                    y = torch.logsumexp(x, dim, keepdim=keep)
                else:
                    y = (F.softmax if rk == "softmax" else F.log_softmax)(x, dim=dim)
            elif kind == "unsqueeze":
                y = x.unsqueeze(op[2])
            elif kind == "heads":
                y = x.unflatten(-1, (op[2], x.shape[-1] // op[2])).transpose(-3, -2)
            elif kind == "merge_heads":
                y = x.transpose(-3, -2).flatten(-2)
            elif kind == "norm":
                y = self._norm(key, x, op[2])
            elif kind == "inplace":
                y = _inplace(x.clone(), op[2])
            elif kind == "dropout":
                y = self._dropout(key, x, op[2])
            elif kind == "host_const":
                y = _host_const(x, op[2])
            elif kind == "mha":
                _, _, h, causal = op
                b, n, d = x.shape

                def proj(nm, t):
                    return F.linear(t, P[f"{key}_{nm}w"], P[f"{key}_{nm}b"])

                def heads(t):
                    return t.view(b, n, h, d // h).transpose(1, 2)

                q, k, v = heads(proj("q", x)), heads(proj("k", x)), heads(proj("v", x))
                s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // h)
                if causal:
                    s = s.masked_fill(getattr(self, key + "_mask"), float("-inf"))
                a = torch.matmul(torch.softmax(s, dim=-1), v)
                y = proj("o", a.transpose(1, 2).contiguous().view(b, n, d))
            elif kind == "swiglu":
                y = F.linear(F.silu(F.linear(x, P[key + "_g"])) * F.linear(x, P[key + "_u"]), P[key + "_d"])
            elif kind == "cast":
                y = x.to(torch.bfloat16) if op[2] == "bf16" else x.to(self.anchor.dtype)
            env.append(y)
        outs = tuple(env[i] for i in prog.outputs)
        return outs[0] if len(outs) == 1 else outs


    def _attend(self, key, q, k, v, mask, n_rep: int, sdpa: bool, broadcast: bool = False, kt=None):
        """attention of q [.., Hq, S, D] over k/v [.., Hq / n_rep, S, D] under ``mask`` (the op's spec):
        matmul/softmax after repeat_kv, or F.scaled_dot_product_attention (fp32 or bf16; its .to calls
        are no-ops in the model, while in the fp64 reference a bf16 input is fp64 and a cast's bf16 stays);
        ``broadcast``: k/v of one head broadcast by matmul or SDPA themselves; ``kt``: K^T as given (k unused)"""
        if sdpa:
            k, v = k.to(q.dtype), v.to(q.dtype)
            gqa = {"enable_gqa": True} if n_rep > 1 and not broadcast else {}
            if mask is None or mask == "causal":
                return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal", **gqa)
            m = self._mask_tensor(key)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(q.dtype) if m.is_floating_point() else m,
                                                  **gqa)
        if not broadcast:
            k, v = (_repeat_kv(k, n_rep) if k is not None else None), _repeat_kv(v, n_rep)
        s = q @ (kt if kt is not None else k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if mask is True:
            s = s.masked_fill(getattr(self, key + "_mask"), float("-inf"))
        elif isinstance(mask, tuple) and mask[0] == "bool":
            s = s.masked_fill(~self._mask_tensor(key), float("-inf"))
        elif isinstance(mask, tuple):
            s = s + self._mask_tensor(key)
        return torch.softmax(s, dim=-1) @ v

    def _norm(self, key, x, kind):
        P, eps = self.params, 1e-5
        if kind == "ln_module":
            return self.mods[key](x)
        if kind == "ln_manual":
            xc = x - x.mean(-1, keepdim=True)
            return xc / torch.sqrt((xc * xc).mean(-1, keepdim=True) + eps) * P[key + "_w"] + P[key + "_b"]
        if kind == "ln_var":
            var = x.var(-1, keepdim=True, unbiased=False)
            return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(var + eps) * P[key + "_w"] + P[key + "_b"]
        if kind == "rms_plain":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * P[key + "_w"]
        if kind == "rms_gemma":  # computed in the model's float dtype, weight as (1 + w)
            h = x.to(self.anchor.dtype)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (h * (1.0 + P[key + "_w"].to(self.anchor.dtype))).to(x.dtype)
        if kind == "rms_torch":
            return F.rms_norm(x, (x.shape[-1],), P[key + "_w"], 1e-6)
        raise ValueError(f"unknown norm {kind!r}")

    def _dropout(self, key, x, spelling):
        t = self.training
        if spelling in ("module", "module_inplace"):
            return self.mods[key](x)
        if spelling == "functional":
            return F.dropout(x, 0.2, training=t)
        if spelling == "functional_inplace":
            return F.dropout(x * 1.0, 0.2, t, True)
        if spelling == "torch":
            return torch.dropout(x, 0.1, t)
        if spelling == "feature":
            return torch.feature_dropout(x, 0.1, t)
        if spelling == "alpha":
            return F.alpha_dropout(x, 0.1, t)
        if spelling == "native":
            return torch.native_dropout(x, 0.1, t)[0]
        raise ValueError(f"unknown dropout spelling {spelling!r}")


def _fold_size(windows: int, k: int, pad: int, stride: int) -> tuple[int, int]:
    """(H, W) of the smallest image whose k x k windows (padding, stride) are one row of ``windows``."""
    return k - 2 * pad, (windows - 1) * stride + k - 2 * pad


def _broadcast(a: tuple, b: tuple):
    """torch.broadcast_shapes(a, b), or None when they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def _reduced(shape: tuple, dim: int, keepdim: bool) -> tuple:
    d = dim % len(shape)
    return shape[:d] + ((1,) if keepdim else ()) + shape[d + 1:]


def _n_rep(op) -> int:
    """an attention or sdpa op's query heads per k/v head (1: as many k/v heads as query heads)"""
    return op[5] if len(op) > 5 else 1


def _repeat_kv(kv, n: int):
    """HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n, S, D], k/v head h serving query heads h*n .. h*n+n-1"""
    if n == 1:
        return kv
    b, h, s, d = kv.shape
    return kv[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _inplace(y, kind):
    """An in-place op on ``y`` (a fresh copy the forward owns); returns ``y``."""
    k = max(1, y.shape[-1] // 2)
    if kind == "add_":
        y.add_(0.5)
    elif kind == "mul_":
        y.mul_(2.0)
    elif kind == "relu_":
        y.relu_()
    elif kind == "masked_fill_":
        y.masked_fill_(y > 0.5, 0.25)
    elif kind == "slice_fill":
        y[..., :k] = 0.25
    elif kind == "slice_add":
        y[..., :k] += 1.0
    else:
        raise ValueError(f"unknown in-place op {kind!r}")
    return y


def _host_const(x, kind):
    """``x`` combined with a tensor built on the host (torch's default device) during forward and
    moved to x's device, as Swin builds its masks."""
    if kind == "scalar":
        return x * torch.tensor(0.75)
    r, c = x.shape[-2], x.shape[-1]
    if kind == "arange_bias":
        i, j = torch.arange(r), torch.arange(c)
        b = (i[:, None] * 0.25 - j[None, :] * 0.125).abs()
        return x + b.to(x.device)
    if kind == "slice_mask":
        m = torch.zeros(r, c)
        m[: (r + 1) // 2, : (c + 1) // 2] = 1.0
        m[r // 2:, c // 2:] -= 0.5
        return x + m.to(x.device)
    raise ValueError(f"unknown host constant {kind!r}")


def _act(x, kind):
    from ..cuda_ext.ops.bias_act import activation  # the one table of activations (bias_act's reference)

    return activation(x, kind)


def make_inputs(program: Program) -> tuple:
    g = torch.Generator().manual_seed(program.seed + 1)
    return tuple(torch.randn(program.B, program.S, program.D, generator=g).to(_DT[d]) for d in program.inputs)


def _batch_norm(c: int, g: torch.Generator) -> nn.BatchNorm2d:
    """A BatchNorm2d over ``c`` channels with affine and statistics drawn from ``g`` (weight, bias, mean, var)."""
    b = nn.BatchNorm2d(c)
    with torch.no_grad():
        b.weight.copy_(1 + 0.1 * torch.randn(c, generator=g))
        b.bias.copy_(0.1 * torch.randn(c, generator=g))
        b.running_mean.copy_(0.1 * torch.randn(c, generator=g))
        b.running_var.copy_(0.5 + torch.rand(c, generator=g))
    return b


def build(program: Program):
    """(module in eval mode, example inputs)"""
    return ProgramModule(program).eval(), make_inputs(program)


# --------------------------------------------------------------------------- the strategy


# op kinds without parameters of their own: the same op on the same operand computes the same value
REPEATABLE = frozenset({"act", "softmax", "pad", "unfold", "fold", "transpose", "permute", "contiguous", "merge", "split", "roll", "catslice", "headprod", "bmm", "reduce",
                        "softmax_dim", "unsqueeze", "heads", "merge_heads", "cast"})


def programs(max_ops: int = 8):
    """A hypothesis strategy for valid Programs (shapes tracked while drawing)."""
    from hypothesis import strategies as st

    @st.composite
    def draw_program(draw):
        B = draw(st.sampled_from((1, 2)))
        S = draw(st.sampled_from((4, 3, 8)))
        D = draw(st.sampled_from((8, 4, 16)))
        inputs = ("f32",) + tuple(draw(st.lists(st.sampled_from(("f32", "bf16")), max_size=1)))
        env = [((B, S, D), d) for d in inputs]  # (shape, dtype) per value
        ops = []

        def pick(ok):
            """a value index satisfying ok(shape, dtype), preferring the latest (shrinks to it)"""
            cands = [i for i in range(len(env) - 1, -1, -1) if ok(*env[i])]
            if not cands:
                return None
            return cands[draw(st.integers(0, len(cands) - 1))]

        f32 = lambda s, d: d == "f32"  # noqa: E731
        f32_3d = lambda s, d: d == "f32" and len(s) == 3  # noqa: E731
        kinds = ("act", "binary", "linear", "layer_norm", "rms_norm", "mha", "attention", "attn_block", "swiglu", "conv",
                 "group_norm", "se", "repconv", "tokenmix", "convattn",
                 "mixconv", "resample", "gate", "bmm", "matmul_w", "softmax", "transpose", "permute", "contiguous", "merge", "split", "cast",
                 "reduce", "softmax_dim", "unsqueeze", "sdpa", "norm", "inplace", "dropout", "host_const",
                 "heads", "merge_heads", "repeat", "roll", "catslice", "headprod", "pad", "unfold", "fold")

        def mask_shape(sc, kind):
            """a shape broadcasting to the scores ``sc`` for a mask of ``kind``"""
            if kind == "pad":  # [B, 1, .., 1, Sk]
                return tuple(n if i == 0 and len(sc) > 2 else 1 for i, n in enumerate(sc[:-1])) + (sc[-1],)
            r = draw(st.integers(2, len(sc)))
            return tuple(1 if draw(st.booleans()) else n for n in sc[len(sc) - r:-2]) + sc[-2:]

        def draw_mask(sc, kinds):
            kind = draw(st.sampled_from(kinds))
            return (kind, mask_shape(sc, kind)) if kind in ("bias", "pad", "window", "bool") else kind
        n_ops = draw(st.integers(1, max_ops))
        for _ in range(n_ops):
            kind = draw(st.sampled_from(kinds))
            op, out = None, None
            if kind == "act":
                s = pick(lambda s, d: True)
                op, out = ("act", s, draw(st.sampled_from(ACTS))), env[s]
            elif kind == "binary":
                bop = draw(st.sampled_from(BINOPS))
                a = pick(lambda s, d: True)
                sa, da = env[a]
                bk = draw(st.sampled_from(("value", "param", "scalar") if bop != "div" else ("param", "scalar")))
                # any shape broadcasting with a's, across ranks ([B, 1, S] with [B, H, S]), within 512 elements;
                # half the time one of another shape than a's when there is one (else the latest value, often
                # a's own shape, is what the draw favours)
                fits = lambda s, d: _broadcast(s, sa) is not None and math.prod(_broadcast(s, sa)) <= 512  # noqa: E731
                b = None
                if bk == "value" and draw(st.booleans()):
                    b = pick(lambda s, d: fits(s, d) and s != sa)
                    if b is None and len(sa) >= 2:  # none: first reduce a value of a's shape to one that
                        c = pick(lambda s, d: s == sa)  # broadcasts (x - x.amax(-1, keepdim=True), x * y.mean(0))
                        dks = [(dm, kp) for dm in range(len(sa)) for kp in (True, False)
                               if _broadcast(_reduced(sa, dm, kp), sa) == sa and _reduced(sa, dm, kp) != sa]
                        dk = draw(st.sampled_from(dks or [(0, False)]))
                        ops.append(("reduce", c, draw(st.sampled_from(("sum", "mean", "amax", "var")))) + dk)
                        env.append((_reduced(sa, *dk), env[c][1]))
                        b = len(env) - 1
                b = pick(fits) if bk == "value" and b is None else b
                if bk == "value" and b is None:  # a is itself over 512 elements: a scalar operand instead
                    bk = "scalar"
                if bk == "value":
                    out_shape = _broadcast(env[b][0], sa)
                    op, out = ("binary", bop, a, "value", b), (out_shape, "f32" if "f32" in (da, env[b][1]) else da)
                elif bk == "param":
                    # a broadcastable shape: a suffix of sa with some dims set to 1
                    k = draw(st.integers(1, len(sa)))
                    shp = tuple(1 if draw(st.booleans()) else n for n in sa[len(sa) - k:])
                    op, out = ("binary", bop, a, "param", shp), (sa, "f32")
                else:
                    c = draw(st.sampled_from((0.5, 2.0, -1.0, 3.0)))
                    op, out = ("binary", bop, a, "scalar", c), (sa, da)
            elif kind == "linear":
                s = pick(f32)
                if s is not None:
                    n = draw(st.sampled_from((D, 2 * D, 4)))
                    op, out = ("linear", s, n, draw(st.booleans())), (env[s][0][:-1] + (n,), "f32")
            elif kind == "matmul_w":
                s = pick(f32)
                if s is not None:
                    n = draw(st.sampled_from((D, 4)))
                    op, out = ("matmul_w", s, n), (env[s][0][:-1] + (n,), "f32")
            elif kind == "bmm":
                a = pick(lambda s, d: len(s) >= 2)
                if a is not None:
                    b = pick(lambda s, d: s == env[a][0] and d == env[a][1])
                    sa = env[a][0]
                    op, out = ("bmm", a, b), (sa[:-1] + (sa[-2],), env[a][1])
            elif kind == "conv":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    oc = draw(st.sampled_from((4, 2)))
                    k = draw(st.sampled_from((1, 3)))
                    sh = env[s][0]
                    op, out = ("conv", s, oc, k, draw(st.booleans()), draw(st.booleans())), ((sh[0], oc, sh[2]), "f32")
            elif kind == "mixconv":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0 and s[1] % 2 == 0)
                if s is not None:
                    op, out = ("mixconv", s, draw(st.sampled_from(("depthwise", "pointwise")))), env[s]
            elif kind == "gate":
                s = pick(lambda s, d: len(s) >= 2 and s[-1] % 2 == 0)
                if s is not None:
                    sh = env[s][0]
                    pres = ("masked", "bias", "scale") if env[s][1] == "f32" else ("masked", "scale")  # (no promotion)
                    op = ("gate", s, draw(st.sampled_from(pres)), draw(st.sampled_from(("chunk", "split", "slices"))))
                    out = (sh[:-1] + (sh[-1] // 2,), env[s][1])
            elif kind == "resample":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 4 == 0)
                if s is not None:
                    op, out = ("resample", s, draw(st.booleans()), draw(st.booleans())), env[s]
            elif kind == "unfold":
                s = pick(lambda s, d: len(s) == 3 and s[-1] % 2 == 0)
                if s is not None:
                    sh = env[s][0]
                    k, pad, stride = draw(st.sampled_from(((1, 0, 1), (2, 0, 1), (2, 1, 2), (3, 1, 1), (3, 1, 2), (2, 0, 2))))
                    oh, ow = (2 + 2 * pad - k) // stride + 1, (sh[2] // 2 + 2 * pad - k) // stride + 1
                    if oh >= 1 and ow >= 1:
                        op, out = ("unfold", s, k, pad, stride), ((sh[0], sh[1] * k * k, oh * ow), env[s][1])
            elif kind == "fold":
                s = pick(lambda s, d: len(s) == 3)  # (the program's input is one)
                if s is not None:
                    sh = env[s][0]
                    k, pad, stride = draw(st.sampled_from([a for a in ((1, 0, 1), (2, 0, 1), (2, 0, 2), (3, 1, 1), (3, 1, 2))
                                                           if sh[1] % (a[0] * a[0]) == 0]))
                    h, w = _fold_size(sh[2], k, pad, stride)
                    op, out = ("fold", s, k, pad, stride), ((sh[0], sh[1] // (k * k), h * w), env[s][1])
            elif kind == "tokenmix":
                s = pick(f32_3d)
                if s is not None:
                    op = ("tokenmix", s, draw(st.sampled_from((3, 8))), draw(st.sampled_from(("mlp", "glu", "gate", "plain"))))
                    out = env[s]
            elif kind == "repconv":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    op = ("repconv", s, draw(st.sampled_from(("dense", "depthwise"))), draw(st.sampled_from(("sum", "mixer"))))
                    out = env[s]
            elif kind == "convattn":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    c = env[s][0][1]
                    op, out = ("convattn", s, draw(st.sampled_from([h for h in (2, 1) if c % h == 0]))), env[s]
            elif kind == "se":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    op, out = ("se", s, draw(st.sampled_from(("sigmoid", "hardsigmoid")))), env[s]
            elif kind == "group_norm":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    c = env[s][0][1]
                    groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
                    op = ("group_norm", s, groups, draw(st.booleans()), draw(st.sampled_from(("none", "relu", "silu", "gelu"))),
                          draw(st.booleans()))
                    out = env[s]
            elif kind == "layer_norm":
                s = pick(f32)
                if s is not None:
                    op, out = ("layer_norm", s, draw(st.booleans())), env[s]
            elif kind == "rms_norm":
                s = pick(lambda s, d: True)
                op, out = ("rms_norm", s), (env[s][0], "f32")
            elif kind == "softmax":
                s = pick(f32)
                if s is not None:
                    op, out = ("softmax", s), env[s]
            elif kind == "mha":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    h = draw(st.sampled_from((2, 1)))
                    op, out = ("mha", s, h, draw(st.booleans())), env[s]
            elif kind in ("attention", "sdpa"):  # SDPA also in bf16 (lower_attention's case)
                ok = (lambda s, d: d == "f32" and len(s) >= 2) if kind == "attention" else (lambda s, d: len(s) >= 3)
                # [B, H, S, D] heads (what fuse_attention and lower_attention rewrite) when there are some
                q = pick(lambda s, d: ok(s, d) and len(s) == 4) if draw(st.booleans()) else None
                q = q if q is not None else pick(ok)
                if q is not None:
                    sq, dq = env[q]
                    same = lambda s, d: s == sq and d == dq  # noqa: E731
                    # grouped-query half the time there is a k/v value with fewer heads: [B, Hq/n, S, D]
                    fewer = lambda s, d: (d == dq and len(sq) == 4 and len(s) == 4 and s[-3] < sq[-3]  # noqa: E731
                                          and sq[-3] % s[-3] == 0 and s[:-3] + s[-2:] == sq[:-3] + sq[-2:])
                    k = pick(fewer) if len(sq) == 4 and draw(st.booleans()) else None
                    n_rep = sq[-3] // env[k][0][-3] if k is not None else 1
                    if k is None:
                        k, v = pick(same), pick(same)
                    else:
                        v = pick(lambda s, d: s == env[k][0] and d == dq)
                    sc = sq[:-1] + (sq[-2],)
                    if kind == "attention":
                        mask = draw_mask(sc, (False, True, "bias", "pad", "window", "bool"))
                    else:
                        mask = draw_mask(sc, (None, "causal", "bias", "pad", "window", "bool"))
                    op = (kind, q, k, v, mask) + ((n_rep,) if n_rep > 1 else ())
                    if n_rep > 1 and env[k][0][-3] == 1 and draw(st.booleans()):
                        op = op + ("broadcast",)  # multi-query: the one k/v head broadcast, not repeated
                    out = env[q]
            elif kind == "attn_block":
                s = pick(lambda s, d: f32_3d(s, d) and s[-1] % 2 == 0)
                if s is not None:
                    sh = env[s][0]
                    hq = draw(st.sampled_from(tuple(h for h in (2, 4) if sh[-1] % h == 0)))
                    hkv = draw(st.sampled_from(tuple(h for h in (1, 2, hq) if hq % h == 0)))
                    spelling = draw(st.sampled_from(("manual", "sdpa", "keys_last")))
                    hkv = hq if spelling == "keys_last" else hkv
                    sc = (sh[0], hq, sh[1], sh[1])
                    mask = draw_mask(sc, (False, True, "bias", "pad", "window", "bool") if spelling != "sdpa"
                                     else (None, "causal", "bias", "pad", "window", "bool"))
                    op, out = ("attn_block", s, hq, hkv, mask, spelling), env[s]
            elif kind in ("reduce", "softmax_dim"):
                s = pick(lambda s, d: len(s) >= 2)
                if s is not None:
                    sh = env[s][0]
                    dim = draw(st.integers(-len(sh), len(sh) - 1))
                    keep = draw(st.booleans())
                    if kind == "reduce":
                        rk = draw(st.sampled_from(("sum", "mean", "amax", "var")))
                        out_shape = _reduced(sh, dim, keep)
                    else:
                        rk = draw(st.sampled_from(("softmax", "log_softmax", "logsumexp")))
                        out_shape = _reduced(sh, dim, keep) if rk == "logsumexp" else sh
                    op, out = (kind, s, rk, dim, keep), (out_shape, env[s][1])
            elif kind == "unsqueeze":
                s = pick(lambda s, d: len(s) <= 4)
                if s is not None:
                    n = len(env[s][0])
                    d = draw(st.integers(-(n + 1), n))
                    sh, at = env[s][0], d % (n + 1)
                    op, out = ("unsqueeze", s, d), (sh[:at] + (1,) + sh[at:], env[s][1])
            elif kind == "heads":
                s = pick(lambda s, d: 2 <= len(s) <= 3 and s[-1] % 2 == 0)
                if s is not None:
                    sh, h = env[s][0], draw(st.sampled_from(tuple(h for h in (2, 1, 4) if env[s][0][-1] % h == 0)))
                    op, out = ("heads", s, h), (sh[:-2] + (h, sh[-2], sh[-1] // h), env[s][1])
            elif kind == "merge_heads":
                s = pick(lambda s, d: len(s) >= 3)
                if s is not None:
                    sh = env[s][0]
                    op, out = ("merge_heads", s), (sh[:-3] + (sh[-2], sh[-3] * sh[-1]), env[s][1])
            elif kind == "norm":
                s = pick(f32)
                if s is not None:
                    nk = draw(st.sampled_from(("ln_module", "ln_manual", "ln_var", "rms_plain", "rms_gemma", "rms_torch")))
                    op, out = ("norm", s, nk), env[s]
            elif kind == "inplace":
                s = pick(lambda s, d: True)
                ik = draw(st.sampled_from(("add_", "mul_", "relu_", "masked_fill_", "slice_fill", "slice_add")))
                op, out = ("inplace", s, ik), env[s]
            elif kind == "dropout":
                s = pick(lambda s, d: True)
                sp = draw(st.sampled_from(("module", "module_inplace", "functional", "functional_inplace", "torch",
                                           "feature", "alpha", "native")))
                op, out = ("dropout", s, sp), env[s]
            elif kind == "host_const":
                hk = draw(st.sampled_from(("arange_bias", "slice_mask", "scalar")))
                s = pick(lambda s, d: d == "f32" and (len(s) >= 2 or hk == "scalar"))
                if s is not None:
                    op, out = ("host_const", s, hk), env[s]
            elif kind == "swiglu":
                s = pick(f32)
                if s is not None:
                    op, out = ("swiglu", s, draw(st.sampled_from((2 * D, D)))), env[s]
            elif kind == "transpose":
                s = pick(lambda s, d: len(s) >= 2)
                if s is not None:
                    sh = env[s][0]
                    op, out = ("transpose", s), (sh[:-2] + (sh[-1], sh[-2]), env[s][1])
            elif kind == "permute":
                s = pick(lambda s, d: True)
                sh = env[s][0]
                perm = tuple(draw(st.permutations(range(len(sh)))))
                op, out = ("permute", s, perm), (tuple(sh[d] for d in perm), env[s][1])
            elif kind == "contiguous":
                s = pick(lambda s, d: True)
                op, out = ("contiguous", s), env[s]
            elif kind == "merge":
                s = pick(lambda s, d: len(s) >= 3)
                if s is not None:
                    sh = env[s][0]
                    op, out = ("merge", s), (sh[:-2] + (sh[-2] * sh[-1],), env[s][1])
            elif kind == "split":
                s = pick(lambda s, d: len(s) <= 3 and s[-1] % 2 == 0)
                if s is not None:
                    sh = env[s][0]
                    op, out = ("split", s), (sh[:-1] + (2, sh[-1] // 2), env[s][1])
            elif kind == "pad":
                s = pick(lambda s, d: len(s) >= 1)
                if s is not None:
                    sh = env[s][0]
                    dim = draw(st.integers(0, len(sh) - 1))
                    lo, hi = draw(st.sampled_from(((1, 0), (0, 2), (1, 1), (2, 1))))
                    out = (sh[:dim] + (sh[dim] + lo + hi,) + sh[dim + 1:], env[s][1])
                    op = ("pad", s, dim, lo, hi, draw(st.sampled_from((0.0, -1.0, 0.5))))
            elif kind == "roll":
                s = pick(lambda s, d: any(n >= 2 for n in s))
                if s is not None:
                    sh = env[s][0]
                    dim = draw(st.sampled_from([d for d, n in enumerate(sh) if n >= 2]))
                    op, out = ("roll", s, dim, draw(st.integers(1, sh[dim] - 1))), env[s]
            elif kind == "headprod":
                s = pick(lambda s, d: len(s) == 3 and s[-1] % 2 == 0)
                if s is not None:
                    hs = [h for h in (1, 2, 4) if env[s][0][-1] % h == 0]
                    op, out = ("headprod", s, draw(st.sampled_from(hs))), env[s]
            elif kind == "catslice":
                s = pick(lambda s, d: True)
                dim = draw(st.integers(0, len(env[s][0]) - 1))
                mode = draw(st.sampled_from(("slice", "split", "select", "span")))
                op, out = ("catslice", s, dim, draw(st.integers(1, 3)), mode), env[s]
            elif kind == "cast":
                s = pick(lambda s, d: True)
                to = "f32" if env[s][1] == "bf16" else "bf16"
                op, out = ("cast", s, to), (env[s][0], to)
            elif kind == "repeat":  # an earlier parameter-free op again on the same operand (a common subexpression)
                again = [j for j, o in enumerate(ops) if o[0] in REPEATABLE]
                if again:
                    j = draw(st.sampled_from(again))
                    op, out = ops[j], env[len(inputs) + j]
                else:  # nothing to repeat yet: a copy, so a program always has an op
                    s = pick(lambda s, d: True)
                    op, out = ("contiguous", s), env[s]
            if op is not None:
                ops.append(op)
                env.append(out)
        if not ops:  # every drawn kind found no operand: a copy, so a program always has an op
            ops.append(("contiguous", 0))
            env.append(env[0])
        last = len(env) - 1
        extra = draw(st.lists(st.integers(len(inputs), last), max_size=1))
        outputs = (last,) + tuple(e for e in extra if e != last)
        seed = draw(st.integers(0, 3))
        return Program(B, S, D, inputs, tuple(ops), outputs, seed)

    return draw_program()


def pass_subsets(include=None):
    """A strategy for a non-empty subset of ``include`` (default: the strictly fuzzed passes),
    in pipeline order."""
    from hypothesis import strategies as st

    names = [n for n in (include or strict_passes())]
    return st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True).map(
        lambda xs: [n for n in names if n in xs])


def strict_passes() -> list:
    from ..pipeline import available

    return [n for n in available() if n not in STRICT_EXCLUDED]


# --------------------------------------------------------------------------- the property


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def check_program(program: Program, passes, target: str = "cpu", mode: str = "passes", ignore_cost: bool = False):
    """Capture, run ``passes`` (strict: a pass bug raises), and apply the accuracy rule against
    eager; mode "optimize" goes through graphopt.optimize end to end instead. ``ignore_cost``
    (mode "passes"): every rewrite a pass finds legal applies, whatever its predicted gain, so
    rewrites (and orders of rewrites) the cost model would not pick are tested too. Raises
    FuzzFailure on any failure."""
    from .. import accuracy
    from ..capture import capture
    from ..cost.model import CostModel
    from ..cost.profiles import get_profile
    from .. import ir
    from ..pipeline import PassContext, PassManager, assemble

    try:
        model, inputs = build(program)
        with torch.no_grad():
            eager = model(*inputs)
        ref64 = accuracy.fp64_reference(model, inputs, {})
    except Exception as e:  # the generator made a program eager (or its fp64 reference) cannot run
        raise FuzzFailure("program", f"the program does not run eagerly: {_first_line(e)}") from e
    originals = [x.clone() for x in inputs]

    def inputs_unchanged(where: str, pass_name: str = ""):
        for i, (x, x0) in enumerate(zip(inputs, originals)):
            if not torch.equal(x, x0):
                raise FuzzFailure("accuracy", f"{where} wrote into input {i} (the caller's tensor)", pass_name)
    low = torch.bfloat16 if program.uses_bf16() else None
    if mode == "optimize":
        from ..api import optimize

        try:
            opt = optimize(model, inputs, passes=list(passes), target=target)
            with torch.no_grad():
                out = opt(*inputs)
            inputs_unchanged(f"optimize passes {list(passes)} target {target}")
        except FuzzFailure:
            raise
        except Exception as e:
            raise FuzzFailure("optimize", f"passes {list(passes)} target {target}: {_first_line(e)}\n"
                              + traceback.format_exc(limit=-4)) from e
        applied = [p.name for p in opt.report.passes if p.status == "applied"]
        # a graph assign_precision lowered is judged at its dtype's tolerance, as the guard does
        dt = low or (torch.bfloat16 if "assign_precision" in applied else None)
        res = accuracy.check(out, ref64, eager, dtype=dt)
        if not res.passed:
            raise FuzzFailure("accuracy", f"optimize passes {applied} (of {list(passes)}) target {target}: {res.reason}")
        return res
    try:
        gm = capture(model, inputs)
    except Exception as e:
        raise FuzzFailure("capture", _first_line(e)) from e
    profile, _ = get_profile(target)
    ctx = PassContext(cost=CostModel(profile), hints=ir.shape_hints(gm), strict=True, ignore_cost=ignore_cost)
    # one pass at a time (the same loop the PassManager runs), checked after each, so a failure
    # names the first pass that breaks the graph or its numbers
    for p in assemble(list(passes)):
        try:
            (r,) = PassManager([p]).run(gm, ctx)
        except Exception as e:
            raise FuzzFailure("passes", f"{p.name} (in {list(passes)}, target {target}{_ic(ignore_cost)}) raised {_first_line(e)}\n"
                              + traceback.format_exc(limit=-4), p.name) from e
        if r.status != "applied":
            continue
        try:
            with torch.no_grad():
                out = gm(*inputs)
            inputs_unchanged(f"graph after {p.name} (in {list(passes)}, target {target}{_ic(ignore_cost)})", p.name)
        except FuzzFailure:
            raise
        except Exception as e:
            raise FuzzFailure("run", f"graph after {p.name} (in {list(passes)}, target {target}{_ic(ignore_cost)}) fails to run: "
                              f"{_first_line(e)}", p.name) from e
        res = accuracy.check(out, ref64, eager, dtype=low)
        if not res.passed:
            raise FuzzFailure("accuracy", f"after {p.name} (in {list(passes)}, target {target}{_ic(ignore_cost)}): {res.reason}",
                              p.name)
    with torch.no_grad():
        out = gm(*inputs)
    res = accuracy.check(out, ref64, eager, dtype=low)
    if not res.passed:
        raise FuzzFailure("accuracy", f"passes {list(passes)} target {target}: {res.reason}")
    return res


def _ic(ignore_cost: bool) -> str:
    return ", every legal rewrite" if ignore_cost else ""


# --------------------------------------------------------------------------- regressions


def failure_id(program: Program, passes, target, mode, ignore_cost: bool = False) -> str:
    key = (program, list(passes), target, mode) + ((True,) if ignore_cost else ())
    return hashlib.sha1(repr(key).encode()).hexdigest()[:10]


def regression_source(program: Program, passes, target: str, mode: str, error: str, xfail: bool = True,
                      ignore_cost: bool = False) -> str:
    """A standalone pytest file reproducing a (shrunk) failure."""
    msg = " ".join(error.strip().splitlines()[0].split())[:200]
    mark = f"@pytest.mark.xfail(strict=True, reason={msg!r})\n" if xfail else ""
    return (
        f'"""Fuzz regression (graphopt.tools.fuzz): {msg}"""\n\n'
        + ("import pytest\n\n" if xfail else "")
        + "from graphopt.tools.fuzz import Program, check_program\n\n"
        f"PROGRAM = {program!r}\n"
        f"PASSES = {list(passes)!r}\n"
        f"TARGET = {target!r}\n"
        f"MODE = {mode!r}\n"
        + ("IGNORE_COST = True\n" if ignore_cost else "")
        + f"\n\n{mark}"
        "def test_reproduces():\n"
        + ("    check_program(PROGRAM, PASSES, TARGET, MODE, ignore_cost=IGNORE_COST)\n" if ignore_cost
           else "    check_program(PROGRAM, PASSES, TARGET, MODE)\n")
    )


# --------------------------------------------------------------------------- the long campaign

def campaign(argv=None) -> int:
    """The long fuzz campaign (``python benchmarks/sweep.py fuzz``): random programs x random pass
    subsets x targets. Each distinct failure (stage, pass, error type) is shrunk by hypothesis to a
    minimal program and written as tests/fuzz_regressions/test_<hash>.py (xfail(strict=True) until the
    pass is fixed); later rounds treat found signatures as known and keep searching. Half the programs
    in mode "passes" run with ``ignore_cost``."""
    import argparse
    import time
    from pathlib import Path

    from hypothesis import HealthCheck, given, settings, seed as hseed, strategies as st

    from ..pipeline import available

    OUT = Path(__file__).resolve().parents[2] / "tests" / "fuzz_regressions"
    ap = argparse.ArgumentParser(prog="sweep.py fuzz", description="fuzz campaign: random programs through random pass subsets")
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("passes", "optimize", "both"), default="both")
    ap.add_argument("--max-ops", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="report failures, write no regression files")
    args = ap.parse_args(argv)

    known: dict = {}  # signature -> (program, passes, target, mode, message)
    done = [0]
    last: list = []
    modes = ("passes", "optimize") if args.mode == "both" else (args.mode,)
    t0 = time.time()
    for rnd in range(20):
        left = args.examples - done[0]
        if left <= 0:
            break

        @hseed(args.seed * 1000 + rnd)
        @settings(max_examples=left, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  report_multiple_bugs=False, print_blob=False)
        @given(programs(args.max_ops), pass_subsets(strict_passes()), pass_subsets(available()),
               st.sampled_from(("cpu", "h200")), st.sampled_from(modes), st.booleans())
        def prop(program, strict_subset, any_subset, target, mode, ignore_cost):
            done[0] += 1
            passes = strict_subset if mode == "passes" else any_subset
            ignore_cost = ignore_cost and mode == "passes"  # every legal rewrite, whatever its predicted gain
            try:
                check_program(program, passes, target, mode, ignore_cost=ignore_cost)
            except FuzzFailure as e:
                if e.signature() in known:
                    return  # already found; keep looking for others
                last[:] = [e.signature(), (program, passes, target, mode, str(e), ignore_cost)]
                raise

        last.clear()
        try:
            prop()
            break  # a clean round: budget spent with nothing new
        except FuzzFailure:
            sig, found = last  # the final call hypothesis makes replays the shrunk example
            known[sig] = found
            program, passes, target, mode, msg, ignore_cost = found
            print(f"\nFAILURE {sig}\n  program: {program!r}\n  passes: {passes} target: {target} mode: {mode}"
                  f"{' ignore_cost' if ignore_cost else ''}\n  error: {msg.splitlines()[0]}", flush=True)
            if not args.no_write:
                OUT.mkdir(exist_ok=True)
                path = OUT / f"test_{failure_id(program, passes, target, mode, ignore_cost)}.py"
                path.write_text(regression_source(program, passes, target, mode, msg, ignore_cost=ignore_cost))
                print(f"  wrote {path.relative_to(OUT.parent.parent)}", flush=True)
    print(f"\n{done[0]} examples (incl. shrinking) in {time.time() - t0:.0f} s; {len(known)} distinct failures")
    return 1 if known else 0



if __name__ == "__main__":  # python -m graphopt.tools.fuzz --seed N --examples K --max-ops M --mode both --no-write
    raise SystemExit(campaign())
