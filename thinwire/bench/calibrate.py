"""`thinwire advise --calibrate`: measure this machine's loopback α and β and the compressors' cost, store them."""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..compress import compressors
from ..files import atomic_write
from ..launcher import launch
from ..run.workloads import cache_dir


def _path() -> str:
    return os.path.join(cache_dir(), "calibration.json")


def median_s(fn, repeats: int, before=None, clock=time.perf_counter) -> float:
    """The median time on `clock` of `repeats` calls of `fn`, each after an untimed `before()` if given."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _allreduce_times(rank, world_size, sizes, repeats):
    out = {}
    for n in sizes:
        t = torch.zeros(max(1, n // 4))
        dist.all_reduce(t)
        out[n] = median_s(lambda: dist.all_reduce(t), repeats, before=dist.barrier)
    return out


def _compressor_x_memcpy(numel: int = 1 << 20, repeats: int = 5) -> dict:
    x = torch.randn(numel)
    memcpy = median_s(lambda: x.clone(), repeats)
    out = {}
    for name in compressors.names():
        try:
            comp = compressors.get(name)
            if comp.aggregation == "custom":
                continue
            out[name] = median_s(lambda: comp.decompress(comp.compress(x, key="cal", step=0)), repeats) / memcpy
        except Exception:  # noqa: BLE001 - a compressor that needs parameters is left to the default table
            continue
    return out


def calibrate(workers: int = 2) -> dict:
    """Fit the ring all-reduce cost 2(n-1)α + 2(n-1)/n Nβ to loopback all-reduces of 4 B and 16 MB."""
    small, large = 4, 16 << 20
    times = launch(_allreduce_times, workers, args=([small, large], 10))[0]
    n = workers
    alpha = times[small] / (2 * (n - 1))
    beta = max(1e-12, (times[large] - times[small]) / (2 * (n - 1) / n * large))
    cal = {"workers": n, "alpha_s": alpha, "beta_s_per_byte": beta, "x_memcpy": _compressor_x_memcpy(),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = _path()
    atomic_write(path, json.dumps(cal, indent=2))
    cal["path"] = path
    return cal


def load_calibration() -> dict | None:
    try:
        with open(_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
