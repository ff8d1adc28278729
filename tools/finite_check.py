"""Host time of the Trainer's NaN/Inf check of one step's gradients (`thinwire.trainer.nonfinite_flag`, the
policy `stop`'s, every step of DiLoCo's and local SGD's inner steps) against GradScaler's fused check-and-unscale
at a scale of 1, which it replaced because that one writes the gradients back, measured alternately in one
process, on the CPU, one thread, on the stdlib LM's gradients (66 tensors, 1.07 M elements).

    python tools/finite_check.py [REPEATS]      # default 500 checks per reading, 3 readings each (BENCHMARKS.md)
"""
import statistics
import sys
import time

import torch

from thinwire.run import workloads
from thinwire.trainer import nonfinite_flag


def gradscaler(grads, found):
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones_like(found))


def per_check(fn, grads, found, n: int) -> float:
    for _ in range(20):
        fn(grads, found)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(grads, found)
    return (time.perf_counter() - t0) / n


def main(n: int = 500) -> None:
    torch.set_num_threads(1)
    grads = [torch.randn_like(p) for p in workloads.get("stdlib-lm").model(0).parameters()]
    found = torch.zeros(1)
    times = {"gradscaler": [], "thinwire": []}
    for _ in range(3):
        times["gradscaler"].append(per_check(gradscaler, grads, found, n))
        times["thinwire"].append(per_check(nonfinite_flag, grads, found, n))
    for name, ts in times.items():
        print(f"{name:>10}: " + ", ".join(f"{t * 1e6:.0f}" for t in ts) + " µs per check")
    ratio = statistics.median(times["thinwire"]) / statistics.median(times["gradscaler"])
    print(f"thinwire / gradscaler: {ratio:.2f} (median)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
