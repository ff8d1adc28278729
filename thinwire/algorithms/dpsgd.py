"""`dpsgd`: decentralized parallel SGD (Lian, Zhang, Zhang, Hsieh, Zhang, Liu 2017, "Can Decentralized
Algorithms Outperform Centralized Algorithms?", arXiv 1705.09056, Algorithm 1) — BSP on gossip;
and local SGD on gossip.

Each step every worker takes its local step and averages with its neighbours under the mixing matrix W of the
topology (symmetric, doubly stochastic):
    atc (default, "adapt then combine", Cooperative SGD, Wang & Joshi 2018, arXiv 1808.07576:
    X_{k+1} = (X_k - γ G_k) W):
        x_{i,t+1} = Σ_j W_ij (x_{j,t} - γ G_j(x_{j,t}))
    lian (the form of Lian et al. 2017, Algorithm 1):
        x_{i,t+1} = Σ_j W_ij x_{j,t} - γ G_i(x_{i,t})
On the complete graph (W = 11ᵀ/n) the atc form is exactly synchronous SGD (bsp), momentum included.
Per bucket, during backward, atc takes the bucket's local step (its gradients are final) and sends the stepped
parameters to the neighbours, lian the parameters the gradients were computed on; `step()` mixes every bucket and
(lian) then applies the own gradient. 32 N n_peers bits per step (Tang, Shi, Chu, Wang, Li 2020,
"Communication-Efficient Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, Table IV
Gossip/BSP).

`localsgd` on gossip (Tang et al. Table II, Gossip/Local SGD): H local steps, then one gossip averaging step (the
atc mixing above) over the topology; with H = 1 it is D-PSGD, on the complete graph local SGD on all-reduce.
"""
from __future__ import annotations

from ..errors import UserError
from ..tensors import copy_flat
from ._registry import register
from ._gossip import Gossip
from .base import Periodic


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

    def on_bucket(self, bucket):
        if self.variant == "atc":          # adapt: the bucket's local step now, then combine its stepped model
            self.optimizer_step(bucket.params)
        peers = self.topology.neighbors(self.rank, self.t)
        self.send(bucket, self.flat_of(bucket), peers, peers)

    def step(self):
        self.scheduler.flush()
        with self.tracer.span("mix", "communicate"):      # x ← Σ_j W_ij x_j, bucket by bucket
            for bucket in self.scheduler.buckets:
                copy_flat(bucket.params, self.mix(self.received(bucket), self.t))
        if self.variant == "lian":         # mix the models the gradients were computed on, then the own gradient
            self.optimizer_step()
        self.after_step()


@register("bsp", variant="gossip")
class BSPOnGossip(DPSGD):
    """`bsp` on the gossip architecture is D-PSGD (Tang et al. Table II/IV Gossip/BSP, Lian et al. 2017): each worker
    averages its stepped model with its neighbours under the topology's mixing matrix (atc form). The default
    topology is `complete` (W = 11ᵀ/n), on which the update is exactly the all-reduce one;
    `topology=ring|torus|exponential|random` trades that for 2 or more peers per step."""

    def __init__(self, architecture: str | None = None, topology: str = "complete", consensus_every: int = 0):
        super().__init__(topology=topology, consensus_every=consensus_every, architecture=architecture)


@register("localsgd", variant="gossip")
class LocalSGDOnGossip(Periodic, DPSGD):
    """Local SGD on gossip (Tang et al. Table II): H local steps, then a gossip averaging step over the topology,
    x_i ← Σ_j W_ij x_j (D-PSGD's atc mixing, every H-th step). The default topology is `complete`, on which the
    averaging is exact model averaging (= `localsgd` on all-reduce)."""

    def __init__(self, period: int = 4, topology: str = "complete", consensus_every: int = 0,
                 final_average: bool = True, architecture: str | None = None):
        super().__init__(topology=topology, consensus_every=consensus_every, final_average=final_average,
                         architecture=architecture)
        self._period_init(period, "; H = 1 is D-PSGD")

    def communicates(self):
        return self.syncing()

    def on_bucket(self, bucket):
        if self.syncing():
            super().on_bucket(bucket)

    def step(self):
        if self.syncing():
            super().step()
            self.local_steps = 0
            self.syncs += 1
        else:
            self.scheduler.local_step()
            self.optimizer_step()
            self.local_steps += 1
            self.after_step()
