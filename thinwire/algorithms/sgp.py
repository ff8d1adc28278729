"""`sgp`: Stochastic Gradient Push (Assran et al. [53]; seed 000 §IV-C, catalog §2.2.3 (b)).

Push-sum gossip: every worker sends to its out-peer without waiting for an answer from it, over a directed,
time-varying graph with a column-stochastic mixing matrix P (each worker keeps half its mass and pushes half to
one peer: the peer rotates through the topology's neighbours, step by step). Each worker holds a numerator x_i
and a push-sum weight w_i (w_i = 1 at start); the model the gradient is computed on is z_i = x_i / w_i:
    x_i^{k+1/2} = x_i^k - γ ∇F_i(z_i^k)
    x_i^{k+1} = Σ_j p_ij x_j^{k+1/2},   w_i^{k+1} = Σ_j p_ij w_j^k,   z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
The weight travels in the same message as the numerator (one extra element). The average Σ_i x_i / n is
preserved by the mixing; `close()` measures consensus of the z_i around it and sets every model to it.
"""
from __future__ import annotations

import torch

from . import register
from ._gossip import Gossip


@register("sgp")
class SGP(Gossip):
    """Stochastic Gradient Push: push-sum gossip to one rotating out-peer per step."""

    compression = False
    topologies = ("ring", "torus", "exponential", "random", "complete")

    def __init__(self, topology: str = "exponential", consensus_every: int = 0, final_average: bool = True,
                 architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        self.weight = 1.0

    def out_peer(self, i: int, step: int) -> int:
        peers = self.topology.neighbors(i, step)
        return peers[step % len(peers)] if peers else -1

    def step(self):
        z = self.flat_params()
        self.set_flat_params(z * self.weight)  # the numerator x = w z takes the optimizer step
        self.optimizer_step()
        x = self.flat_params()
        out = self.out_peer(self.rank, self.t)
        ins = [j for j in range(self.world_size) if j != self.rank and self.out_peer(j, self.t) == self.rank]
        msg = torch.cat([x, x.new_tensor([self.weight])]).mul_(0.5)
        got = self.exchange(msg, [out] if out >= 0 else [], ins)
        if out < 0:  # nobody to push to: keep all the mass
            msg.mul_(2.0)
        total = msg.clone()
        for j in sorted(got):
            total.add_(got[j])
        self.weight = float(total[-1])
        self.set_flat_params(total[:-1] / self.weight)
        self.after_step()

    def average_model(self) -> torch.Tensor:
        """The push-sum average Σ_i x_i / n (what the mixing preserves)."""
        num = torch.cat([self.flat_params() * self.weight, self.flat_params().new_tensor([self.weight])])
        num = self.transport.all_reduce(num, op="sum")
        return num[:-1] / num[-1]

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
