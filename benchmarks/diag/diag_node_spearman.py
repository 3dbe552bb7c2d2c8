# Answered: how well the cost model ranks the nodes of sweep models it was not fitted on (Spearman of predicted against measured per-node times on the GPU, issue 26's second target), beside the whole call predicted as a replayed CUDA graph against its replay (results/diag_node_spearman_*.md).
"""Per-node rank correlation on the device, per sweep config: the model prepared as the sweep's
bench prepares it (bf16, CNNs channels_last), optimized (accuracy check and measured guard off, so
the plan is the cost model's alone), then graphopt.tools.measure.accuracy_table over the optimized
graph: every node run 10 times back to back and timed (median of 5), against the model's node time;
Spearman over the costed nodes, over the heavy ones (measured above 3 launch overheads) and over
device time alone (queued timing, the nodes that launch a kernel).

    python benchmarks/diag/diag_node_spearman.py --out /tmp/out --configs timm-dla34:64,vit_b_16:64
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402


def one(cfg: str) -> dict:
    import graphopt
    from graphopt import ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.tools import perf_sweep
    from graphopt.tools.bench import prepare_model
    from graphopt.tools.measure import accuracy_table

    name, batch = cfg.split(":")
    spec = f"graphopt.tools.perf_sweep:{perf_sweep.factory_name(name)}"
    model, args, kwargs, _, _ = prepare_model(spec, int(batch), None, torch.bfloat16, torch.device("cuda"))
    t = time.perf_counter()
    om = graphopt.optimize(model, (args, kwargs) if kwargs else args, check_accuracy=False, measure=False)
    setup = time.perf_counter() - t
    gm = next(m for m in om.modules() if isinstance(m, torch.fx.GraphModule))
    prof = get_profile(torch.device("cuda"))[0]
    tab = accuracy_table(gm, (args, kwargs) if kwargs else args, CostModel(prof), execution="eager")
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = []
    for r in tab.get("nodes", []):  # each node's operand shapes and strides beside its times (for fits)
        n = by_name.get(r["node"])
        ins = [i for i in ir.operand_infos(n)] if n is not None else []
        nodes.append({**{k: r.get(k) for k in ("node", "op", "predicted_device_ms", "measured_device_ms", "predicted_ms",
                                                "measured_ms", "launches")},
                      "shapes": [list(map(int, i.shape)) for i in ins if i is not None and not i.symbolic],
                      "strides": [list(map(int, i.stride)) for i in ins if i is not None and i.stride is not None
                                  and not i.symbolic],
                      "args": [a for a in (n.args if n is not None else ()) if isinstance(a, (int, list, tuple))
                               and not any(hasattr(x, "op") for x in (a if isinstance(a, (list, tuple)) else [a]))]})
    return {"config": cfg, "setup_s": round(setup, 2), "node_rows": nodes,
            **{k: tab.get(k) for k in ("nodes_costed", "nodes_heavy", "nodes_device", "spearman", "spearman_heavy",
                                       "spearman_kernels", "spearman_device", "predicted_ms", "measured_ms")}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--configs", required=True)
    p.add_argument("--budget-s", type=float, default=400)
    a = p.parse_args(argv)
    t0, rows = time.perf_counter(), []
    for cfg in a.configs.split(","):
        if time.perf_counter() - t0 > a.budget_s:
            rows.append({"config": cfg, "error": "not run: the time budget was spent"})
            continue
        try:
            rows.append(one(cfg))
        except Exception as e:  # noqa: BLE001 (a diagnostic: one config's failure is printed, the rest run)
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "node_rows"}), flush=True)
        torch.cuda.empty_cache()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    dev = torch.cuda.get_device_name()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"diag_node_spearman_{stamp}.json").write_text(json.dumps(
        {"device": dev, "torch": torch.__version__, "rows": rows}, indent=1))
    f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"# Spearman over nodes, predicted against measured ({dev}, torch {torch.__version__}, bf16, {stamp} UTC)",
             "", "| config | costed nodes | Spearman (costed) | heavy | kernels | device time | eager call predicted / measured ms | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r.get('nodes_costed', '—')} | {f(r.get('spearman'))} | "
                     f"{f(r.get('spearman_heavy'))} | {f(r.get('spearman_kernels'))} | {f(r.get('spearman_device'))} | "
                     f"{f(r.get('predicted_ms'))} / {f(r.get('measured_ms'))} | {r.get('error', '')} |")
    ok = [r for r in rows if r.get("spearman") is not None]
    lines += ["", f"Spearman (costed nodes) >= 0.9: {sum(r['spearman'] >= 0.9 for r in ok)} of {len(ok)}; "
                  f"device time >= 0.9: {sum((r.get('spearman_device') or 0) >= 0.9 for r in ok)} of {len(ok)}."]
    (Path(a.out) / f"diag_node_spearman_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
