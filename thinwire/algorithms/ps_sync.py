"""The algorithms that run on the parameter server (thinwire.comm.ps): the shared base class and `bsp` on the
PS (the class the registry builds for `bsp` with architecture="ps").

On a server rank the algorithm sets `role = "server"` and `serve()` runs the server until the workers are done;
on a worker rank `role = "worker"`, `worker_rank` is its index among the workers, and `step()` pushes the
gradient and loads the parameters it is answered with (the server runs the optimizer).
"""
from __future__ import annotations

from ..comm.ps import PSLayout, PSServer, PSWorker
from ..compress import compressors
from ..errors import UserError
from . import register
from .base import Algorithm

# Table II of seed 000: which architectures each PS-only scheme lacks, and what to use instead
_ALTERNATIVES = {
    "allreduce": "for all-reduce use bsp or localsgd",
    "gossip": "for gossip use dpsgd, adpsgd, sgp or choco",
}


def check_ps_architecture(name: str, architecture: str | None) -> None:
    if architecture not in (None, "ps"):
        alt = _ALTERNATIVES.get(architecture, "valid: ps")
        raise UserError(f"{name} runs on the parameter server only (architecture=ps); {alt}")


class PSAlgorithm(Algorithm):
    """Base of the PS algorithms: builds the layout, and the server or worker end, at setup."""

    architectures = ("ps",)
    mode = "sync"

    def __init__(self, architecture: str | None = None, servers: int = 1, downlink_compressor: str = "none"):
        check_ps_architecture(self.name or type(self).__name__.lower(), architecture)
        super().__init__(architecture)
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise UserError(f"{self.name} needs servers >= 1 parameter-server ranks (--servers K), got {servers}")
        self.servers = servers
        self.downlink = compressors.get(downlink_compressor)  # raises naming the valid compressors
        self.role = "worker"
        self.server = self.worker = None

    def server_options(self) -> dict:
        """Keyword arguments of PSServer for this algorithm's rule (mode, staleness, backups, lr_scale)."""
        return {"mode": self.mode}

    def setup(self) -> None:
        flat = self.flat_params()
        self.layout = PSLayout(flat.numel(), self.world_size, self.servers)
        if self.layout.is_server(self.rank):
            self.role = "server"
            self.server = PSServer(self.transport, self.layout, flat, self.optimizer,
                                   compressor=self.trainer.compressor, downlink=self.downlink,
                                   **self.server_options())
        else:
            self.worker_rank = self.rank
            self.worker = PSWorker(self.transport, self.layout, flat, compressor=self.trainer.compressor,
                                   memory=self.trainer.memory, downlink=self.downlink)

    def serve(self, checkpoint=None) -> None:
        """Run the server; `checkpoint=(every, total, save)` joins the workers' checkpoints (PSServer.serve)."""
        if self.server is None:
            raise RuntimeError(f"rank {self.rank} is a worker, not a server")
        self.server.serve(checkpoint=checkpoint)

    def step(self) -> None:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} is a parameter server: call serve(), not step()")
        self.scheduler.flush()
        self.set_flat_params(self.worker.push_pull(self.flat_grad()))
        self.scheduler.end_step()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.done()
            self.set_flat_params(self.worker.params)  # the model answered to the last push
        super().close()

    def metrics(self) -> dict:
        part = self.server if self.server is not None else self.worker
        return {"architecture": "ps", "servers": self.servers, **(part.metrics() if part else {})}

    def state_dict(self) -> dict:
        """A consistent cut of this rank's end of the PS. A worker first waits for the answers to its pushes
        in flight (a checkpoint is a quiescent point: every worker checkpoints at the same step, so the server
        answers them all); a server is called at that cut (PSServer.serve). The downlink compressor's own
        state travels with either end; the uplink compressor and the worker's memory are the trainer's."""
        down = self.downlink.state_dict()
        if self.server is not None:
            return {"server": self.server.state_dict(), "downlink": down}
        if self.worker is None:
            return {}
        self.worker.drain()
        return {"worker": self.worker.state_dict(), "downlink": down}

    def load_state_dict(self, state: dict) -> None:
        if "downlink" in state:
            self.downlink.load_state_dict(state["downlink"])
        if self.server is not None:
            self.server.load_state_dict(state["server"])
        elif self.worker is not None:
            self.worker.load_state_dict(state["worker"])


def checkpointable_on_ps(algorithm: str) -> bool:
    """Whether `algorithm`'s parameter-server runs can be checkpointed: the ones built on PSAlgorithm."""
    from . import registry
    return isinstance(registry.constructor(algorithm, {"architecture": "ps"}), type) and issubclass(
        registry.constructor(algorithm, {"architecture": "ps"}), PSAlgorithm)


@register("bsp", variant="ps")
class PSBSP(PSAlgorithm):
    """`bsp` on the PS: the barrier is released when all workers' gradients are in (catalog §2.1.1); the
    server applies the mean (seed 000 eq. 6) and answers everyone with the new model."""

    name = "bsp"
