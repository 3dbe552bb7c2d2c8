"""Capture ``nn.MultiheadAttention`` self-attention in the batch-first SDPA form eager runs.

In eager inference ``nn.MultiheadAttention(batch_first=True)`` called as ``mha(x, x, x,
need_weights=False)`` takes its fused fast path (``torch._native_multi_head_attention``). Tracing
disables that path (fake tensors, ``make_fx``), so ``torch.export`` records
``F.multi_head_attention_forward``'s general path instead: a transpose to sequence-first, the
in-projection, an ``unflatten/unsqueeze/transpose/squeeze/contiguous`` copy of the packed QKV,
views to [B, H, S, D], SDPA, ``permute + reshape`` (a second copy), the out-projection and a
transpose back - layout traffic the fast path never pays.

For the duration of the trace only, :func:`batch_first_sdpa` gives every ``nn.MultiheadAttention``
instance a forward that decides in Python, from the call's arguments and the module's config,
whether the call is one this form computes exactly:

* self-attention (``query is key is value``), a 3-D batched input, ``batch_first=True``,
  packed in-projection (``_qkv_same_embed_dim``), no ``bias_k``/``bias_v``, ``add_zero_attn=False``,
  ``need_weights=False``, no ``attn_mask``, ``is_causal=False``, the query's last dim equal to
  ``embed_dim`` and its dtype that of the projection weights;
* ``key_padding_mask`` of shape (B, S), bool or floating: converted by torch's own
  ``F._canonical_mask`` (bool -> 0 / -inf in the query's dtype) and passed to SDPA as a [B, 1, 1, S]
  additive mask - the same values the general path passes as [B, H, 1, S];
* training mode: SDPA gets ``dropout_p = self.dropout`` exactly as the general path passes it (the
  same SDPA call on q/k/v of the same shape [B, H, S, D], so the same dropout distribution).

Such a call becomes::

    qkv = F.linear(x, in_proj_weight, in_proj_bias).view(B, S, 3, H, D)
    q, k, v = qkv.select(2, i).transpose(1, 2)            # [B, H, S, D] views, no copies
    out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p)
    out = F.linear(out.transpose(1, 2).reshape(B, S, E), out_proj.weight, out_proj.bias)
    return out, None

which is the general path's function: q[b, h, s, d] = proj[b, s, i*E + h*D + d] in both, the same
SDPA (default scale 1/sqrt(D)), and the same projections row by row. SDPA writes its output as
[B, S, H, D] in memory (its meta strides say so; CUDA's flash/efficient kernels and the CPU kernel
do), so the final ``reshape`` is a view. Any other call runs the module's own forward, and the
reason is recorded. A subclass that overrides ``forward``, or an instance whose ``forward`` was
already replaced, is left alone.

Opt-out: ``capture(..., mha="module")`` or the environment variable ``GRAPHOPT_MHA=module``
(``optimize()`` and the CLI read it).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CaptureError

MODES = ("sdpa", "module")
ENV = "GRAPHOPT_MHA"


def resolve_mode(mode: str | None) -> str:
    """``mode`` or, when None, the environment variable GRAPHOPT_MHA (default "sdpa")."""
    source = "mha="
    if mode is None:
        mode = os.environ.get(ENV, "").strip() or "sdpa"
        source = f"{ENV}="
    if mode not in MODES:
        raise CaptureError(f"{source}{mode!r} is not one of {', '.join(repr(m) for m in MODES)} "
                           "(\"module\" keeps nn.MultiheadAttention's own forward)")
    return mode


@dataclass
class MhaCapture:
    """What happened to each nn.MultiheadAttention call during one trace."""

    mode: str = "sdpa"
    sdpa: Counter = field(default_factory=Counter)  # module name -> calls captured in the SDPA form
    kept: dict = field(default_factory=dict)  # module name -> {reason: calls} that ran the module's forward
    skipped: dict = field(default_factory=dict)  # module name -> why its forward was not replaced at all

    def keep(self, name: str, reason: str) -> None:
        self.kept.setdefault(name, Counter())[reason] += 1

    def as_dict(self) -> dict:
        return {"mode": self.mode, "sdpa_calls": sum(self.sdpa.values()),
                "kept_calls": sum(sum(c.values()) for c in self.kept.values()),
                "kept": {name: dict(reasons) for name, reasons in self.kept.items()},
                "skipped": dict(self.skipped)}

    def notes(self) -> list[str]:
        """One line for the calls captured in the SDPA form, one per reason for the others."""
        out = []
        n = sum(self.sdpa.values())
        if n:
            out.append(f"nn.MultiheadAttention: {n} call(s) captured in the batch-first SDPA form "
                       "(the fused path's layout: no QKV or output copies)")
        by_reason: dict[str, list] = {}
        for name, reasons in self.kept.items():
            for reason, calls in reasons.items():
                by_reason.setdefault(reason, []).append((name, calls))
        for name, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append((name, 0))
        for reason, where in by_reason.items():
            names = [nm or "(the model)" for nm, _ in where]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            calls = sum(c for _, c in where)
            what = f"{calls} call(s) of {shown}" if calls else shown
            out.append(f"nn.MultiheadAttention kept its own forward for {what}: {reason}")
        return out


def why_not(mod: nn.MultiheadAttention, query, key, value, key_padding_mask, need_weights, attn_mask,
            is_causal) -> str:
    """Why this call cannot be captured in the SDPA form ('' when it can)."""
    if not isinstance(query, torch.Tensor):
        return "query is not a tensor"
    if query is not key or key is not value:
        return "not self-attention (query, key and value are not the same tensor)"
    if query.dim() != 3:
        return f"unbatched input (query is {query.dim()}-D)"
    if not mod.batch_first:
        return "batch_first=False"
    if not mod._qkv_same_embed_dim or mod.in_proj_weight is None:
        return "separate q/k/v projections (kdim or vdim differ from embed_dim)"
    if mod.bias_k is not None or mod.bias_v is not None:
        return "add_bias_kv=True"
    if mod.add_zero_attn:
        return "add_zero_attn=True"
    if need_weights:
        return "need_weights=True (the attention weights are returned)"
    if attn_mask is not None:
        return "an attn_mask is given"
    if is_causal:
        return "is_causal=True"
    if query.shape[-1] != mod.embed_dim:
        return f"query's last dim {query.shape[-1]} is not embed_dim {mod.embed_dim}"
    if query.dtype != mod.in_proj_weight.dtype or (mod.in_proj_bias is not None and query.dtype != mod.in_proj_bias.dtype):
        return f"query dtype {query.dtype} differs from the in-projection's {mod.in_proj_weight.dtype}"
    if key_padding_mask is not None:
        kpm = key_padding_mask
        if not isinstance(kpm, torch.Tensor) or kpm.dim() != 2:
            return "key_padding_mask is not a (batch, seq) tensor"
        if kpm.dtype != torch.bool and not torch.is_floating_point(kpm):
            return f"key_padding_mask of dtype {kpm.dtype}"
        shape = tuple(kpm.shape)
        want = tuple(query.shape[:2])
        if all(isinstance(s, int) for s in shape + want) and shape != want:
            return f"key_padding_mask shape {list(shape)} is not (batch, seq) {list(want)}"
    return ""


def sdpa_form(mod: nn.MultiheadAttention, x: torch.Tensor, key_padding_mask=None):
    """``mod(x, x, x, key_padding_mask, need_weights=False)`` for a call :func:`why_not` accepts."""
    B, S, E = x.shape
    H = mod.num_heads
    D = mod.head_dim
    qkv = F.linear(x, mod.in_proj_weight, mod.in_proj_bias).view(B, S, 3, H, D)
    q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))
    mask = None
    if key_padding_mask is not None:
        kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask", other_type=None,
                                other_name="attn_mask", target_type=x.dtype)
        mask = kpm.view(B, 1, 1, S)
    out = F.scaled_dot_product_attention(q, k, v, mask, mod.dropout if mod.training else 0.0, False)
    out = out.transpose(1, 2).reshape(B, S, E)
    return F.linear(out, mod.out_proj.weight, mod.out_proj.bias), None


def _forward(mod: nn.MultiheadAttention, name: str, record: MhaCapture):
    own = nn.MultiheadAttention.forward

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        reason = why_not(mod, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason:
            record.keep(name, reason)
            return own(mod, query, key, value, key_padding_mask, need_weights, attn_mask,
                       average_attn_weights, is_causal)
        record.sdpa[name] += 1
        return sdpa_form(mod, query, key_padding_mask)

    forward.graphopt_mha = True
    return forward


@contextlib.contextmanager
def batch_first_sdpa(model: nn.Module, record: MhaCapture):
    """Within the block, every nn.MultiheadAttention in ``model`` computes eligible calls in the
    SDPA form; their forwards are restored on exit, also when the block raises."""
    patched = []
    try:
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.MultiheadAttention):
                continue
            if record.mode == "module":
                record.skipped[name] = f"{ENV}=module (mha='module')"
            elif type(mod).forward is not nn.MultiheadAttention.forward:
                record.skipped[name] = f"{type(mod).__name__} overrides forward"
            elif "forward" in mod.__dict__:
                record.skipped[name] = "its forward was replaced on the instance"
            else:
                mod.forward = _forward(mod, name, record)
                patched.append(mod)
        yield record
    finally:
        for mod in patched:
            mod.__dict__.pop("forward", None)
