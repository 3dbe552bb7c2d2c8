"""Diagnostic: AOT checkpoint backend vs eager gradients on ResNet-50 on the GPU (fp32, small batch),
with cuDNN on and off at run time, and which BatchNorm ops the forward/backward graphs hold.
(It found cudnn_batch_norm traced into the joint graph: wrong BN gradients; the trace now runs
with cuDNN off.)"""
import copy
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torchvision  # noqa: E402

import graphopt  # noqa: E402

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
for bn_cudnn in (True, False):
    torch.backends.cudnn.enabled = bn_cudnn
    m = torchvision.models.resnet50().train().to(dev)
    ref = copy.deepcopy(m)
    x = torch.randn(8, 3, 128, 128, device=dev)
    opt = graphopt.optimize(m, (x,), training=True, memory_budget=0.4, check_accuracy=False,
                            passes=["insert_checkpoints"], cuda_graphs=False, checkpoint_backend="aot")
    g = torch.randn(8, 1000, device=dev)
    out = opt(x)
    out.backward(g)
    o2 = ref(x)
    o2.backward(g)
    print("cudnn", bn_cudnn, "out err", (out - o2).abs().max().item())
    pm = dict(m.named_parameters())
    errs = []
    for n, p in ref.named_parameters():
        q = pm[n].grad
        errs.append((n, None if q is None else ((q - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()))
    errs.sort(key=lambda t: -1e9 if t[1] is None else -t[1])
    print(" worst", errs[:6])
    ops = Counter()
    from passes import _aot_recompute as ar
    for mod in opt.graph_module.modules():
        if isinstance(mod, ar.AotRecompute):
            for info in mod.partitions.values():
                for gname in ("fw_graph", "bw_graph"):
                    for n in info[gname].graph.nodes:
                        if n.op == "call_function" and "norm" in str(n.target):
                            ops[(gname, str(n.target))] += 1
    print(" bn ops", dict(ops))
