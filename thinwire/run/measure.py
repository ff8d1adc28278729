"""A workload's training step timed on this machine, and the advice predicted from it, recorded.

`measure_step` runs a few steps of one worker in this process, with no communication (what `thinwire compare`'s
no-communication reference `local` runs): a batch from the workload's loader, forward, the loss, backward, the
optimizer's step, `zero_grad`, and the loss read back to the host (on a GPU, the wait for the step's work); the
first `warmup` steps are left out and the median of the rest is the step time. Otherwise each worker is taken for
a machine like this one, with all its threads, and nothing distributed starts. With `workers` > 1 sharing this
machine's CPU (`local`), one worker's step is timed here with the threads each of them gets
(`threads_per_worker`), and then every worker's together, on the launcher's worker processes as `thinwire
compare` starts them, each timing the same steps from a common start: the median over all of them is the step the
planner is given. How much slower that is than one worker alone depends on the model, not only on the cores they
ask for: on this 2-core machine, 4 workers took 1.66× the lone step of `examples/hf_gpt2.py` and 2.5× that of
`stdlib-lm` (a fixed `workers × threads / cores` put the GPT-2 at 2×: 28 % over the race's own step).

`thinwire advise --workload W --out DIR` writes `DIR/advice.json` (`write_advice`, read back by `read_advice`;
`ADVICE_VERSION` 1):

    {"version": 1,
     "workload": spec, "workload_name": ..., "network": the --network as given,
     "measured": {"step_s": median step time (s), "compute_s": what the planner was given (s) = step_s × share,
                  "times_s": [every timed step alone], "warmup": steps left out, "steps": steps timed,
                  "batch_size", "params", "device", "threads", "local", "workers",
                  "share": compute_s / step_s, "together_s": [each worker's median, timed together] (local),
                  "cpus", "torch"},
     "scenario": {"params", "compute_s", "network": the link's numbers, "workers", "servers", "collective"},
     "ranking": [{"config", "algorithm", "collective", "iteration_s", "scalability", "bytes_per_step",
                  ["bytes_per_sync"], "note"}, ...] (best first: `thinwire.plan.advise.Advice.row`),
     "diloco": the DiLoCo family's recommendation (`thinwire.plan.advise.recommend_diloco`)}

A later `thinwire compare --out DIR` on the same workload, network and workers can put each cell's predicted
`iteration_s` (its `config` / `algorithm` row) beside its measured median step time.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from ..errors import UserError
from ..files import atomic_write
from ..launcher.pool import launch
from ..launcher.worker import threads_per_worker
from . import workloads

ADVICE = "advice.json"
ADVICE_VERSION = 1


def measure_step(spec: str, device: str = "cpu", batch_size: int | None = None, steps: int = 10, warmup: int = 3,
                 workers: int = 1, local: bool = False) -> dict:
    """The median time of one training step of workload `spec` (a name or yours, canonical: what every process
    resolves alike) here, alone and, `local`, with its `workers` sharing this machine (see the module's doc); the
    global random state and the thread count are left as they were."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device on this machine")
    wl = workloads.get(spec)
    cpus = os.cpu_count() or 1
    together = local and device == "cpu" and workers > 1
    threads = threads_per_worker(workers) if together else torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times, params = _timed(wl, device, batch_size, warmup + steps)
    finally:
        torch.set_num_threads(before)
    step = statistics.median(times[warmup:])
    medians = None
    if together:        # every worker at once, as `thinwire compare` runs them (the launcher sets their threads)
        medians = [statistics.median(t[warmup:])
                   for t in launch(_timed_together, workers, args=(spec, batch_size, warmup + steps))]
    compute = statistics.median(medians) if medians else step
    return {"name": wl.name, "step_s": step, "compute_s": compute, "times_s": times[warmup:], "warmup": warmup,
            "steps": steps, "batch_size": batch_size or wl.batch_size, "params": params, "device": device,
            "threads": threads, "local": local, "workers": workers, "share": compute / step,
            **({"together_s": medians} if medians else {}), "cpus": cpus, "torch": torch.__version__}


def _timed(wl, device: str, batch_size: int | None, n: int, start=None) -> tuple[list[float], int]:
    """The wall time of each of `n` steps of one worker (after `start()`, where given), and the model's size."""
    times = []
    with torch.random.fork_rng(devices=[]):
        model = wl.model(0).to(device)
        opt = wl.make_optimizer(model)
        loader = wl.loader(0, 1, batch_size, seed=0, device=device)
        if start is not None:
            start()
        for _ in range(n):
            t0 = time.perf_counter()
            x, y = loader.next()
            loss = wl.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            loss.item()     # the host waits for the step's work, as the training loop's clock does
            times.append(time.perf_counter() - t0)
    return times, sum(p.numel() for p in model.parameters())


def _timed_together(rank: int, world: int, spec: str, batch_size: int | None, n: int) -> list[float]:
    """In a launched worker: `n` steps timed from the moment every worker has built its model."""
    return _timed(workloads.get(spec), "cpu", batch_size, n, start=torch.distributed.barrier)[0]


def write_advice(out: str, advice: dict) -> str:
    """`advice` (the module doc's format) as `out/advice.json`, written atomically; returns the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, ADVICE)
    atomic_write(path, json.dumps({"version": ADVICE_VERSION, **advice}, indent=2) + "\n")
    return path


def read_advice(out: str) -> dict | None:
    """The advice recorded in `out` (None where there is none, or of another version)."""
    path = os.path.join(out, ADVICE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        advice = json.load(f)
    return advice if advice.get("version") == ADVICE_VERSION else None
