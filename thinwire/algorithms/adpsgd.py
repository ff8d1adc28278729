"""`adpsgd`: asynchronous decentralized parallel SGD (Lian, Zhang, Zhang, Liu 2018, "Asynchronous
Decentralized Parallel Stochastic Gradient Descent", arXiv 1710.06952, Algorithm 1).

AD-PSGD's worker loop: read the model x̂_i and compute g = ∇F_i(x̂_i); atomically average with one peer,
x_i, x_j ← (x_i + x_j)/2; apply x_i ← x_i - γ g. The gradients are computed on a model read before averagings
still in flight were applied (its staleness is bounded, Lian et al. 2018, Assumption 1), and a worker waits for
nobody's computation: in Lian et al. 2018 a communication thread averages while the compute thread goes on.

Here, deterministic and deadlock-free: averagings start every `staleness` = τ steps with the partner of a
matching (topology `random`: a random perfect matching drawn from (seed, round); `ring`: alternating even/odd
edges), so every pair posts its sends and receives together. At a pairing step s each bucket, as backward hands
it over, takes its optimizer step and its parameters x_i^s go to the partner (`NeighborExchange`); the exchange
completes in the background while the worker runs the next τ steps on its own; at step s + τ, before that step's
own update of the bucket, the average arrives as the correction
    x_i ← x_i + (x_j^s - x_i^s) / 2        (the atomic pairwise average of the step-s models, Algorithm 1 step 2)
so x_i = (x_i^s + x_j^s)/2 + the worker's own updates since s, and the partners' corrections are exact opposites
(Σ_i x_i is unchanged, as by the atomic average). A worker blocks only on an averaging still in flight τ steps
after it started (bounded staleness, in logical steps, so runs are reproducible); τ = 1 is the averaging
overlapped with one step's compute. One averaging is in flight per worker at a time: a second one started
before the first is applied would correct the same disagreement twice (the delayed recurrence
d_{t+1} = d_t - d_{t-τ} of two partners does not converge). The reported spectral gap is that of the matchings
it averages with (`Topology.pairwise_gap`), per averaging. `close()` applies the last averaging, then measures
consensus and averages (see _gossip).
"""
from __future__ import annotations

import torch

from ..tensors import views
from ._registry import register
from ._gossip import Gossip
from .base import int_at_least
from .cost import CostFamily


@register("adpsgd")
class ADPSGD(Gossip):
    """AD-PSGD: pairwise model averaging in the background, applied `staleness` steps later (random or ring)."""

    compression = False
    topologies = ("random", "ring")
    overlaps_steps = True         # an averaging outlives the step that started it
    cost = CostFamily("gossip", {"degree": 1})   # one peer per averaging

    def __init__(self, topology: str = "random", staleness: int = 2, consensus_every: int = 0,
                 final_average: bool = True, architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        self.staleness = int_at_least("adpsgd staleness", staleness, 1,
                                      " (steps an averaging runs in the background before it is applied)")
        self.pairings = 0

    def setup(self):
        super().setup()
        self.inflight: dict[int, tuple] = {}            # bucket index -> (members, x_i^s, future, partner)
        self.corrections: dict[int, torch.Tensor] = {}  # parameter index -> its (x_j^s - x_i^s)/2, arrived

    def pairing(self) -> bool:
        """Whether an averaging is applied and the next one starts at this step."""
        return self.t % self.staleness == 0

    def partner(self) -> int:
        return self.topology.matching(self.t // self.staleness)[self.rank]

    def on_bucket(self, bucket):
        if not self.pairing():
            return
        self.apply(bucket.members)          # the averaging started τ steps ago, for these parameters
        self.optimizer_step(bucket.params)
        peer = self.partner()
        if peer >= 0:
            snap = self.flat_of(bucket)
            fut = self.exchange.start(snap, bucket.key, [peer], [peer])
            self.inflight[bucket.index] = (bucket.members, snap, fut, peer)

    def communicates(self):
        return self.pairing()

    def step(self):
        if self.pairing():
            self.scheduler.flush()
            self.pairings += self.partner() >= 0
        else:
            self.scheduler.local_step()
            self.optimizer_step()
        self.after_step()

    # -- averagings in flight ----------------------------------------------------------------------------------
    def resolve(self, members=None) -> None:
        """Wait for the averagings in flight that cover `members` (all: None) and keep their corrections."""
        want = None if members is None else set(members)
        for b, (mem, snap, fut, peer) in list(self.inflight.items()):
            if want is not None and want.isdisjoint(mem):
                continue
            del self.inflight[b]
            half = (fut.wait()[peer] - snap).div_(2)
            for i, c in zip(mem, views(half, [self.params[i] for i in mem])):
                self.corrections[i] = c

    def apply(self, members) -> None:
        self.resolve(members)
        with torch.no_grad():
            for i in members:
                c = self.corrections.pop(i, None)
                if c is not None:
                    self.params[i].add_(c)

    def close(self):
        self.apply(range(len(self.params)))     # the last averaging, before consensus and the final average
        super().close()

    def rekey(self, old, new):
        self.resolve()                      # the buckets change: keep the arrived corrections per parameter
        super().rekey(old, new)

    def spectral_gap(self) -> float:
        return self.topology.pairwise_gap()

    def metrics(self):
        return {**super().metrics(), "pairings": self.pairings, "staleness": self.staleness}

    def state_dict(self):
        """Waits for the averaging in flight (every rank calls this at the same step) and keeps its correction."""
        self.resolve()
        return {**super().state_dict(), "pairings": self.pairings,
                "corrections": {i: c.clone() for i, c in self.corrections.items()}}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.pairings = state["pairings"]
        self.corrections = {i: c.clone() for i, c in state["corrections"].items()}
