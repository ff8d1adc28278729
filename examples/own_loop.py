"""Your own training loop with `tw.Trainer`: DTS (delayed, sparsified updates) with top-k 5 % on 2 workers
behind an emulated wide-area link (100 Mbit/s, 50 ms one way). Runs in about 10 s.

    python examples/own_loop.py
"""
import torch
import torch.nn.functional as F

import thinwire as tw
from _digits import accuracy, digits, mlp


def worker(rank, world_size, steps=60):
    x, y = digits()
    mine = torch.arange(rank, len(x), world_size)               # this worker's shard of the data
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = tw.Trainer(model, opt, algorithm="dts", delay=2, period=2, compressor="topk", ratio=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        batch = mine[torch.randint(len(mine), (32,), generator=g)]
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        trainer.step()                          # communication and the update, as DTS dictates
        opt.zero_grad()
        if rank == 0 and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    trainer.close()                             # drain what is in flight; every worker ends with one model
    return accuracy(model, x, y), trainer.metrics()["bytes_sent"]


if __name__ == "__main__":                      # workers are spawned processes: guard the launch
    acc, sent = tw.launch(worker, world_size=2, network="wan")[0]
    print(f"accuracy {acc:.3f}, {sent / 1e6:.2f} MB sent by worker 0")
