"""Why does precision="auto" keep BERT-base in fp32 on the GPU? Prints the pass record."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt.examples import zoo  # noqa: E402

name, b = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else ("bert-base", 64)
m, i = zoo.get(name, batch=b, device="cuda")
opt = graphopt.optimize(m, i, precision="auto", passes=["eliminate_dead_code", "fold_constants", "assign_precision"],
                        cuda_graphs=False)
p = opt.report.pass_result("assign_precision")
print(name, p.status, "|", p.notes, "|", [(r.candidate, r.reason[:160]) for r in p.rejected][:6])
print({k: v for k, v in p.details.items() if k not in ("kept_fp32", "flops_share", "bytes_share")})
