"""Train the zoo's toy MLP through graphopt: optimize with training=True, then ordinary SGD steps
on the optimized module's parameters, printing the loss.

    python examples/train_mlp.py                     # fp32
    python examples/train_mlp.py --precision fp16    # fp16 compute, fp32 master weights, loss scaling

With ``precision="fp16"`` (or "bf16"/"auto") graphopt casts in the graph, so the gradients reach
the model's fp32 parameters. fp16's narrow exponent range can flush small gradients to zero, so
fp16 training scales the loss (``torch.amp.GradScaler``: scale the loss, unscale the gradients,
skip a step whose gradients overflowed); graphopt's report says so when it plans fp16 training.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import graphopt
from graphopt.examples import zoo


def main(steps: int = 20, batch: int = 32, precision: str = "fp32") -> list[float]:
    model, (x,) = zoo.get("mlp", batch=batch)
    model.train()
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, 10, (batch,), generator=gen)

    opt_model = graphopt.optimize(model, (x,), training=True, precision=precision)
    optimizer = torch.optim.SGD(opt_model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    # loss scaling for fp16 (a no-op scaler otherwise); the parameters stay fp32
    scaler = torch.amp.GradScaler(x.device.type, enabled=precision == "fp16")

    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(opt_model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # unscales the gradients first; skips the step if any is inf/nan
        scaler.update()
        losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}" + (f"  scale {scaler.get_scale():g}" if scaler.is_enabled() else ""))
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "auto"))
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    main(steps=a.steps, precision=a.precision)
