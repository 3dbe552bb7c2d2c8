"""lower_decode_attention: SDPA of a decode step over a static K/V cache -> graphopt::decode_attention
(inference, CUDA profiles), with kv_len derived from the mask where the mask proves it."""
import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from graphopt import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

DECODE = "graphopt.decode_attention.default"
SDPA = "aten.scaled_dot_product_attention.default"


def graphed_h200():
    """The H200 profile as optimize() plans static-shape GPU inference: CUDA-graph launch costs."""
    p, _ = get_profile("h200")
    return dataclasses.replace(p, launch_overhead_s=p.launch_overhead_graph_s)


class DecodeStep(nn.Module):
    """One attention layer's decode step over a static cache, spelled as Hugging Face's Llama with a
    StaticCache is under torch.export: the new K/V written into the cache at ``cache_position``,
    the mask ``arange(L) <= cache_position`` expanded over the batch, ``repeat_kv``, SDPA."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, gqa="repeat_kv", dropout=0.0, mask="positions"):
        super().__init__()
        self.h, self.hk, self.d, self.gqa, self.dropout, self.mask = heads, kv_heads, head_dim, gqa, dropout, mask
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, cache_position, k_cache, v_cache, pad=None):
        B, T, _ = x.shape
        L = k_cache.shape[2]
        q = self.q(x).view(B, T, -1, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.d).transpose(1, 2)
        k_cache = k_cache.index_copy(2, cache_position, k)
        v_cache = v_cache.index_copy(2, cache_position, v)
        mask = None
        if self.mask == "positions":
            mask = (torch.arange(L) + 0)[None, None, None, :] <= cache_position[None, None, :, None]
            mask = mask.expand(B, -1, T, L)
        elif self.mask == "input":
            mask = pad
        kw = {}
        if self.gqa == "repeat_kv":
            ks, vs = repeat_kv(k_cache, self.h // self.hk), repeat_kv(v_cache, self.h // self.hk)
        else:
            ks, vs = k_cache, v_cache
            kw["enable_gqa"] = self.h != self.hk
        out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, dropout_p=self.dropout, scale=self.d ** -0.5,
                                             **kw)
        return self.o(out.transpose(1, 2).reshape(B, T, -1)), k_cache, v_cache


def _inputs(B=2, T=1, L=48, past=20, kv_heads=2, head_dim=16, dtype=torch.bfloat16, hidden=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, hidden, generator=g, dtype=dtype)
    k_cache = torch.randn(B, kv_heads, L, head_dim, generator=g, dtype=dtype)  # past and stale entries
    v_cache = torch.randn(B, kv_heads, L, head_dim, generator=g, dtype=dtype)
    return x, torch.arange(past, past + T), k_cache, v_cache


def _lower(model, args, target=None, pre=("fuse_attention",)):
    gm = capture(model.eval(), args)
    results = run_passes(gm, list(pre) + ["lower_decode_attention"], target=target or graphed_h200())
    return gm, results[-1]


@pytest.mark.parametrize("T,pre", [(1, ("fuse_attention",)), (4, ("fold_constants", "fuse_attention"))])
def test_decode_step_lowers_with_kv_len_and_matches(T, pre):
    """Also after fold_constants, which turns the mask's arange over the keys into a constant."""
    # a decode-sized layer (Llama-3-8B's heads, 1280 cache positions): big enough that the kernel's
    # cache read, not its two launches, decides against SDPA's predicted time
    model = DecodeStep(heads=32, kv_heads=8, head_dim=128).to(torch.bfloat16)
    args = _inputs(T=T, L=1280, past=1000, kv_heads=8, head_dim=128)
    gm, res = _lower(model, args, pre=pre)
    assert res.status == "applied" and len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    assert "kv_len from the mask" in res.rewrites[0].pattern
    counts = op_counts(gm)
    assert counts.get(DECODE) == 1 and SDPA not in counts
    assert "aten.expand.default" in counts  # the mask's expand stays; repeat_kv's are gone
    (node,) = [n for n in gm.graph.nodes if str(n.target) == DECODE]
    q, k, v, mask, kv_len, scale = node.args
    assert ir_shape(k) == (2, 8, 1280, 128) and scale == pytest.approx(128 ** -0.5)  # the cache itself, not repeated
    assert kv_len.target is torch.ops.aten.add.Tensor and kv_len.args[1] == 1
    assert kv_len.args[0].target is torch.ops.aten.amax.default
    assert reference_check(model, gm, args).passed
    # kv_len is the last position + 1, so the stale cache entries after it are never read
    assert int(_node_value(gm, kv_len, args)) == 1000 + T


def ir_shape(node):
    return tuple(node.meta["val"].shape)


def _node_value(gm, node, args):
    """The value ``node`` takes when gm runs on args."""
    seen = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n is node:
                seen["v"] = out
            return out

    with torch.no_grad():
        Record(gm).run(*args)
    return seen["v"]


def test_enable_gqa_without_a_mask_lowers_without_kv_len():
    model = DecodeStep(gqa="enable_gqa", mask=None).to(torch.bfloat16)
    args = _inputs()
    gm, res = _lower(model, args)
    assert len(res.rewrites) == 1 and "kv_len" not in res.rewrites[0].pattern
    (node,) = [n for n in gm.graph.nodes if str(n.target) == DECODE]
    assert node.args[3] is None and node.args[4] is None
    assert reference_check(model, gm, args).passed


