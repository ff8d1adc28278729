"""This worker's progress, for the launcher's watchdog (`thinwire.launcher`): the launcher that starts a worker
installs two arrays in memory it shares with the worker (`install`), and `report(step)` stores the step and the
time into this rank's slots — two stores, no system call (the monotonic clock is read through the vDSO), no
lock. Outside a launcher worker (under torchrun, in a plain process) nothing is installed and `report` returns at
once. `Trainer.step` reports every step, so any loop that drives a thinwire algorithm is watched; the launcher
re-exports `report` as `thinwire.report_progress` for loops that drive none. `moving()` refreshes the time
without a step while an emulated link is still delivering this rank's transfer (`Handle`): a sync that occupies a
thin link for minutes is busy, not stuck (a collective stuck in gloo refreshes nothing).
"""
from __future__ import annotations

import time

_slot = None    # inside a launcher worker: (steps, times, rank), the shared arrays the watchdog reads


def install(steps, times, rank: int) -> None:
    """(the launcher, in a worker it started) Report into `steps[rank]` and `times[rank]` from now on."""
    global _slot
    _slot = (steps, times, rank)


def report(step: int | None = None) -> None:
    """Tell the launcher's watchdog that this rank has reached training step `step` (default: one more than its
    last report). Call it once per step, best after the step's local computation and before the step's
    communication waits (as `train_worker` and `Trainer.step` do): then a rank that stopped computing is told
    apart from the ranks waiting for it. A no-op outside a launcher worker."""
    slot = _slot
    if slot is None:
        return
    steps, times, rank = slot
    value = max(steps[rank], 0) + 1 if step is None else int(step)
    times[rank] = time.monotonic()
    steps[rank] = value


def moving() -> None:
    """(while an emulated link delivers a transfer of this rank) Refresh this rank's time, keeping its step: the
    watchdog counts it as activity. A no-op outside a launcher worker and before the first step."""
    slot = _slot
    if slot is not None and slot[0][slot[2]] >= 0:
        slot[1][slot[2]] = time.monotonic()
