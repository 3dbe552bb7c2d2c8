"""graphopt's own ops are priced through the registry of graphopt.cost.ops, never by name: every op
has the cost function its module declared, the cost model follows whatever is registered, no op
name of ours appears in the cost model's code, and cost/ imports nothing above it. Old profile
JSONs with per-op fields load into the op_efficiency table."""
import ast
import json
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import graphopt.cuda_ext as ce
from graphopt import capture
from graphopt.cost import ops as op_costs
from graphopt.cost.model import CostModel
from graphopt.cost.ops import OpCost
from graphopt.cost.profiles import LEGACY_FIELDS, DeviceProfile, get_profile

COST = Path(op_costs.__file__).resolve().parent
G = torch.ops.graphopt


class AllOps(torch.nn.Module):
    """One call of every registered op, each on the example arguments its module declares."""

    def __init__(self, examples: dict):
        super().__init__()
        self.names = list(examples)
        leaves, self.spec = tree_flatten([examples[n] for n in self.names])
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.inputs = tuple(leaves[i] for i in self.slots)  # the example tensors, in the order forward takes them

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        calls = tree_unflatten(leaves, self.spec)
        return tuple(getattr(G, name)(*args) for name, args in zip(self.names, calls))


def _graph():
    torch.manual_seed(0)
    m = AllOps({name: op.example() for name, op in ce.registry.all_ops().items()}).eval()
    return capture(m, m.inputs)


def _op_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("graphopt.")]


def test_every_op_has_its_modules_cost_function():
    ops = ce.registry.all_ops()
    assert set(ops) <= set(op_costs.registered())
    for name, op in ops.items():
        assert op_costs.op_cost_fn(name) is op.cost
        assert op_costs.op_cost_fn(f"graphopt::{name}") is op.cost
    assert all(callable(op.example) for op in ops.values())  # every module declares its example call
    gm = _graph()
    assert {str(n.target).split(".")[1] for n in _op_nodes(gm)} == set(ops)  # the graph calls every op
    p = get_profile("h200")[0]
    cm = CostModel(p)
    for n in _op_nodes(gm):
        c = ops[str(n.target).split(".")[1]].cost(op_costs.op_call(n), p)
        assert cm.flops_bytes(n) == (c.flops, c.bytes, c.launches, c.kind)


def test_the_cost_model_prices_whatever_is_registered(monkeypatch):
    """Every op registered with the same stand-in cost: each node then costs exactly the roofline
    of that stand-in, whatever its name (layer_norm is also an aten op the model knows)."""
    gm = _graph()
    p = get_profile("h200")[0]
    stand_in = OpCost(flops=3e9, bytes=5e7, launches=2, kind="fused")
    for name in ce.registry.all_ops():
        monkeypatch.setitem(op_costs._COSTS, name, lambda call, profile: stand_in)
    compute, memory = stand_in.flops / p.elementwise_flops, stand_in.bytes / p.bandwidth
    cm = CostModel(p)
    for n in _op_nodes(gm):
        assert cm.flops_bytes(n) == (3e9, 5e7, 2, "fused")
        c = cm.node_cost(n)
        assert (c.compute_s, c.memory_s) == (compute, memory)
        assert c.time_s == p.kernel_seconds(compute, memory, "memory", 2)
        assert cm.node_times(n) == (2 * p.launch_overhead_s, p.gpu_seconds(compute, memory))


def test_op_cost_fields_reach_the_time(monkeypatch):
    """rate, slowdown, floor_s, time_s and an op_efficiency key each act on the node's time."""
    gm = _graph()
    node = next(n for n in _op_nodes(gm) if str(n.target) == "graphopt.swiglu.default")
    p = get_profile("h200")[0].with_efficiency("toy", {"scale": 0.5, "fixed_s": 1e-6})
    price = lambda **kw: CostModel(p).node_cost(node)  # noqa: E731

    def priced(**kw):
        monkeypatch.setitem(op_costs._COSTS, "swiglu", lambda call, profile: OpCost(1e12, 1e9, **kw))
        return price()

    base = priced(kind="matmul", efficiency="matmul")
    assert base.compute_s == 1e12 / p.matmul_rate(torch.float32)
    assert priced(kind="matmul", efficiency="matmul", rate=1e15).compute_s == 1e12 / 1e15
    slow = priced(kind="matmul", efficiency="matmul", slowdown=2.0)
    assert (slow.compute_s, slow.memory_s) == (2 * base.compute_s, 2 * base.memory_s)
    assert priced(floor_s=1.0).time_s == 1.0
    assert priced(time_s=0.25, launches=3).time_s == 0.25
    toy = priced(efficiency="toy")
    assert toy.time_s == max(toy.compute_s / 0.5, toy.memory_s) + 1e-6