def test_a_mask_from_the_inputs_is_passed_without_kv_len():
    """A padding mask the caller passes proves no bound on the keys: the whole cache is read."""
    model = DecodeStep(mask="input").to(torch.bfloat16)
    x, pos, kc, vc = _inputs()
    keep = torch.rand(2, 1, 1, 48, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    args = (x, pos, kc, vc, keep)
    gm, res = _lower(model, args)
    assert len(res.rewrites) == 1 and "kv_len" not in res.rewrites[0].pattern
    (node,) = [n for n in gm.graph.nodes if str(n.target) == DECODE]
    assert node.args[3] is not None and node.args[4] is None
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("what,why", [
    ("prefill", "not a decode step"),
    ("dropout", "dropout 0.1"),
    ("head dim", "head dim 12"),
    ("fp32", "bf16 and fp16 only"),
    ("cpu", "CPU"),
])
def test_refusals(what, why):
    dtype = torch.float32 if what == "fp32" else torch.bfloat16
    d = 12 if what == "head dim" else 16
    model = DecodeStep(head_dim=d, dropout=0.1 if what == "dropout" else 0.0).to(dtype)
    args = _inputs(T=20 if what == "prefill" else 1, head_dim=d, dtype=dtype)
    gm, res = _lower(model, args, target="cpu" if what == "cpu" else None)
    assert not res.rewrites and why in res.rejected[0].reason, res.rejected
    assert op_counts(gm).get(SDPA) == 1 and DECODE not in op_counts(gm)


def test_the_cost_model_prices_the_cache_read():
    model = DecodeStep(heads=32, kv_heads=8, head_dim=128, hidden=64).to(torch.bfloat16)
    args = _inputs(B=1, L=4352, past=1024, kv_heads=8, head_dim=128)
    gm, res = _lower(model, args)
    (node,) = [n for n in gm.graph.nodes if str(n.target) == DECODE]
    p = graphed_h200()
    c = CostModel(p).node_cost(node)
    cache = 2 * 8 * 4352 * 128 * 2
    # one launch: the last of its 17 key splits combines them
    assert cache < c.bytes < 1.2 * cache and c.launches == 1 and c.bound == "memory"
    assert c.time_s == pytest.approx(c.bytes / p.bandwidth + p.kernel_fixed_s)
    # SDPA over the repeated cache, and the repeat copies, cost more than the cache read
    assert res.rewrites[0].predicted_gain_s > c.time_s


def test_training_graphs_are_left_alone():
    model = DecodeStep().to(torch.bfloat16).train()
    gm = capture(model, _inputs())
    (res,) = run_passes(gm, ["lower_decode_attention"], target=graphed_h200(), training=True)
    assert DECODE not in op_counts(gm) and res.status in ("skipped", "disabled", "unchanged")


def test_key_bound_reads_comparisons_and_conjunctions():
    from graphopt.passes.lower_decode_attention import key_bound

    class M(nn.Module):
        def forward(self, pos, keep):
            j = torch.arange(2, 50)  # key j holds j + 2
            causal = pos[None, None, :, None] > j[None, None, None, :]  # j + 2 < pos: j <= pos - 3
            both = causal & keep
            return torch.where(both, 0.0, float("-inf")), torch.where(both, 0.0, -1e9), keep & keep

    gm = capture(M(), (torch.tensor([30]), torch.ones(1, 1, 1, 48, dtype=torch.bool)))
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    bound = key_bound(outs[0], 48)
    assert bound is not None and bound[1] == -3 and bound[0].meta["val"].shape[-1] == 1
    assert bound[2].target is torch.ops.aten.gt.Tensor
    assert key_bound(outs[1], 48) is None  # a finite fill: excluded keys still take part
    assert key_bound(outs[2], 48) is None  # nothing ties the mask to the key index


def test_constant_key_index():
    from graphopt.passes.lower_decode_attention import _constant_offset

    assert _constant_offset(torch.arange(5, 53)[None, None, None, :].expand(2, 1, 1, 48), 48) == 5
    assert _constant_offset(torch.arange(48).flip(0), 48) is None
    assert _constant_offset(torch.arange(48.0), 48) is None


@pytest.mark.slow
def test_hugging_face_llama_with_a_static_cache():
    """The graph torch.export makes of a two-layer Llama decode step over transformers' StaticCache
    (TorchExportableModuleWithStaticCache): both layers lowered over the cache buffers themselves,
    one kv_len for both, and the step matches float64 with a random past in the cache."""
    import copy

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    from graphopt import accuracy

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base = LlamaForCausalLM(cfg).eval()

    def wrapped(dtype):
        m = copy.deepcopy(base).to(dtype)
        m.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=48,
                                               cache_config={"batch_size": 2, "max_cache_len": 48})
        return TorchExportableModuleWithStaticCache(m, batch_size=2, max_cache_len=48)

    w, w64 = wrapped(torch.bfloat16), wrapped(torch.float64)
    kw = {"input_ids": torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(0)),
          "cache_position": torch.tensor([21])}
    gm = capture(w, ((), kw))
    results = run_passes(gm, ["fold_constants", "fuse_attention", "lower_decode_attention"], target=graphed_h200())
    assert len(results[-1].rewrites) == 2
    counts = op_counts(gm)
    assert counts.get(DECODE) == 2 and SDPA not in counts and counts.get("aten.amax.default") == 1
    for n in gm.graph.nodes:
        if str(n.target) == DECODE:
            assert n.args[1].target is torch.ops.aten.index_copy_.default  # the cache buffer, not a repeat
    g = torch.Generator().manual_seed(1)
    past = {n: torch.randn(b.shape, generator=g) for n, b in w.named_buffers() if "_cache_" in n}
    with torch.no_grad():
        for mod in (w, w64):  # gm reads w's buffers
            for n, b in mod.named_buffers():
                if n in past:
                    b.copy_(past[n].to(b.dtype))
        eager, out, ref = w(**kw), gm(**kw), w64(**kw)
    assert accuracy.check(out, ref, eager).passed
