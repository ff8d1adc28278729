"""The DDP hook under DDP's bucketing and beside a momentum optimizer (issue 33; BENCHMARKS.md). Each argument is
MODE:BUCKET_CAP_MB, MODE one of ours (tw.ddp_hook powersgd rank 2), torch (PyTorch's powerSGD_hook, one bucket
only on gloo), ddp (DDP's own all-reduce), onebit (onebit + residual, bare), onebit-opt (the same, optimizer=opt):

    PYTHONPATH=. python tools/ddp_hook_buckets.py ours:0.1 ours:100 torch:100 ddp:0.1 onebit:0.1 onebit-opt:0.1

prints the loss over the training set after 60 steps (2 processes) and the last buckets' layouts."""
import sys

import torch

import thinwire as tw

def worker(rank, world_size, mode, cap, steps=60):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    from thinwire.run import workloads
    torch.set_num_threads(1)
    wl = workloads.get("digits-mlp")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=cap)
    nb = []
    if mode == "ours":
        state, hook = tw.ddp_hook("powersgd", memory="powersgd", rank=2)
        def h(s, bucket) -> torch.futures.Future[torch.Tensor]:
            b = bucket
            nb.append((b.index(), b.buffer().numel(), [tuple(p.shape) for p in b.parameters()]))
            return hook(s, b)
        model.register_comm_hook(state, h)
    elif mode == "torch":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "onebit":
        model.register_comm_hook(*tw.ddp_hook("onebit", memory="residual"))
    elif mode == "onebit-opt":
        model.register_comm_hook(*tw.ddp_hook("onebit", memory="residual", optimizer=opt))
    x, y = wl.shard(rank, world_size)
    loader = workloads.ShardLoader(x, y, wl.batch_size, seed=0, rank=rank)
    for _ in range(steps):
        xb, yb = loader.next()
        opt.zero_grad()
        wl.loss(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        return float(wl.loss(model.module(wl.data[0]), wl.data[1])), sorted(set(map(str, nb[-6:])))

if __name__ == "__main__":
    for mode, cap in [(a.split(":")[0], float(a.split(":")[1])) for a in sys.argv[1:]]:
        print(mode, cap, tw.launch(worker, world_size=2, args=(mode, cap))[0], flush=True)
