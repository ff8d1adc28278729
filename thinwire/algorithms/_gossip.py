"""What the gossip family shares: a topology, neighbour exchange over isend/irecv, the consensus distance.

Consensus distance (seed 000 §II-B, §VIII): mean_i ‖x_i - x̄‖², the spread of the workers' models around their
average. Measuring it costs communication (one all-reduce of the model and one of a scalar), which goes through
the Transport and is counted like any other traffic. It is measured in `close()` (before the final average)
and, with `consensus_every=K`, every K steps as well (those steps are slower and carry the extra bytes).

`close()` leaves every worker with the average model x̄ (`final_average=true`, the default): the model the
gossip convergence guarantees are stated for (D-PSGD [51], CHOCO [164]: the averaged iterate). With
`final_average=false` the workers keep their own models.
"""
from __future__ import annotations

import torch

from ..comm.collectives import wait_all
from ..comm.topology import NAMES, Topology
from ..errors import UserError
from .base import Algorithm

TAG = 7200


class Gossip(Algorithm):
    architectures = ("gossip",)
    topologies: tuple[str, ...] = NAMES

    def __init__(self, topology: str = "ring", consensus_every: int = 0, final_average: bool = True,
                 architecture: str | None = None):
        super().__init__(architecture)
        if topology not in self.topologies:
            raise UserError(f"algorithm {self.name!r} does not run on topology {topology!r}; "
                            f"valid: {', '.join(self.topologies)}")
        if not isinstance(consensus_every, int) or consensus_every < 0:
            raise UserError(f"consensus_every must be an integer >= 0 (0: only at close), got {consensus_every!r}")
        self.topology_name = topology
        self.consensus_every = consensus_every
        self.final_average = bool(final_average)
        self.t = 0  # steps taken
        self.consensus: list[tuple[int, float]] = []

    def setup(self):
        from ..comm.context import default_seed
        self.topology = Topology(self.topology_name, self.world_size, seed=default_seed())
        self.gossip_setup()

    def gossip_setup(self) -> None:
        """Per-algorithm state (called once the trainer is wired)."""

    # -- neighbour exchange ----------------------------------------------------------------------------------
    def start_exchange(self, send: torch.Tensor, dsts: list[int], srcs: list[int]) -> tuple[list, dict]:
        """isend `send` to every rank of `dsts`, irecv a tensor like it from every rank of `srcs`."""
        handles = [self.transport.isend(send, d, tag=TAG) for d in dsts]
        bufs = {}
        for s in srcs:
            bufs[s] = torch.empty_like(send)
            handles.append(self.transport.irecv(bufs[s], s, tag=TAG))
        return handles, bufs

    def exchange(self, send: torch.Tensor, dsts: list[int], srcs: list[int]) -> dict[int, torch.Tensor]:
        handles, bufs = self.start_exchange(send, dsts, srcs)
        wait_all(handles)
        return bufs

    def mix(self, x: torch.Tensor, got: dict[int, torch.Tensor], step: int) -> torch.Tensor:
        """Σ_j W_ij x_j over this rank and its neighbours, in rank order (deterministic)."""
        W = self.topology.matrix(step)
        i = self.rank
        out = torch.zeros_like(x)
        for j in sorted([i, *got]):
            out.add_(x if j == i else got[j], alpha=float(W[i, j]))
        return out

    # -- consensus --------------------------------------------------------------------------------------------
    def average_model(self) -> torch.Tensor:
        """x̄ over workers (one all-reduce of the model, counted)."""
        mean = self.flat_params().clone()
        return self.transport.all_reduce(mean, op="mean")

    def measure_consensus(self, set_average: bool = False) -> float:
        """mean_i ‖x_i - x̄‖², recorded at the current step; optionally sets this model to x̄."""
        x = self.flat_params()
        mean = self.average_model()
        d = (x - mean).double().pow(2).sum().reshape(1)
        d = float(self.transport.all_reduce(d, op="mean"))
        self.consensus.append((self.t, d))
        if set_average:
            self.set_flat_params(mean)
        return d

    def after_step(self) -> None:
        self.scheduler.end_step()
        self.t += 1
        if self.consensus_every and self.t % self.consensus_every == 0:
            self.measure_consensus()

    def drain(self) -> None:
        """Finish in-flight gossip (asynchronous methods)."""

    def close(self):
        self.drain()
        self.measure_consensus(set_average=self.final_average)
        super().close()

    def state_dict(self):
        return {"t": self.t, "consensus": list(self.consensus)}

    def load_state_dict(self, state):
        self.t, self.consensus = state["t"], list(state["consensus"])

    def metrics(self):
        out = {**super().metrics(), "topology": self.topology_name, "spectral_gap": self.topology.spectral_gap()}
        if self.consensus:
            out["consensus_distance"] = self.consensus[-1][1]
            out["consensus_history"] = [list(c) for c in self.consensus]
        return out
