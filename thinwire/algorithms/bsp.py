"""`bsp`: bulk-synchronous parallel SGD (seed 000 §III-A, eq. 6): every step, the mean gradient of all workers.

On `architecture="gossip"` there is no global mean: BSP on gossip is D-PSGD (seed 000 Table II/IV Gossip/BSP,
Lian et al. [51]), each worker averaging its stepped model with its neighbours under the topology's mixing matrix
(the `dpsgd` algorithm, atc form). The default topology there is `complete` (W = 11ᵀ/n), on which the update is
exactly the all-reduce one; `topology=ring|torus|exponential|random` trades that for 2 or more peers per step.
"""
from __future__ import annotations

from .. import sched
from ..exchange import Exchange
from ..errors import UserError
from . import register
from .base import Algorithm
from .dpsgd import DPSGD
from .ps_sync import bsp_on_ps


@register("bsp")
class BSP(Algorithm):
    """Synchronous SGD: x_{t+1} = x_t - γ (1/n) Σ_i G_i(x_t) (seed 000 eq. 6); gossip: D-PSGD over `topology`."""

    architectures = ("allreduce", "ps", "gossip")

    def __init__(self, architecture: str | None = None, servers: int = 0, schedule: str = "fusion",
                 bucket_mb: float = 25.0, pipeline: bool | None = None, chunk_mb: float = 0.0,
                 credit_mb: float = 0.0, first_bucket_mb: float | None = None, profile_steps: int = 3,
                 downlink_compressor: str = "none", serial: bool | None = None, allreduce: str = "gloo",
                 topology: str | None = None, consensus_every: int = 0):
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
        self.gossip: DPSGD | None = None  # architecture="gossip": the D-PSGD instance that runs the steps
        if self.architecture == "gossip":
            if topology is not None and topology not in DPSGD.topologies:
                raise UserError(f"bsp on gossip does not run on topology {topology!r}; "
                                f"valid: {', '.join(DPSGD.topologies)}")
            self.gossip = DPSGD(topology=topology or "complete", consensus_every=consensus_every)
        elif topology is not None or consensus_every:
            name = "topology" if topology is not None else "consensus_every"
            raise UserError(f"bsp's {name} is for architecture=gossip (--architecture gossip); "
                            f"architecture {self.architecture!r} has no topology")

    @property
    def checks_finite(self) -> bool:
        """On all-reduce the scheduler checks each bucket (Exchange._check_finite) before sending it."""
        return self.architecture == "allreduce"

    def setup(self):
        if self.architecture == "ps":  # the PS path lives in ps_sync (role, serve, step, close, metrics)
            return bsp_on_ps(self, self.servers, self.downlink_compressor)
        if self.gossip is not None:
            return self._bsp_on_gossip()
        self.exchange = Exchange(self.transport, self.trainer.compressor, self.trainer.memory)
        self.scheduler.attach(self.model, self.params, self.exchange, self.tracer, self.transport,
                              optimizer=self.optimizer)

    def _bsp_on_gossip(self) -> None:
        """D-PSGD runs the steps (whole models to the neighbours, full precision): its methods replace the
        all-reduce ones on this instance."""
        comp, mem = self.trainer.compressor, self.trainer.memory
        if getattr(comp, "name", "none") != "none" or getattr(mem, "name", "none") != "none":
            raise UserError("bsp on gossip exchanges whole models in full precision; for compressed gossip use "
                            "--algorithm choco --compressor NAME (valid compressor/memory for bsp on gossip: none)")
        self.gossip.attach(self.trainer)
        for meth in ("step", "close", "metrics", "state_dict", "load_state_dict"):
            setattr(self, meth, getattr(self.gossip, meth))

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
