# Answered: Where does the selective-checkpoint ResNet-50 step's time go? Its per-op Python dispatch makes the step host-bound, which led to the aot backend (results/archive/checkpoint_2026-11-29_212954_h200.md).
"""Where does the checkpointed step's time go? eager vs the captured graph without checkpoints vs
with them (ResNet-50 bs128 fp32 at 0.4), a kernel-time profile of each, and the numerics of
checkpointing alone (the captured graph with vs without) on a 2-layer GLM in bf16."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import graphopt  # noqa: E402
from profile_model import profiled  # noqa: E402
from checkpoint_bench import Stepper, build_glm, build_resnet50, compare, measure, one_step_grads  # noqa: E402

dev = torch.device("cuda")


def prof(stepper, label):
    ka = profiled(stepper, calls=1, cpu=True).key_averages()
    rows = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))[:8]
    tot = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
    print(f"--- {label}: device time {tot / 1e3:.1f} ms")
    for e in rows:
        t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        print(f"  {t / 1e3:8.2f} ms {e.count:5d}x {e.key[:90]}")


m, inp, dt, _ = build_resnet50(False, dev)
m.train()
params = list(m.parameters())
e = Stepper(m, inp, params)
_, _, ms = measure(e, 2, 8)
print(f"eager {ms:.2f} ms")
prof(e, "eager")
for budget in (None, 0.4, 0.6):
    opt = graphopt.optimize(m, inp, training=True, memory_budget=budget, check_accuracy=False,
                            passes=["insert_checkpoints"] if budget else [], cuda_graphs=False)
    s = Stepper(opt, inp, params)
    s.grads_out = e.grads_out
    act, _, ms = measure(s, 2, 8)
    print(f"graphopt budget {budget}: {ms:.2f} ms, activations {act / 1e9:.2f} GB")
    if budget in (None, 0.4):
        prof(s, f"graphopt {budget}")
    del opt, s
del m, e
torch.cuda.empty_cache()

m, inp, dt, _ = build_glm(False, dev, layers=2, batch=2, seq=1024)
m.train()
params = list(m.parameters())
e = Stepper(m, inp, params)
e()
res = {}
for budget in (None, 0.3):
    opt = graphopt.optimize(m, inp, training=True, memory_budget=budget, check_accuracy=False,
                            passes=["insert_checkpoints"] if budget else [], cuda_graphs=False)
    res[budget] = one_step_grads(opt, inp, params, e.grads_out)
    del opt
eg = one_step_grads(m, inp, params, e.grads_out)
eg2 = one_step_grads(m, inp, params, e.grads_out)
print("glm checkpointed vs captured graph:", compare(*res[0.3], *res[None], 1e-2))
print("glm captured graph vs eager:", compare(*res[None], *eg, 1e-2))
print("glm eager vs eager (run to run):", compare(*eg2, *eg, 1e-2))
