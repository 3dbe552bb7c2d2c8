"""Decode steps with transformers' caches: StaticCache capture with its writes kept in place
through every pass, optimize() leaving the caller's inputs untouched, the runner replaying a step
bound to the caller's cache."""

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import graphopt
from graphopt import GuardError, accuracy, capture, ir
from graphopt.examples import decoders
from graphopt.runtime.cuda_graphs import lower

aten = torch.ops.aten


def _cache_arg():
    from transformers import LlamaForCausalLM

    return decoders.cache_arg(LlamaForCausalLM)  # "cache", or "past_key_values" on transformers 5.17


CACHE = _cache_arg()


def _model(family="llama", attn="sdpa"):
    return decoders.build(decoders.tiny_config(family, attn=attn), seed=0)


def _static_step(model, batch=2, prompt=5, max_len=24):
    """A StaticCache filled by a prompt, and the next step's inputs."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    with torch.no_grad():
        model(torch.randint(3, 256, (batch, prompt)), use_cache=True, **{CACHE: cache})
    return {"input_ids": torch.randint(3, 256, (batch, 1)), CACHE: cache, "use_cache": True}


def _dynamic_step(model, batch=2, prompt=5):
    with torch.no_grad():
        cache = decoders.returned_cache(model(torch.randint(3, 256, (batch, prompt)), use_cache=True))
    return {"input_ids": torch.randint(3, 256, (batch, 1)), CACHE: cache, "use_cache": True}


def _tensors(inputs):
    """input_ids and every tensor attribute of every cache layer (keys, values, position)."""
    out = [inputs["input_ids"]]
    for layer in inputs[CACHE].layers:
        out += [v for _, v in sorted(vars(layer).items()) if isinstance(v, torch.Tensor)]
    return out


def _snapshot(inputs):
    """The inputs' tensors by object, address and value, the cache's layer objects and length."""
    cache = inputs[CACHE]
    return ([(t, t.data_ptr(), t.clone()) for t in _tensors(inputs)],
            [id(layer) for layer in cache.layers], int(cache.get_seq_length()))


def _unchanged(inputs, snap):
    tensors, layers, length = snap
    assert len(tensors) > 1 + len(layers)  # keys and values of every layer at least
    assert [id(t) for t in _tensors(inputs)] == [id(t) for t, _, _ in tensors]
    for t, ptr, value in tensors:
        assert t.data_ptr() == ptr and torch.equal(t, value)
    assert [id(layer) for layer in inputs[CACHE].layers] == layers
    assert int(inputs[CACHE].get_seq_length()) == length


def _check_step(model, step_fn, inputs):
    """The accuracy rule (fp64 reference) for one decode step; every run on its own copy."""
    def run(fn):
        with torch.no_grad():
            return fn(**copy.deepcopy(inputs)).logits
    eager, out = run(model), run(step_fn)
    ref = accuracy.fp64_reference(model, (), copy.deepcopy(inputs)).logits
    return accuracy.check(out, ref, eager)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_optimize_leaves_the_callers_decode_inputs_untouched(kind):
    """The accuracy guard runs the model, its fp64 copy and the graph: each on its own copy of
    the cache (before, the eager run appended to the caller's DynamicCache and the graph's guard
    then failed on the longer cache)."""
    model = _model()
    inputs = (_static_step if kind == "static" else _dynamic_step)(model)
    snap = _snapshot(inputs)
    opt = graphopt.optimize(model, inputs)
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]
    _unchanged(inputs, snap)
    assert _check_step(model, opt, inputs).passed


def test_static_decode_step_keeps_its_cache_writes_in_place():
    """Captured: one index_copy_ per layer's keys and values and one add_ per position counter,
    into the inputs themselves; optimized (planned for the H200): the same inputs written as
    often (the rotary and both cache writes fused into rotary_cache_write, the position adds into
    one _foreach_add_), SDPA reading the written caches themselves with enable_gqa (no repeat_kv
    copy), no functional copy of a cache."""
    model = _model()
    inputs = _static_step(model, max_len=24)
    layers = model.config.num_hidden_layers
    gm = capture(model, inputs)
    writes = ir.input_mutations(gm)
    ops = sorted(ir.target_name(n) for n, _ in writes)
    assert ops == sorted(["index_copy_"] * 2 * layers + ["add_.Tensor"] * layers)
    assert all(root.op == "placeholder" for _, root in writes)

    opt = graphopt.optimize(model, inputs, target="h200", check_accuracy=False)
    g = opt.graph_module
    assert ir.mutation_signature(g) == gm.meta[ir.MUTATIONS]
    targets = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert aten.index_copy.default not in targets and aten.copy_.default not in targets
    cache_shape = tuple(inputs[CACHE].layers[0].keys.shape)
    big = [n for n in g.graph.nodes if n.op == "call_function" and n.target not in (aten.index_copy_.default,)
           and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= torch.Size(cache_shape).numel()
           and not ir._returns_alias_of(n)]
    assert big == []  # nothing the size of a cache is made per step
    sdpas = [n for n in g.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(sdpas) == layers
    writer = {root: n for n, root in ir.input_mutations(g)}
    for sd in sdpas:
        assert sd.kwargs.get("enable_gqa") is True and sd.args[3] is not None
        # the caches themselves, written by the fused rotary + cache write whose rotated q it reads
        roots = [ir.alias_root(a) for a in sd.args[1:3]]
        assert all(r.op == "placeholder" for r in roots)
        assert writer[roots[0]] is writer[roots[1]] is sd.args[0]
        assert ir.target_name(sd.args[0]) == "rotary_cache_write"
        assert tuple(sd.args[0].meta["val"].shape)[2] == 1  # q [B, H, 1, D] against the whole cache
    # run on a copy: the copy's cache is written in place, one position further
    mine = copy.deepcopy(inputs)
    ptrs = [layer.keys.data_ptr() for layer in mine[CACHE].layers]
    pos = int(mine[CACHE].get_seq_length())
    with torch.no_grad():
        out = opt(**mine)
    assert [layer.keys.data_ptr() for layer in mine[CACHE].layers] == ptrs
    assert int(mine[CACHE].get_seq_length()) == pos + 1
    assert [layer.keys.data_ptr() for layer in decoders.returned_cache(out).layers] == ptrs  # the returned cache is that memory
    assert _check_step(model, opt, inputs).passed


def test_a_pass_that_drops_or_crosses_a_cache_write_is_caught():
    model = _model()
    gm = capture(model, _static_step(model))
    ir.check_invariants(gm)
    (write, root), = [(n, r) for n, r in ir.input_mutations(gm) if ir.target_name(n) == "index_copy_"][:1]
    # a reader of the cache made before the write, moved after it, reads the written cache
    with gm.graph.inserting_after(write):
        early = gm.graph.call_function(aten.sum.default, (root,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + (early,),) if isinstance(out.args[0], tuple) else out.args
    with pytest.raises(ir.InvariantError, match="from before"):
        ir.check_invariants(gm)
    gm2 = capture(model, _static_step(model))
    write2 = next(n for n, _ in ir.input_mutations(gm2) if ir.target_name(n) == "index_copy_")
    with gm2.graph.inserting_before(write2):  # the write made functional: the caller's cache is never written
        functional = gm2.graph.call_function(aten.index_copy.default, write2.args)
    write2.replace_all_uses_with(functional)
    gm2.graph.erase_node(write2)
    with pytest.raises(ir.InvariantError, match="in-place writes"):
        ir.check_invariants(gm2)


def test_dynamic_cache_step_is_specialized_to_its_past_length():
    """A DynamicCache grows every step: the step is optimized for one past length, and another
    one raises GuardError (optimize_generation's StaticCache keeps one shape)."""
    model = _model()
    inputs = _dynamic_step(model, prompt=5)
    opt = graphopt.optimize(model, inputs, check_accuracy=False)
    with torch.no_grad():
        out = opt(**copy.deepcopy(inputs))
    assert decoders.returned_cache(out).get_seq_length() == 6
    with pytest.raises(GuardError):
        opt(input_ids=inputs["input_ids"], use_cache=True, **{CACHE: decoders.returned_cache(out)})


def test_replayed_step_reads_and_writes_the_callers_cache():
    """The runner (emulated CUDA graph) binds the cache by address: steps advance the caller's
    cache as eager steps advance another copy, tokens equal, no copy of the cache."""
    model = _model()
    inputs = _static_step(model)
    opt = graphopt.optimize(model, inputs, check_accuracy=False)
    mine, theirs = copy.deepcopy(inputs), copy.deepcopy(inputs)
    flat, _ = pytree.tree_flatten(((), mine))
    runner = lower(opt.graph_module, flat, backend="emulate")
    assert runner.decision.on and len(runner.bound_inputs) == 3 * model.config.num_hidden_layers
    ptrs = [t.data_ptr() for t in pytree.tree_leaves(mine[CACHE])]
    for _ in range(3):
        with torch.no_grad():
            got = runner(**mine).logits
            want = model(**theirs).logits
        nxt = want[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(got[:, -1].argmax(-1, keepdim=True), nxt)
        mine["input_ids"].copy_(nxt)
        theirs["input_ids"].copy_(nxt)
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 2 and runner.stats["eager_calls"] == 1
    assert [t.data_ptr() for t in pytree.tree_leaves(mine[CACHE])] == ptrs
    assert int(mine[CACHE].get_seq_length()) == int(theirs[CACHE].get_seq_length())
    for a, b in zip(mine[CACHE].layers, theirs[CACHE].layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)


def test_decode_step_factory_explains_planned_for_the_gpu():
    """examples.decoders.decode_step (what the generator optimizes; the factory behind
    ``graphopt explain graphopt.examples.decoders:llama3_8b_decode``): planned for the H200, the
    report names the cache writes kept in place, and the predicted step is above its floor."""
    module, inputs = decoders.tiny_decode()
    report = graphopt.explain(module, inputs, target="h200", check_accuracy=False)
    assert any("in-place write(s) into 6 input(s)" in n for n in report.notes)
    assert report.predicted_s_after * 1e3 >= report.cost_after["roofline_floor_ms"] > 0
    assert int(inputs["cache"].get_seq_length()) == 16  # the example's cache untouched
