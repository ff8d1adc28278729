"""`choco`: CHOCO-SGD, compressed gossip (Koloskova, Stich, Jaggi [164]; catalog §2.2.3 (h)).

Every worker keeps public copies x̂ of its own model and of its neighbours' models, all of which it can update
from what crossed the wire only. With a compressor Q (biased ones such as top-k are fine: it needs only
E‖Q(x) - x‖² ≤ (1 - ω)‖x‖²) and consensus step size γ (`gamma`):
    x_i^{t+1/2} = x_i^t - η ∇F_i(x_i^t; ξ)                          (the optimizer step)
    q_i^t = Q(x_i^{t+1/2} - x̂_i^t);  send q_i^t to the neighbours
    x̂_j^{t+1} = x̂_j^t + q_j^t   for j ∈ N_i ∪ {i}
    x_i^{t+1} = x_i^{t+1/2} + γ Σ_j w_ij (x̂_j^{t+1} - x̂_i^{t+1})
The copies x̂ start at the common initial model (every worker starts from rank 0's). The x̂ are CHOCO's own error
feedback, so it takes no memory. A compressed message is a small header (the element count of each payload
tensor, so sizes may vary per step) followed by the payload bytes: two messages per neighbour per step.
With compressor `none` and γ = 1, CHOCO is D-PSGD (atc). `close()` measures consensus and averages (see _gossip).
"""
from __future__ import annotations

import torch

from ..comm.collectives import wait_all
from ..compress import Payload
from ..errors import UserError
from . import register
from ._gossip import TAG, Gossip


@register("choco")
class CHOCO(Gossip):
    """CHOCO-SGD: gossip of compressed model differences with public copies, consensus step size gamma."""

    compression = True

    def __init__(self, topology: str = "ring", gamma: float = 0.5, consensus_every: int = 0,
                 final_average: bool = True, architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        if not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise UserError(f"choco consensus step size gamma must be in (0, 1], got {gamma!r}")
        if topology == "random":
            raise UserError("choco keeps a public copy per neighbour, so it needs a fixed topology; "
                            "valid: ring, torus, exponential, complete")
        self.gamma = float(gamma)

    def gossip_setup(self):
        comp, mem = self.trainer.compressor, self.trainer.memory
        if getattr(comp, "aggregation", "allreduce") == "custom":
            raise UserError(f"compressor {comp.name!r} runs its own collective and cannot be gossiped; "
                            "use a payload compressor (e.g. topk, randomk, qsgd, fp16, signsgd)")
        if getattr(mem, "name", "none") != "none":
            raise UserError(f"choco's public copies are its error feedback: drop --memory {mem.name} "
                            "(valid: none)")
        self.compressor = comp
        self.peers = self.topology.neighbors(self.rank)
        x0 = self.flat_params().clone()
        self.hat_self = x0.clone()
        self.hat = {j: x0.clone() for j in self.peers}

    def _send_recv(self, payload: Payload) -> dict[int, Payload]:
        tp = self.transport
        tensors = [t.contiguous() for t in payload.tensors]
        header = torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=tp.device)
        body = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors] or [torch.empty(0, dtype=torch.uint8, device=tp.device)])
        hs = [tp.isend(header, j, tag=TAG) for j in self.peers]
        if body.numel():
            hs += [tp.isend(body, j, tag=TAG + 1) for j in self.peers]
        heads = {j: torch.empty_like(header) for j in self.peers}
        wait_all([tp.irecv(heads[j], j, tag=TAG) for j in self.peers])
        bodies, rh = {}, []
        for j in self.peers:
            nbytes = sum(int(c) * t.element_size() for c, t in zip(heads[j].tolist(), tensors))
            bodies[j] = torch.empty(nbytes, dtype=torch.uint8, device=tp.device)
            if nbytes:
                rh.append(tp.irecv(bodies[j], j, tag=TAG + 1))
        wait_all(hs + rh)
        out = {}
        for j in self.peers:
            parts, offset = [], 0
            for c, t in zip(heads[j].tolist(), tensors):
                nb = int(c) * t.element_size()
                part = bodies[j][offset:offset + nb].view(t.dtype)
                parts.append(part.view(t.shape) if part.numel() == t.numel() else part)
                offset += nb
            out[j] = Payload(parts, payload.ctx, dict(payload.extra))
        return out

    def step(self):
        self.optimizer_step()
        x = self.flat_params().clone()
        with self.tracer.span("compress", "compress"):
            payload = self.compressor.compress(x - self.hat_self, key="choco", step=self.t)
            q = self.compressor.decompress(payload).reshape(-1).to(x.dtype)
        got = self._send_recv(payload)
        self.hat_self.add_(q)
        W = self.topology.matrix()
        correction = torch.zeros_like(x)
        for j in sorted(got):
            self.hat[j].add_(self.compressor.decompress(got[j]).reshape(-1).to(x.dtype))
            correction.add_(self.hat[j] - self.hat_self, alpha=float(W[self.rank, j]))
        x.add_(correction, alpha=self.gamma)
        self.set_flat_params(x)
        self.after_step()

    def metrics(self):
        return {**super().metrics(), "gamma": self.gamma}

    def state_dict(self):
        return {**super().state_dict(), "hat_self": self.hat_self.clone(),
                "hat": {j: h.clone() for j, h in self.hat.items()}, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.hat_self = state["hat_self"].clone()
        self.hat = {j: h.clone() for j, h in state["hat"].items()}
        self.compressor.load_state_dict(state["compressor"])
