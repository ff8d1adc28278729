"""`ssp`: stale-synchronous parallel SGD on the parameter server (Ho et al.; seed 000 §III-B, eq. 7 with the
catalog's erratum: the guaranteed-visible sum stops at k = t - s - 1; catalog §2.1.3)."""
from __future__ import annotations

from ..errors import UserError
from . import register
from .ps_sync import PSAlgorithm


@register("ssp")
class SSP(PSAlgorithm):
    """Workers run up to s clocks ahead of the slowest: a worker that pushed clock c continues once every
    worker's updates of clocks <= c - s are in the model it pulls (catalog §2.1.3 [SUPP] read rule). The
    server applies clock c's update, the mean of the n workers' clock-c gradients (seed 000 eq. 6), when the
    last of them arrives, so s = 0 is exactly `bsp` on the PS. The staleness of every applied gradient (model
    versions between the one it was computed on and the one it was applied to, <= s) is recorded."""

    mode = "sync"

    def __init__(self, architecture: str | None = None, staleness: int = 2, servers: int = 1,
                 downlink_compressor: str = "none"):
        super().__init__(architecture, servers, downlink_compressor)
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise UserError(f"ssp staleness bound must be an integer >= 0, got {staleness!r}")
        self.staleness = staleness

    def server_options(self):
        return {"mode": "sync", "staleness": self.staleness}
