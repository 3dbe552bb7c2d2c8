# Answered: does a graph's first call after precompile still compile or load Triton kernels? Compile: no (DenseNet-121 bs64: 21 kernels for 53 nodes ahead, none at the call; TNT-S 7 for 8), every node's real inputs as its metadata; load: each kernel's launcher was built at its first launch until precompile built them on the pool, none since (results/diag_precompile_misses_2026-12-06_201805_h100.md, …202151_h100.md).
"""Which Triton kernels does a graph's first call still compile after graphopt.runtime.precompile, and why?

    python benchmarks/diag/diag_precompile_misses.py --configs densenet121:64 --out DIR

For each config (bf16 on the GPU, optimize() without the guard or accuracy check, so the returned module's
lowering is the only precompilation): what precompile did, then the first call with Triton's jit_cache_hook
counting every compile (by kernel name) and its kernel_load_start_hook every kernel loaded (its launcher built
then), and, node by
node, whether each graphopt op's real inputs have the shapes, strides and storage offsets its ``meta["val"]``
promised (a mismatch makes another specialization than the one compiled ahead). Writes
diag_precompile_misses_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.fx as fx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class _Check(fx.Interpreter):
    """Runs the graph; records graphopt op nodes whose real tensor arguments differ from their values' metadata."""

    def __init__(self, gm):
        super().__init__(gm)
        self.mismatch = []

    def run_node(self, n):
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "graphopt":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            real = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
            metas = [a.meta.get("val") for a in n.all_input_nodes]
            flat_meta = [v for v in torch.utils._pytree.tree_leaves(metas) if isinstance(v, torch.Tensor)]
            for r, m in zip(real, flat_meta):
                a = (tuple(r.shape), tuple(r.stride()), r.storage_offset() * r.element_size() % 16, r.dtype)
                b = (tuple(m.shape), tuple(m.stride()), m.storage_offset() * m.element_size() % 16, m.dtype)
                if a != b:
                    self.mismatch.append({"node": n.name, "op": n.target._opname, "real": str(a), "meta": str(b)})
                    break
        return super().run_node(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True)
    p.add_argument("--out", default="/tmp/out")
    a = p.parse_args(argv)
    from triton import knobs

    import graphopt
    from graphopt.tools import perf_sweep
    from _timing import write_rows

    rows = []
    for cfg in a.configs.split(","):
        name, batch = cfg.rsplit(":", 1)
        model, inputs = perf_sweep.build(name, int(batch))
        dev = torch.device("cuda")
        model = model.to(dev, torch.bfloat16).eval()
        inputs = tuple(x.to(dev, torch.bfloat16) if x.is_floating_point() else x.to(dev) for x in inputs)
        opt = graphopt.optimize(model, inputs, measure=False, check_accuracy=False)
        pre = opt._runner.precompiled
        compiled = []

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            compiled.append(getattr(fn, "name", None) or str(fn)[:60])
            return False

        loads = []
        old = knobs.runtime.jit_cache_hook, knobs.runtime.kernel_load_start_hook
        knobs.runtime.jit_cache_hook = hook
        knobs.runtime.kernel_load_start_hook = lambda *args, **kwargs: loads.append(1)
        try:
            with torch.inference_mode():
                check = _Check(opt.graph_module)
                check.run(*inputs)
                torch.cuda.synchronize()
        finally:
            knobs.runtime.jit_cache_hook, knobs.runtime.kernel_load_start_hook = old
        by_op = collections.Counter(m["op"] for m in check.mismatch)
        row = {"config": cfg, "precompiled": {"nodes": pre.nodes, "kernels": pre.kernels, "seconds": pre.seconds,
                                               "left": dict(list(pre.left.items())[:8]), "note": pre.note},
               "first_call_compiles": len(compiled), "first_call_loads": len(loads), "compiled_kernels": collections.Counter(compiled).most_common(8),
               "meta_mismatches": len(check.mismatch), "mismatch_by_op": dict(by_op), "examples": check.mismatch[:6]}
        rows.append(row)
        print(row, flush=True)
    lines = [f"# Triton compiles left to the first call after precompile ({torch.cuda.get_device_name(0)})", "",
             "| config | precompiled nodes | kernels compiled ahead | s | left | first-call compiles | first-call loads "
             "(launcher built) | nodes whose real inputs differ from their metadata |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pc = r["precompiled"]
        lines.append(f"| {r['config']} | {pc['nodes']} | {pc['kernels']} | {pc['seconds']:.2f} | {len(pc['left'])} | "
                     f"{r['first_call_compiles']} | {r['first_call_loads']} | {r['meta_mismatches']} {r['mismatch_by_op']} |")
    for r in rows:
        lines += ["", f"{r['config']}: compiled at the first call {r['compiled_kernels']}; left {r['precompiled']['left']}"]
        lines += [f"- {e['node']} ({e['op']}): real {e['real']}, meta {e['meta']}" for e in r["examples"]]
    write_rows(a.out, "diag_precompile_misses", rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
