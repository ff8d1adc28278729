"""What the gossip family shares: a topology, the neighbour exchange per bucket, mixing, the consensus distance.

Gossip walks bsp's path (wait-free backprop, fusion, MG-WFBP): backward hands each full bucket to `on_bucket`,
where the algorithm takes the bucket's local step if its rule steps before mixing (atc) and starts the bucket's
`NeighborExchange` (`thinwire/exchange/gossip.py`: point to point, through the trainer's compressor where the
algorithm takes one); `step()` waits for the buckets and mixes.

Consensus distance (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A
Comprehensive Survey", arXiv 2003.06307, §II-B, §VIII): mean_i ‖x_i - x̄‖², the spread of the workers' models around
their average, measured (one all-reduce of the model and one of a scalar, counted like any other traffic) in
`close()` before the final average and, with `consensus_every=K`, every K steps.

`close()` leaves every worker with the average model x̄ (`final_average=true`, the default): the model the
gossip convergence guarantees are stated for (D-PSGD: Lian et al. 2017, arXiv 1705.09056; CHOCO-SGD: Koloskova et al.
2019, arXiv 1902.00340: the averaged iterate); with `final_average=false` the workers keep their own models.
"""
from __future__ import annotations

import torch

from ..comm.context import default_seed
from ..comm.topology import NAMES, Topology
from ..errors import UserError
from ..exchange.gossip import NeighborExchange
from ..tensors import copy_flat
from .base import Algorithm
from .cost import CostFamily


class Gossip(Algorithm):
    architectures = ("gossip",)
    topologies: tuple[str, ...] = NAMES
    exchange_class = NeighborExchange
    cost = CostFamily("gossip", {"degree": 2})     # the neighbours it exchanges with per step (a ring's two)

    def __init__(self, topology: str = "ring", consensus_every: int = 0, final_average: bool = True,
                 architecture: str | None = None):
        super().__init__(architecture)
        if topology not in self.topologies:
            raise UserError(f"{self.name} on gossip does not run on topology {topology!r}; "
                            f"valid: {', '.join(self.topologies)}")
        if not isinstance(consensus_every, int) or consensus_every < 0:
            raise UserError(f"consensus_every must be an integer >= 0 (0: only at close), got {consensus_every!r}")
        self.topology_name = topology
        self.consensus_every = consensus_every
        self.final_average = bool(final_average)
        self.t = 0  # steps taken
        self.consensus: list[tuple[int, float]] = []

    def setup(self):
        self.topology = Topology(self.topology_name, self.world_size, seed=default_seed())
        self.exchange = self.make_exchange()
        self.pending: dict[int, object] = {}   # bucket index -> the future of its neighbour exchange

    # -- per bucket --------------------------------------------------------------------------------------------
    def send(self, bucket, tensor: torch.Tensor, dsts: list[int], srcs: list[int]) -> None:
        """Start the bucket's neighbour exchange of `tensor` (which it then owns)."""
        self.pending[bucket.index] = self.exchange.start(tensor, bucket.key, dsts, srcs)

    def received(self, bucket) -> dict[int, torch.Tensor]:
        """{rank: tensor} of the bucket's exchange (this rank's own included), once it arrived."""
        return self.pending.pop(bucket.index).wait()

    def mix(self, got: dict[int, torch.Tensor], step: int) -> torch.Tensor:
        """Σ_j W_ij x_j over this rank and its neighbours, in rank order (deterministic)."""
        W = self.topology.matrix(step)
        i = self.rank
        out = torch.zeros_like(got[i])
        for j in sorted(got):
            out.add_(got[j], alpha=float(W[i, j]))
        return out

    @staticmethod
    def flat_of(bucket) -> torch.Tensor:
        """A copy of the bucket's parameters, flat in its layout."""
        with torch.no_grad():
            return bucket.flat([p.detach() for p in bucket.params])

    # -- consensus --------------------------------------------------------------------------------------------
    def average_model(self) -> torch.Tensor:
        """x̄ over workers (one all-reduce of the model, counted)."""
        return self.transport.all_reduce(self.flat_params().clone(), op="mean")

    def measure_consensus(self, set_average: bool = False) -> float:
        """mean_i ‖x_i - x̄‖², recorded at the current step; optionally sets this model to x̄."""
        x = self.flat_params()
        mean = self.average_model()
        d = (x - mean).double().pow(2).sum().reshape(1)
        d = float(self.transport.all_reduce(d, op="mean"))
        self.consensus.append((self.t, d))
        if set_average:
            copy_flat(self.params, mean)
        return d

    def after_step(self) -> None:
        self.scheduler.end_step()
        self.t += 1
        if self.consensus_every and self.t % self.consensus_every == 0:
            self.measure_consensus()

    def close(self):
        self.measure_consensus(set_average=self.final_average)
        super().close()

    def spectral_gap(self) -> float:
        """The spectral gap of the mixing this algorithm does (the symmetric W here)."""
        return self.topology.spectral_gap()

    def state_dict(self):
        return {"t": self.t, "consensus": list(self.consensus), "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.t, self.consensus = state["t"], list(state["consensus"])
        self.exchange.load_state_dict(state["exchange"])

    def metrics(self):
        out = {**super().metrics(), "topology": self.topology_name, "spectral_gap": self.spectral_gap()}
        if self.consensus:
            out["consensus_distance"] = self.consensus[-1][1]
            out["consensus_history"] = [list(c) for c in self.consensus]
        return out
