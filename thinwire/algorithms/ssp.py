"""`ssp`: stale-synchronous parallel SGD on the parameter server (Ho et al.; seed 000 §III-B, eq. 7 with the
catalog's erratum: the guaranteed-visible sum stops at k = t - s - 1; catalog §2.1.3)."""
from __future__ import annotations

from collections import deque

from ..errors import UserError
from . import register
from .ps_sync import PSAlgorithm


@register("ssp")
class SSP(PSAlgorithm):
    """Workers run up to s clocks ahead. The server applies clock c's update, the mean of the n workers'
    clock-c gradients (seed 000 eq. 6), when the last of them arrives, and answers each clock-c push with the
    model that includes it. A worker keeps up to s pushes in flight: after pushing clock c it waits only for
    the answer to clock c - s and computes on the freshest model it has, which holds every update of clocks
    <= c - s (the SSP read rule, catalog §2.1.3 [SUPP]); the round trip of the other s overlaps its compute.
    s = 0 is exactly `bsp` on the PS. The staleness τ <= s of every applied gradient (model versions between
    the one it was computed on and the one it was applied to) is recorded."""

    def __init__(self, architecture: str | None = None, staleness: int = 2, servers: int = 1,
                 downlink_compressor: str = "none"):
        super().__init__(architecture, servers, downlink_compressor)
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise UserError(f"ssp staleness bound must be an integer >= 0, got {staleness!r}")
        self.staleness = staleness
        self._inflight: deque = deque()

    def step(self) -> None:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} is a parameter server: call serve(), not step()")
        self.scheduler.flush()
        self._inflight.append(self.worker.push_pull(self.flat_grad(), async_op=True))
        while len(self._inflight) > self.staleness:           # the answer to clock c - s is required
            self._inflight.popleft().wait()
        while self._inflight and self._inflight[0].is_completed():  # fresher answers already in: take them
            self._inflight.popleft().wait()
        self.set_flat_params(self.worker.params)               # the freshest model answered so far
        self.scheduler.end_step()

    def state_dict(self) -> dict:
        state = super().state_dict()   # a worker drains its pushes in flight: all answered, applied in order
        self._inflight.clear()         # so the run goes on as a resumed one would, from an empty window
        return state

    def close(self) -> None:
        self._inflight.clear()
        super().close()   # PSWorker.done() drains the pushes still in flight
