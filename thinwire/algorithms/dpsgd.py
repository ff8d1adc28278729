"""`dpsgd`: decentralized parallel SGD (Lian et al. [51]; seed 000 §IV-C, catalog §2.2.3 (a)) — BSP on gossip.

Each step every worker takes its local step and averages with its neighbours under the mixing matrix W of the
topology (symmetric, doubly stochastic):
    atc (default, "adapt then combine", Cooperative SGD [221]: X_{k+1} = (X_k - γ G_k) W):
        x_{i,t+1} = Σ_j W_ij (x_{j,t} - γ G_j(x_{j,t}))
    lian (the form of [51], catalog [SUPP]):
        x_{i,t+1} = Σ_j W_ij x_{j,t} - γ G_i(x_{i,t})
On the complete graph (W = 11ᵀ/n) the atc form is exactly synchronous SGD (bsp), momentum included.
Neighbour exchange: isend/irecv of the whole model to/from each neighbour (32 N n_peers bits per step,
seed 000 Table IV Gossip/BSP). `close()` measures the consensus distance and averages the models (see _gossip).
"""
from __future__ import annotations

from ..errors import UserError
from . import register
from ._gossip import Gossip


@register("dpsgd")
class DPSGD(Gossip):
    """D-PSGD: local step, then average with the neighbours under W (ring, torus, exponential, random, complete)."""

    compression = False

    def __init__(self, topology: str = "ring", variant: str = "atc", consensus_every: int = 0,
                 final_average: bool = True, architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        if variant not in ("atc", "lian"):
            raise UserError(f"dpsgd variant must be one of: atc, lian; got {variant!r}")
        self.variant = variant

    def gossip_step(self) -> None:
        peers = self.topology.neighbors(self.rank, self.t)
        x = self.flat_params().clone()
        got = self.exchange(x, peers, peers)
        self.set_flat_params(self.mix(x, got, self.t))

    def step(self):
        if self.variant == "atc":
            self.optimizer_step()
            self.gossip_step()
        else:  # mix the models the gradients were computed on, then apply the own gradient
            self.gossip_step()
            self.optimizer_step()
        self.after_step()


@register("bsp", variant="gossip")
class BSPOnGossip(DPSGD):
    """`bsp` on the gossip architecture is D-PSGD (seed 000 Table II/IV Gossip/BSP, Lian et al. [51]): each worker
    averages its stepped model with its neighbours under the topology's mixing matrix (atc form). The default
    topology is `complete` (W = 11ᵀ/n), on which the update is exactly the all-reduce one;
    `topology=ring|torus|exponential|random` trades that for 2 or more peers per step."""

    name = "bsp"

    def __init__(self, architecture: str | None = None, topology: str = "complete", consensus_every: int = 0):
        if topology not in DPSGD.topologies:
            raise UserError(f"bsp on gossip does not run on topology {topology!r}; "
                            f"valid: {', '.join(DPSGD.topologies)}")
        super().__init__(topology=topology, consensus_every=consensus_every, architecture=architecture)
