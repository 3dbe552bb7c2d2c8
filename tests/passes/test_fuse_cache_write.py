"""fuse_cache_write: rotary of q and k + the index_copy_ writes of k and v into a KV cache ->
graphopt::rotary_cache_write (inference, CUDA profiles; the op's reference runs here on the CPU)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import accuracy, capture, ir
from graphopt.examples import decoders
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts

FUSED = "graphopt.rotary_cache_write.default"
PRE = ["eliminate_dead_code", "fold_constants", "fuse_attention", "merge_sibling_linears", "fuse_rotary"]


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Step(nn.Module):
    """One attention layer's decode step over a cache written in place: q/k/v projections, rotary,
    k and v written at ``pos`` (``arange(T) + start`` or given positions), SDPA over the caches.
    ``variant``: "plain"; "k_out" (the rotated k also returned); "read_between" (the cache read
    after the rotary, before the write); "read_after" (the written cache read by a node that does
    not read q)."""

    def __init__(self, heads=4, kv_heads=2, d=16, variant="plain"):
        super().__init__()
        self.h, self.hk, self.d, self.variant = heads, kv_heads, d, variant
        self.q = nn.Linear(64, heads * d, bias=False)
        self.k = nn.Linear(64, kv_heads * d, bias=False)
        self.v = nn.Linear(64, kv_heads * d, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, start=None, positions=None):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        extra = []
        if self.variant == "read_between":
            extra.append(k_cache.sum())
        pos = torch.arange(T) + start if positions is None else positions
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        if self.variant == "k_out":
            extra.append(k * 2)
        if self.variant == "read_after":
            extra.append(v_cache.float().mean())
        return (out, *extra)


def _inputs(B=2, T=1, L=12, start=5, positions=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    ang = torch.randn(1, 1, T, 8, generator=g)
    ang = torch.cat([ang, ang], -1)
    args = [torch.randn(B, T, 64, generator=g, dtype=dtype), ang.cos().to(dtype), ang.sin().to(dtype),
            torch.randn(B, 2, L, 16, generator=g, dtype=dtype), torch.randn(B, 2, L, 16, generator=g, dtype=dtype)]
    if positions:
        return args, {"positions": torch.tensor([7, 2, 9][:T])}
    return args, {"start": torch.tensor(start)}


def _run(model, args, kwargs, passes=PRE + ["fuse_cache_write"], target="h200"):
    gm = capture(model.eval(), (tuple(copy.deepcopy(args)), copy.deepcopy(kwargs)))
    captured = ir.mutation_signature(gm)
    *_, res = run_passes(gm, passes, target=target)
    return gm, res, captured


def _same_as_eager(model, gm, args, kwargs):
    """Outputs and the written caches of the rewritten graph against eager's, by the accuracy rule
    against float64 (each run on its own copy of the caches)."""
    mine, theirs, ref = (copy.deepcopy((args, kwargs)) for _ in range(3))
    with torch.no_grad():
        out = gm(*mine[0], **mine[1])
        eager = model(*theirs[0], **theirs[1])
        m64 = copy.deepcopy(model).double()
        a64 = [t.double() if t.is_floating_point() else t for t in ref[0]]
        ref_out = m64(*a64, **ref[1])
    for got, want, e in [(out[0], ref_out[0], eager[0]), (mine[0][3], a64[3], theirs[0][3]),
                         (mine[0][4], a64[4], theirs[0][4])]:
        assert accuracy.check(got, want, e).passed


@pytest.mark.parametrize("positions", [False, True])
def test_fuses_rotary_and_both_writes(positions):
    model = Step()
    args, kwargs = _inputs(T=1 if not positions else 3, positions=positions)
    gm, res, captured = _run(model, args, kwargs)
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.index_copy_.default"] == 0 and c["graphopt.rotary.default"] == 0
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    pos = node.args[7]
    if positions:
        assert pos.op == "placeholder"  # the given positions, as index_copy_ read them
    else:
        assert tuple(pos.meta["val"].shape) == ()  # the start: the arange + start add is gone
        assert c["aten.add.Tensor"] == 0 and c["aten.arange.default"] == 0
    # the same inputs written as many times; the attention reads the caches after the write
    assert ir.mutation_signature(gm) == captured
    ir.check_invariants(gm)
    _same_as_eager(model, gm, args, kwargs)


@pytest.mark.parametrize("variant,why", [
    ("k_out", "not only written into a cache"),
    ("read_between", "uses a cache between"),
    ("read_after", "reads the written cache but not the rotated q"),
])
def test_refuses_when_the_writes_cannot_move_or_k_is_read(variant, why):
    model = Step(variant=variant)
    args, kwargs = _inputs()
    gm, res, _ = _run(model, args, kwargs)
    assert op_counts(gm)[FUSED] == 0 and op_counts(gm)["aten.index_copy_.default"] == 2
    assert any(why in r.reason for r in res.rejected), res.rejected


def test_cpu_profile_refuses():
    args, kwargs = _inputs()
    gm, _, _ = _run(Step(), args, kwargs, passes=PRE)  # the rotary op, as on a GPU profile
    *_, res = run_passes(gm, ["fuse_cache_write"], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and [r.reason for r in res.rejected] == [NO_FUSED_KERNELS]


@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_decoder_step_one_op_per_layer(family):
    """A Hugging Face decoder's decode step with a StaticCache (GLM: partial interleaved rotary
    with a QKV bias): one rotary_cache_write per layer writing that layer's caches from the start
    position, the cache reads after it by the attention, the logits and every cache by the
    accuracy rule against float64."""
    from transformers import StaticCache

    model = decoders.build(decoders.tiny_config(family), seed=0)
    arg = decoders.cache_arg(model)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(3, 256, (2, 5)), use_cache=True, **{arg: cache})
    inputs = {"input_ids": torch.randint(3, 256, (2, 1)), arg: cache, "use_cache": True}
    gm = capture(model, copy.deepcopy(inputs))
    captured = ir.mutation_signature(gm)
    *_, res = run_passes(gm, PRE + ["fuse_cache_write"], target="h200")
    layers = model.config.num_hidden_layers
    c = op_counts(gm)
    assert c[FUSED] == layers and c["aten.index_copy_.default"] == 0, res.rejected
    assert all(n.args[7].meta["val"].dim() == 0 for n in gm.graph.nodes if str(n.target) == FUSED)
    assert ir.mutation_signature(gm) == captured
    ir.check_invariants(gm)
    mine, theirs = copy.deepcopy(inputs), copy.deepcopy(inputs)
    with torch.no_grad():
        out = gm(**mine)
        eager = model(**theirs)
    ref = accuracy.fp64_reference(model, (), copy.deepcopy(inputs))
    assert accuracy.check(out.logits, ref.logits, eager.logits).passed
    got, want, e = (decoders.returned_cache(o) for o in (out, ref, eager))
    for a, b, x in zip(got.layers, want.layers, e.layers):
        assert accuracy.check(a.keys, b.keys, x.keys).passed and accuracy.check(a.values, b.values, x.values).passed
        assert int(a.cumulative_length) == int(x.cumulative_length)
