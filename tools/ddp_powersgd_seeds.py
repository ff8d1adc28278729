"""thinwire's PowerSGD DDP hook against PyTorch's `powerSGD_hook`, seed by seed, in a DDP user's loop.

The loop is tests/test_ddp_hook.py's `_user_worker` (2 processes on gloo, DDP, an MLP 64-256-256-10 on the digits
data, SGD lr 0.1 momentum 0.9, 60 steps): `tw.ddp_hook("powersgd", memory="powersgd", rank=2, seed=S)` against
PyTorch's hook at rank 2 from its second iteration (`random_seed=S`). A seed changes only the start Q of the
low-rank iteration (the data and the model's initialization are fixed), so the spread is that of the start.

    python tools/ddp_powersgd_seeds.py [FIRST [COUNT]]      # default: seeds 0..7 (BENCHMARKS.md)
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]


def worker(rank, world, how, seed, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from test_ddp_hook import _user_worker
    final = _user_worker(rank, world, how, seed)[1]
    if rank == 0:
        q.put(final)
    dist.destroy_process_group()


def final_loss(how: str, seed: int, port: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, how, seed, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    value = q.get()
    for p in procs:
        p.join()
    return value


if __name__ == "__main__":
    first = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seeds = range(first, first + count)
    ours = [final_loss("powersgd", s, 29700 + 2 * (s % 1000)) for s in seeds]
    theirs = [final_loss("torch", s, 29701 + 2 * (s % 1000)) for s in seeds]
    print("| seed | thinwire `powersgd` | PyTorch `powerSGD_hook` |\n| ---: | ---: | ---: |")
    for s, a, b in zip(seeds, ours, theirs):
        print(f"| {s} | {a:.4f} | {b:.4f} |")
    print(f"mean: {statistics.fmean(ours):.4f} against {statistics.fmean(theirs):.4f}: "
          f"{statistics.fmean(ours) / statistics.fmean(theirs):.3f}x")
