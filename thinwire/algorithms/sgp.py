"""`sgp`: Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat 2019, "Stochastic Gradient Push for
Distributed Deep Learning", arXiv 1811.10792, Algorithm 1).

Push-sum gossip: every worker sends to its out-peer without waiting for an answer from it, over a directed,
time-varying graph with a column-stochastic mixing matrix P (each worker keeps half its mass and pushes half to
one peer: the peer rotates through the topology's neighbours, step by step, `Topology.out_peer`). Each worker
holds a numerator x_i and a push-sum weight w_i (w_i = 1 at start); the model the gradient is computed on is
z_i = x_i / w_i (Assran et al., Algorithm 1):
    x_i^{k+1/2} = x_i^k - γ ∇F_i(z_i^k)
    x_i^{k+1} = Σ_j p_ij x_j^{k+1/2},   w_i^{k+1} = Σ_j p_ij w_j^k,   z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
Per bucket, during backward: the bucket's numerator takes its optimizer step and half of it is pushed to the
out-peer at once; the weight travels in bucket 0's message (one extra element). `step()` sums what this worker
kept and what its in-peers pushed, and divides by the new weight. The average Σ_i x_i / n is preserved by the
mixing; `close()` measures consensus of the z_i around it and sets every model to it. The reported spectral gap
is that of P (`Topology.push_gap`), not of the symmetric W of the topology.
"""
from __future__ import annotations

import torch

from ..tensors import copy_flat
from ._registry import register
from ._gossip import Gossip


@register("sgp")
class SGP(Gossip):
    """Stochastic Gradient Push: push-sum gossip to one rotating out-peer per step."""

    compression = False

    def __init__(self, topology: str = "exponential", consensus_every: int = 0, final_average: bool = True,
                 architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        self.weight = 1.0

    def on_bucket(self, bucket):
        with torch.no_grad():
            for p in bucket.params:     # the numerator x = w z takes the optimizer step
                p.mul_(self.weight)
        self.optimizer_step(bucket.params)
        out = self.topology.out_peer(self.rank, self.t)
        keep = 0.5 if out >= 0 else 1.0     # nobody to push to: keep all the mass
        msg = self.flat_of(bucket).mul_(keep)
        if bucket.index == 0:
            msg = torch.cat([msg, msg.new_tensor([keep * self.weight])])
        self.send(bucket, msg, [out] if out >= 0 else [], self.topology.in_peers(self.rank, self.t))

    def step(self):
        self.scheduler.flush()
        totals = []
        for bucket in self.scheduler.buckets:
            got = self.received(bucket)
            total = got.pop(self.rank).clone()
            for j in sorted(got):
                total.add_(got[j])
            totals.append(total)
        self.weight = float(totals[0][-1])
        for bucket, total in zip(self.scheduler.buckets, totals):
            copy_flat(bucket.params, total[:bucket.buffer.numel()] / self.weight)
        self.after_step()

    def average_model(self) -> torch.Tensor:
        """The push-sum average Σ_i x_i / n (what the mixing preserves)."""
        num = torch.cat([self.flat_params() * self.weight, self.flat_params().new_tensor([self.weight])])
        num = self.transport.all_reduce(num, op="sum")
        return num[:-1] / num[-1]

    def spectral_gap(self) -> float:
        return self.topology.push_gap()

    def close(self):
        super().close()
        if self.final_average:
            self.weight = 1.0

    def metrics(self):
        return {**super().metrics(), "push_sum_weight": self.weight}

    def state_dict(self):
        return {**super().state_dict(), "weight": self.weight}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.weight = state["weight"]
