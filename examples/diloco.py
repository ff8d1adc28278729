"""DiLoCo across the world: each worker takes 20 local steps, then the workers average their pseudo-gradients
(compressed to 4 bits) and an outer Nesterov step applies them; the loop is yours and calls `optimizer.step()`
itself (`tw.attach`). 2 workers behind 50 Mbit/s and 150 ms one way, about 10 s.

    python examples/diloco.py
"""
import torch
import torch.nn.functional as F

import thinwire as tw
from _digits import accuracy, digits, mlp


def worker(rank, world_size, steps=60):
    x, y = digits()
    mine = torch.arange(rank, len(x), world_size)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)               # DiLoCo's inner optimizer
    g = torch.Generator().manual_seed(rank)
    with tw.attach(model, opt, algorithm="diloco", period=20, compressor="fp4") as run:
        for _ in range(steps):
            batch = mine[torch.randint(len(mine), (32,), generator=g)]
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()                          # an inner step; every 20th also synchronises
            opt.zero_grad()
    m = run.metrics()                           # leaving the block drained and closed it
    return accuracy(model, x, y), m["bytes_sent"], m["emulated_s"]


if __name__ == "__main__":
    acc, sent, emulated = tw.launch(worker, world_size=2, network="world")[0]
    print(f"accuracy {acc:.3f}, {sent / 1e6:.2f} MB sent by worker 0, {emulated:.1f} s on the emulated wire")
