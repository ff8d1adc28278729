"""When each gradient enters the exchange: the "how to overlap" dimension (Tang, Shi, Chu, Wang, Li 2020,
"Communication-Efficient Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §II-D, §VII).

    # "fusion", or "none" | "wfbp" | "mgwfbp" | "priority"
    sched = thinwire.sched.make("fusion", bucket_mb=25)
    sched.attach(model, params, algorithm, transport)  # the hooks (the Trainer's)
    loss.backward()     # full buckets go to algorithm.on_bucket(bucket)
    sched.flush()       # (algorithm.step) the buckets backward did not
    ...                 # (algorithm.step) wait, update
    sched.end_step()
    sched.close()       # removes the hooks

Schedules:
- `none`     no overlap: one bucket with every gradient, exchanged after backward.
- `wfbp`     wait-free backprop: one exchange per parameter, started by its gradient hook (per-layer FIFO).
- `fusion`   WFBP + tensor fusion: buckets of `bucket_mb` in backward order (DDP/Horovod style; the default).
- `mgwfbp`   WFBP + MG-WFBP merge planning from measured backward times and the link's α, β.
- `priority` P3/ByteScheduler: chunks, input-side first, a credit window, and the update deferred to the next
             forward, layer by layer. It applies the optimizer itself (bsp only): `attach(..., optimizer=opt)`,
             then `finish_step()` instead of the update, and `flush()` before reading the model.
`serial` (one collective in flight at a time, in bucket order) and `pipeline` (compression on the engine's thread
while the previous bucket is on the wire) are options of the engine (`thinwire.comm.engine`) that
`sched.modes(transport, compressor, overlaps_steps)` returns and the algorithm's exchanges are built with.
Gradients are views into the bucket buffers (no copy).
"""
from __future__ import annotations

from ..errors import UserError
from ..registry import NON_NEGATIVE, at_least
from .buckets import Buckets, assign
from .mgwfbp import MGWFBP, merge_plan
from .priority import Priority, priority_order
from .wfbp import Scheduler

SCHEDULES = ("none", "wfbp", "fusion", "mgwfbp", "priority")


def make(schedule: str = "fusion", bucket_mb: float = 25.0, pipeline: bool | None = None,
         chunk_mb: float = 0.0, credit_mb: float = 0.0, profile_steps: int = 3,
         first_bucket_mb: float | None = None, serial: bool | None = None) -> Scheduler:
    """The scheduler named `schedule` (see the module docstring), not yet attached."""
    if schedule == "mgwfbp":
        return MGWFBP(profile_steps=profile_steps, pipeline=pipeline, serial=serial)
    if schedule == "priority":
        return Priority(chunk_mb=chunk_mb, credit_mb=credit_mb, profile_steps=profile_steps)
    if schedule == "none":
        s = Scheduler(overlap=False, pipeline=False)
    elif schedule == "wfbp":
        s = Scheduler(bucket_mb=0.0, first_bucket_mb=0.0, pipeline=pipeline, serial=serial)
    elif schedule == "fusion":
        s = Scheduler(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, pipeline=pipeline, serial=serial)
    else:
        raise UserError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    s.name = schedule
    return s


# ranges of make()'s parameters (sizes in MB, 0: none), checked by the registry's `call` with their types
make.limits = {"bucket_mb": NON_NEGATIVE, "chunk_mb": NON_NEGATIVE, "credit_mb": NON_NEGATIVE,
               "first_bucket_mb": NON_NEGATIVE, "profile_steps": at_least(1)}

__all__ = ["Buckets", "MGWFBP", "Priority", "SCHEDULES", "Scheduler", "assign", "make",
           "merge_plan", "priority_order"]