def test_an_op_without_a_cost_function_is_an_error(monkeypatch):
    from graphopt.errors import GraphoptError

    gm = _graph()
    node = next(n for n in _op_nodes(gm) if str(n.target) == "graphopt.rotary.default")
    monkeypatch.delitem(op_costs._COSTS, "rotary")
    with pytest.raises(GraphoptError, match="graphopt::rotary has no cost function"):
        CostModel(get_profile("h200")[0]).node_cost(node)


def _code_strings(path: Path) -> set[str]:
    """String constants of a module's code, docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs}


def test_the_cost_model_names_none_of_our_ops():
    """No branch on a graphopt op's name in the cost model: our ops price themselves. (A name
    that is also an aten op, layer_norm, is the aten op's there; the test above shows our node
    never reaches it.)"""
    ours = {n for n in ce.registry.all_ops() if not hasattr(torch.ops.aten, n)}
    assert {"short_attention", "gemm_swiglu", "linear_add_layer_norm", "conv_bias_relu", "add_rms_norm"} <= ours
    for path in (COST / "model.py", COST / "ops.py"):
        found = {s for s in _code_strings(path) for name in ours if name in s}
        assert not found, f"{path.name} names graphopt ops: {sorted(found)}"


def test_cost_imports_nothing_above_it():
    allowed = {"graphopt.ir", "graphopt.errors", "graphopt.timing"}
    for path in sorted(COST.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ("graphopt.cost" if node.level == 1 else "graphopt") + (f".{node.module}" if node.module else "")
                mods = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                if m.startswith("graphopt"):
                    assert m in allowed or m.startswith("graphopt.cost"), f"{path.name} imports {m}"


def test_profiles_with_the_old_per_op_fields_load_the_same(tmp_path):
    """A profile JSON written before op_efficiency (norm_row_s, pool_bandwidth_scale,
    short_attention_scale, short_attention_fixed_s as fields) loads into the table."""
    h200 = get_profile("h200")[0]
    old = h200.to_dict()
    table = dict(old.pop("op_efficiency"))
    for field, (key, name, _) in LEGACY_FIELDS.items():
        old[field] = table[key][name]
        table[key] = {k: v for k, v in table[key].items() if k != name}
    old["op_efficiency"] = {k: v for k, v in table.items() if v}  # entries that never were fields stay
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert get_profile(str(path))[0] == h200
    # the old defaults meant "not measured": no entry
    bare = {k: v for k, v in old.items() if k not in LEGACY_FIELDS and k != "op_efficiency"}
    unmeasured = DeviceProfile.from_dict({**bare, "norm_row_s": 0.0, "pool_bandwidth_scale": 1.0,
                                          "short_attention_scale": None, "short_attention_fixed_s": 0.0})
    assert unmeasured.op_efficiency == {}
    assert DeviceProfile.from_dict(h200.to_dict()) == h200


def test_a_pointwise_kernel_gathering_many_inputs_takes_a_load_per_element_and_input():
    """The unrolled q @ kv of CoaT (16 slices read through their strides over 12.8 M outputs: 427 us
    measured on an H100, 20.5 predicted from its bytes) is priced at least an element load per output
    element and gathered input; a dense sum of two same-layout tensors gathers nothing."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphopt.cuda_ext.ops.fused_pointwise import fake
    from graphopt.cuda_ext.pointwise import Program

    prof = get_profile("h200")[0]
    gather = prof.efficiency("fused_pointwise", "gather_s")
    assert gather
    with FakeTensorMode():
        q = torch.empty(64, 3137, 3, 8, 8, dtype=torch.bfloat16, device="cuda").permute(2, 0, 3, 1, 4)[0]
        kv = torch.empty(64, 8, 8, 8, dtype=torch.bfloat16, device="cuda")
        ins = [t for i in range(8) for t in (q.select(-1, i).unsqueeze(-1), kv.select(-2, i).unsqueeze(-2))]
        x = torch.empty(64, 8, 3137, 8, dtype=torch.bfloat16, device="cuda")
    p = Program()
    acc = None
    for i in range(8):
        t = p.cast(p.input(2 * i), torch.float32) * p.cast(p.input(2 * i + 1), torch.float32)
        acc = t if acc is None else acc + t
    p.output(acc, torch.bfloat16)
    two = Program()
    two.output(two.input(0) + two.input(1), torch.bfloat16)
    g = fx.Graph()

    def price(program, tensors, profile=prof):
        nodes = []
        for i, t in enumerate(tensors):
            n = g.placeholder(f"t{len(g.nodes)}_{i}")
            n.meta["val"] = t
            nodes.append(n)
        with FakeTensorMode(allow_non_fake_inputs=True):
            val = fake(program.source, tensors)
        return CostModel(profile).price(torch.ops.graphopt.fused_pointwise.default, program.source, nodes, val=val)

    floor = 64 * 8 * 3137 * 8 * 16 * gather
    bare = prof.with_efficiency("fused_pointwise", None)
    assert price(p, ins) >= floor
    assert price(p, ins, bare) < floor / 2  # the bytes-only price
    assert price(two, [x, x]) == price(two, [x, x], bare)
