"""`bsp`: bulk-synchronous parallel SGD (seed 000 §III-A, eq. 6): every step, the mean gradient of all workers."""
from __future__ import annotations

from .. import sched
from ..exchange import Exchange
from ..errors import UserError
from . import register
from .base import Algorithm
from .ps_sync import bsp_on_ps


@register("bsp")
class BSP(Algorithm):
    """Synchronous SGD: x_{t+1} = x_t - γ (1/n) Σ_i G_i(x_t) (seed 000 eq. 6), through any compressor."""

    architectures = ("allreduce", "ps")

    def __init__(self, architecture: str | None = None, servers: int = 0, schedule: str = "fusion",
                 bucket_mb: float = 25.0, pipeline: bool | None = None, chunk_mb: float = 0.0,
                 credit_mb: float = 0.0, first_bucket_mb: float | None = None, profile_steps: int = 3,
                 downlink_compressor: str = "none", serial: bool | None = None, allreduce: str = "gloo"):
        super().__init__(architecture)
        self.allreduce = allreduce  # all-reduce algorithm (thinwire.comm.collectives), applied by attach()
        # when each gradient enters the exchange (thinwire.sched): none | wfbp | fusion | mgwfbp | priority
        self.scheduler = sched.make(schedule, bucket_mb=bucket_mb, pipeline=pipeline, chunk_mb=chunk_mb,
                                    credit_mb=credit_mb, first_bucket_mb=first_bucket_mb,
                                    profile_steps=profile_steps, serial=serial)
        self.servers = servers  # parameter-server ranks (architecture="ps" only)
        self.downlink_compressor = downlink_compressor  # the PS's server-to-worker compressor
        if servers and self.architecture != "ps":
            raise UserError(f"bsp with servers={servers} needs architecture=ps (--architecture ps); "
                            f"architecture {self.architecture!r} uses no server ranks")

    @property
    def checks_finite(self) -> bool:
        """On all-reduce the scheduler checks each bucket (Exchange._check_finite) before sending it."""
        return self.architecture == "allreduce"

    def setup(self):
        if self.architecture == "ps":  # the PS path lives in ps_sync (role, serve, step, close, metrics)
            return bsp_on_ps(self, self.servers, self.downlink_compressor)
        self.exchange = Exchange(self.transport, self.trainer.compressor, self.trainer.memory)
        self.scheduler.attach(self.model, self.params, self.exchange, self.tracer, self.transport,
                              optimizer=self.optimizer)

    def step(self):
        if self.scheduler.defers_update:   # priority: the next forward applies the update, layer by layer
            self.scheduler.finish_step()
            return
        self.scheduler.wait_all()           # buckets were exchanged during backward; averaged grads in place
        self.optimizer_step()

    def close(self):
        self.scheduler.close()

    def metrics(self):
        return {"schedule": self.scheduler.describe()}

    def state_dict(self):
        if self.scheduler.defers_update:
            self.scheduler.flush()
        return {"exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.exchange.load_state_dict(state["exchange"])
