"""Seconds from creating a pool of N local workers to its first answer, with workers forked from the fork server
(thinwire's launchers) against workers spawned afresh (each importing torch), alternating in one process.

    python tools/launch_startup.py [N [REPEATS]]      # default: 4 workers, 4 repeats (BENCHMARKS.md)

The first fork-server pool also starts the server, which imports torch and the launchers once.
"""
import multiprocessing as mp
import statistics
import sys
import time

from thinwire.launcher import pool as pool_module, worker
from thinwire.launcher.pool import Pool


def hello(rank, world_size):
    return rank


def first_answer(n: int) -> float:
    t0 = time.perf_counter()
    with Pool(n) as pool:
        assert pool.run(hello) == list(range(n))
        return time.perf_counter() - t0


def main(n: int = 4, repeats: int = 4) -> None:
    times = {"forkserver": [], "spawn": []}
    contexts = {"forkserver": worker.ctx, "spawn": mp.get_context("spawn")}
    for _ in range(repeats):
        for name, context in contexts.items():
            worker.ctx = pool_module.ctx = context
            times[name].append(first_answer(n))
    for name, t in times.items():
        print(f"{name:10s} " + " ".join(f"{x:.2f}" for x in t) + " s")
    warm = statistics.median(times["forkserver"][1:] or times["forkserver"])
    print(f"spawn / forkserver (median, the server started): {statistics.median(times['spawn']) / warm:.0f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
