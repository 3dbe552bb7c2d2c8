# Answered: How many distinct Triton kernels does a model's optimized graph compile at its first call on an H100/H200, kernel by kernel, counted without a GPU (results/diag_compile_count_<date>.md)?
"""The distinct Triton compiles an optimized graph asks for, counted on the CPU.

    python benchmarks/diag/diag_compile_count.py CONFIG:BATCH[,CONFIG:BATCH...] --out DIR [--label NAME]

Each config (a perf-sweep name) is built with random weights in bf16 and optimized on the CPU,
planned for the H200 (the accuracy guard off: only the plan matters here). Its graphopt ops that
dispatch to Triton are then launched the way precompile warms them (graphopt.runtime.precompile:
fake tensors, nothing launched), on CUDA fakes, with Triton's driver answering as an sm_90 device
and its compile step (``JITFunction._do_compile``) recording the kernel and its specialization
key instead of compiling. Distinct (kernel, key) pairs are the compiles a cold first call makes.
The measured guard, which may undo a pass on the device, does not run here.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _timing import table_lines, write_rows  # noqa: E402


@contextlib.contextmanager
def sm90_recording(seen: list):
    """Triton and torch.cuda answering as an H100 (tests/helpers.stand_in_sm90); each compile appended to
    ``seen`` as (kernel, key), not run."""
    from _pytest.monkeypatch import MonkeyPatch
    from triton.runtime.jit import JITFunction

    from tests.helpers import stand_in_sm90

    def record(self, key, *args, **kwargs):
        seen.append((self.fn.__qualname__, f"{self.cache_key} {key}"))
        return None

    mp = MonkeyPatch()
    try:
        stand_in_sm90(mp)
        mp.setattr(JITFunction, "_do_compile", record)
        yield
    finally:
        mp.undo()


def count(name: str, batch: int) -> dict:
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensorMode

    import graphopt
    from graphopt.runtime import precompile as pc
    from graphopt.tools import perf_sweep

    model, inputs = perf_sweep.build(name, batch)
    model = model.to(torch.bfloat16).eval()
    inputs = tuple(x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    om = graphopt.optimize(model, inputs, target="h200", check_accuracy=False)
    gm = next(getattr(om, a) for a in ("gm", "graph_module", "module") if hasattr(getattr(om, a, None), "graph"))
    todo, left = pc.plan(gm, pc.triton_ops(), device_type="cpu")
    seen, failed = [], Counter()
    mode = FakeTensorMode()

    def fake_cuda(v):
        extent = v.storage_offset() + sum((s - 1) * st for s, st in zip(v.shape, v.stride())) + 1 if v.numel() else 1
        with mode:
            base = torch.empty(max(extent, 1), dtype=v.dtype, device="cuda")
            return base.as_strided(tuple(v.shape), tuple(v.stride()), v.storage_offset())

    with sm90_recording(seen), pc.warm_launches():
        for node, impl, args, kwargs in todo:
            fargs, fkwargs = pytree.tree_map_only(torch.Tensor, fake_cuda, (args, kwargs))
            try:
                with mode:
                    impl(*fargs, **fkwargs)
            except Exception as e:  # noqa: BLE001 (counted: its kernel compiles at its first call instead)
                failed[type(e).__name__] += 1
    kinds = Counter(q for q, _ in dict.fromkeys(seen))
    return {"config": f"{name}:{batch}", "nodes": len(todo), "compiles": len(dict.fromkeys(seen)),
            "by_kernel": ", ".join(f"{k} {v}" for k, v in kinds.most_common()),
            "not_run": ", ".join(f"{k} {v}" for k, v in failed.items()) or "none"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    import triton

    rows = []
    for c in a.configs.split(","):
        name, batch = c.rsplit(":", 1)
        rows.append(count(name, int(batch)))
        print(rows[-1], flush=True)
    cols = [("config", lambda r: r["config"], False), ("Triton launches (signatures)", lambda r: str(r["nodes"]), True),
            ("distinct compiles", lambda r: str(r["compiles"]), True), ("by kernel", lambda r: r["by_kernel"], False),
            ("launches that raised", lambda r: r["not_run"], False)]
    head = (f"CPU, torch {torch.__version__}, triton {triton.__version__}, planned for the H200 in bf16, counted for sm_90"
            + (f"; code: {a.label}" if a.label else "") + ".")
    write_rows(Path(a.out), "diag_compile_count" + (f"_{a.label}" if a.label else ""), rows,
               table_lines("# Distinct Triton compiles at a cold first call", head, cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
