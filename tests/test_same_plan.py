"""optimize() made faster must plan the same graph: the optimized graphs of the tiny zoo models,
recorded before the optimize-time work (commit df8cb2a: graphopt.timing only), are reproduced
exactly -- op counts, the graph (every node, its target, arguments and order; node names aside) and
the values of the constants graphopt computed (folded masks, merged weights).

When a pass changes on purpose, regenerate the record and say so in the commit:

    PYTHONPATH=$PWD python tests/test_same_plan.py --regenerate
"""

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo

RECORD = Path(__file__).with_name("same_plan.json")
# (zoo model, optimize kwargs): the GPU plan (fused kernels, bf16 lowering, guarded) and the CPU plan
CONFIGS = [
    ("bert-tiny", {"target": "h200"}),
    ("glm4-tiny", {"target": "h200"}),
    ("vit-tiny", {"target": "h200"}),
    ("bert-tiny", {"target": "cpu"}),
    ("shape-branch", {"target": "h200"}),
]


def _key(name, kw) -> str:
    return name + " " + " ".join(f"{k}={v}" for k, v in sorted(kw.items()))


def plan_record(gm) -> dict:
    ops: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            ops[str(n.target)] = ops.get(str(n.target), 0) + 1
    # every node in order with its target and arguments; nodes named by position and the constants
    # graphopt computed by first use (names come from the model's code, which differ between
    # transformers releases that compute the same graph)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    renamed: dict[str, str] = {}
    lines = []
    for n in gm.graph.nodes:
        target = n.target
        if n.op == "get_attr" and target.startswith("_graphopt_"):
            target = renamed.setdefault(target, f"_graphopt_c{len(renamed)}")
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: f"%{index[x]}")
        lines.append(f"{n.op} {target} {args}")
    code = "\n".join(lines)
    # each computed constant by its shape, dtype, sum and sum of magnitudes (not its bits: folding
    # BatchNorm into a convolution gave last-bit differences between an Intel and an AMD CPU)
    consts = {}
    for name, buf in sorted(gm.named_buffers()):
        if name.startswith("_graphopt_"):
            t = buf.detach().cpu().double()
            consts[renamed.get(name, name)] = [list(t.shape), str(buf.dtype), float(t.sum()), float(t.abs().sum())]
    return {"op_counts": dict(sorted(ops.items())), "nodes": len(gm.graph.nodes),
            "code_sha256": hashlib.sha256(code.encode()).hexdigest(), "constants": dict(sorted(consts.items()))}


def optimized(name, kw):
    torch.manual_seed(0)
    model, inputs = zoo.get(name)
    return graphopt.optimize(model.eval(), inputs, **kw)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[_key(n, k) for n, k in CONFIGS])
def test_optimized_graph_is_the_recorded_one(name, kw):
    want = json.loads(RECORD.read_text())[_key(name, kw)]
    opt = optimized(name, kw)
    got = plan_record(opt.graph_module)
    assert got["op_counts"] == want["op_counts"]
    assert got["nodes"] == want["nodes"]
    assert got["code_sha256"] == want["code_sha256"], "same op counts, different graph (order or arguments)"
    assert got["constants"].keys() == want["constants"].keys(), "different computed constants"
    for name, (shape, dtype, total, magnitude) in want["constants"].items():
        g = got["constants"][name]
        assert g[:2] == [shape, dtype], f"constant {name}: shape or dtype differ"
        assert g[2:] == pytest.approx([total, magnitude], rel=1e-5, abs=1e-6), f"constant {name}'s values differ"
    assert opt.report.accuracy.get("passed") is True
    # the report's predicted cost after optimizing is that of the graph handed back, priced afresh
    fresh = CostModel(get_profile(kw["target"])[0]).graph_cost(opt.graph_module)
    assert opt.report.cost_after == fresh.as_dict()


def test_the_record_tells_graphs_apart():
    """The record is not vacuous: one rewrite fewer is a different record (than the stored one, which
    test_optimized_graph_is_the_recorded_one[bert-tiny target=h200] reproduces)."""
    full = json.loads(RECORD.read_text())[_key("bert-tiny", {"target": "h200"})]
    fewer = plan_record(optimized("bert-tiny", {"target": "h200", "disable": ["fuse_attention"]}).graph_module)
    assert fewer["code_sha256"] != full["code_sha256"] and fewer["op_counts"] != full["op_counts"]


if __name__ == "__main__" and "--regenerate" in sys.argv:
    RECORD.write_text(json.dumps({_key(n, k): plan_record(optimized(n, k).graph_module) for n, k in CONFIGS},
                                 indent=1) + "\n")
    print(f"wrote {RECORD}")
