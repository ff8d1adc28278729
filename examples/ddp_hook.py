"""A model already in PyTorch's DistributedDataParallel keeps its loop: a thinwire compressor becomes DDP's
comm hook in one line (here PowerSGD rank 2 with its error feedback). 2 workers, about 5 s.

    python examples/ddp_hook.py
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire as tw
from _digits import accuracy, digits, mlp


def worker(rank, world_size, steps=60):
    x, y = digits()
    mine = torch.arange(rank, len(x), world_size)
    model = DDP(mlp())
    state, hook = tw.ddp_hook("powersgd", memory="powersgd", rank=2)
    model.register_comm_hook(state, hook)                           # the one line
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        batch = mine[torch.randint(len(mine), (32,), generator=g)]
        F.cross_entropy(model(x[batch]), y[batch]).backward()       # buckets are compressed and sent here
        opt.step()
        opt.zero_grad()
    return accuracy(model.module, x, y), state.meter.totals()["bytes_sent"]


if __name__ == "__main__":
    acc, sent = tw.launch(worker, world_size=2)[0]
    print(f"accuracy {acc:.3f}, {sent / 1e6:.2f} MB sent by worker 0")
