"""Train the zoo's toy MLP through graphopt: optimize with training=True, then ordinary SGD steps
on the optimized module's parameters, printing the loss.

    python examples/train_mlp.py
"""

from __future__ import annotations

import torch
from torch import nn

import graphopt
from graphopt.examples import zoo


def main(steps: int = 20, batch: int = 32) -> None:
    model, (x,) = zoo.get("mlp", batch=batch)
    model.train()
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, 10, (batch,), generator=gen)

    opt_model = graphopt.optimize(model, (x,), training=True)
    optimizer = torch.optim.SGD(opt_model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(opt_model(x), y)
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
