"""MG-WFBP, merged-gradient wait-free backprop (Shi, Chu, Li 2019, "MG-WFBP: Efficient Data
Communication for Distributed Synchronous SGD Algorithms", arXiv 1811.11141): merge buckets so that a collective's
start-up latency is not paid per layer on high-latency links, but only where the merge does not delay the pipeline.

`Profiled` measures, during the first `profile_steps` steps, when each gradient becomes ready in backward (the
layer-wise BP times t_b), and the link's all-reduce cost T_ar(bytes) = a + b·bytes: the ring's α-β on an emulated
link (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A Comprehensive Survey",
arXiv 2003.06307, Table III), else a few timed all-reduces (1 MiB and 4 bytes, 3 times each: counted like any
traffic). Rank 0's measurements are broadcast so every rank plans the same buckets (`merge_plan`, `MGWFBP.plan`).
"""
from __future__ import annotations

import statistics
import time
from itertools import islice
from typing import Callable

import torch

from ..errors import UserError
from ..net import ring_allreduce
from .wfbp import Scheduler

_now = time.perf_counter


def merge_plan(ready: list[float], sizes: list[float], cost: Callable[[float], float], startup: float
               ) -> list[int]:
    """MG-WFBP merge rule (Shi et al. 2019, as the authors' implementation runs it), gradients in BP order.

    ready[i]: when gradient i is ready (τ_b + t_b); sizes[i]: its bytes; cost(bytes): T_ar; startup: α of one
    collective. Walking l = L..2, layer l-1 merges into l's communication when it is ready before l's
    communication would finish (e_b^(l-1) < τ_c^(l) + t_c^(l)) and either l's communication could not have
    started before it anyway (τ_c^(l) > e_b^(l-1)) or waiting for it costs less than a start-up (< α).
    τ_c^(l) = max(τ_c^(l+1) + t_c^(l+1), e_b^(l)). Returns the number of gradients in each bucket."""
    if not ready:
        return []
    counts: list[int] = []
    prev_end = float("-inf")             # end of the previous bucket's communication
    size, count = sizes[0], 1
    for i in range(len(ready) - 1):
        tau_c = max(prev_end, ready[i])  # the current bucket (last gradient: i) starts communicating
        t_c = cost(size)
        e = ready[i + 1]
        if e < tau_c + t_c and (tau_c > e or e - tau_c < startup):
            size += sizes[i + 1]
            count += 1
        else:
            counts.append(count)
            prev_end = tau_c + t_c
            size, count = sizes[i + 1], 1
    counts.append(count)
    return counts


class Profiled(Scheduler):
    """A scheduler that measures gradient ready times and the link's all-reduce cost for `profile_steps`."""

    def __init__(self, profile_steps: int = 3, pipeline: bool | None = None, serial: bool | None = None):
        # profiling runs per-layer WFBP (bucket_mb=0): it measures each gradient's own ready time
        super().__init__(bucket_mb=0.0, first_bucket_mb=0.0, pipeline=pipeline, serial=serial)
        if profile_steps < 1:
            raise UserError(f"profile_steps must be >= 1, got {profile_steps}")
        self.profile_steps = profile_steps
        self._profiles: list[list[float]] = []
        self.cost_ab: tuple[float, float] | None = None
        self.ready_times: list[float] | None = None

    def _reset(self) -> None:
        super()._reset()
        self._stamps = [float("nan")] * len(self.params) if self.steps < self.profile_steps else None

    def end_step(self) -> None:
        if self._stamps is not None:    # a profiled step
            self._profiles.append(self._stamps)
        super().end_step()
        if self.steps == self.profile_steps:   # (steps only grow: once)
            self._finish_profile()

    def _finish_profile(self) -> None:
        rel = []
        for row in self._profiles[1:] or self._profiles:   # the first step warms up allocators and caches
            seen = [t for t in row if t == t]
            t0, end = min(seen, default=0.0), max(seen, default=0.0)
            rel.append([(t if t == t else end) - t0 for t in row])   # no gradient: ready at the end
        ready = [statistics.median(column) for column in zip(*rel)]
        a, b = self._measure_cost()
        msg = torch.tensor(ready + [a, b], dtype=torch.float64, device=self.transport.device)
        if self.transport.world_size > 1:
            self.transport.broadcast(msg, src=0)              # every rank plans from rank 0's numbers
        vals = msg.tolist()                                   # host: once per re-plan
        self.ready_times, self.cost_ab = vals[:-2], tuple(vals[-2:])
        self.plan()

    def _measure_cost(self) -> tuple[float, float]:
        """T_ar(x) = a + b x: the ring's α-β when the link is emulated, else timed all-reduces (min of 3)."""
        t = self.transport
        link, n = t.link, t.world_size
        if link.emulated or n == 1:
            a = ring_allreduce(link, n, 0).time
            return a, ring_allreduce(link, n, 1.0).time - a
        big = 1 << 20
        best = {4: float("inf"), big: float("inf")}
        t.all_reduce(torch.zeros(1, device=t.device))     # warm-up
        for nbytes in best:
            x = torch.zeros(nbytes // 4, device=t.device)
            for _ in range(3):
                t0 = _now()
                t.all_reduce(x)
                best[nbytes] = min(best[nbytes], _now() - t0)
        return best[4], max(0.0, (best[big] - best[4]) / (big - 4))

    def cost(self, nbytes: float) -> float:
        a, b = self.cost_ab or (0.0, 0.0)
        return a + b * nbytes

    def plan(self) -> None:
        """Re-plan once profiling is done (subclasses)."""

    def describe(self) -> dict:
        out = super().describe()
        out["alpha_beta"] = self.cost_ab
        return out


class MGWFBP(Profiled):
    name = "mgwfbp"

    def plan(self) -> None:
        order = list(reversed(range(len(self.params))))      # backward order
        ready = [self.ready_times[i] for i in order]
        sizes = [self.params[i].nbytes for i in order]
        members = iter(order)
        self._build([list(islice(members, count)) for count in merge_plan(ready, sizes, self.cost, self.cost(0.0))])
