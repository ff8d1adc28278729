"""`localsgd`: local SGD / model averaging / PR-SGD (seed 000 §III-D, catalog §2.1.11–2.1.12).

Every worker takes local optimizer steps; every H steps the models are averaged:
    x_{i,t+1} = x_{i,t} - γ G_{i,t}(x_{i,t})                       if t+1 ∉ I_T
    x_{i,t+1} = (1/n) Σ_j (x_{j,t} - γ G_{j,t}(x_{j,t}))           if t+1 ∈ I_T = {H, 2H, ...}
(catalog Appendix B item 3: seed 000's eq. 9 as printed averages gradients and never the models; this is the
corrected form, Stich [73].) The average travels through an `Exchange` as the model *delta* since the last
average, x = x_anchor + mean_j(C(x_j - x_anchor)), so a compressor applies to the deltas and a memory gives
error feedback on them: local SGD with compressed model deltas (Qsparse-local-SGD, Basu et al. [181]).

Momentum local SGD (Yu, Jin, Yang [111]): with an optimizer that has momentum, each worker keeps its own
buffer u_i ← βu_i + G_i, x_i ← x_i - γu_i (the default); `average_momentum=true` also averages the momentum
buffers at every synchronisation (the paper's variant with global momentum; costs a second exchange).
With H = 1 and no compressor, local SGD is exactly synchronous SGD (bsp), momentum included.
`close()` averages the models once more if steps were taken since the last average: every worker ends with
the same model.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..exchange import Exchange
from . import register
from .base import Algorithm


@register("localsgd")
class LocalSGD(Algorithm):
    """Local SGD: H local steps, then average the models (the deltas go through the compressor)."""

    architectures = ("allreduce",)

    def __init__(self, period: int = 4, average_momentum: bool = False, allreduce: str = "gloo",
                 architecture: str | None = None):
        super().__init__(architecture)
        if not isinstance(period, int) or period < 1:
            raise UserError(f"localsgd period H must be an integer >= 1, got {period!r}; "
                            "H = 1 is synchronous SGD (bsp)")
        self.period = period
        self.average_momentum = bool(average_momentum)
        self.allreduce = allreduce
        self.local_steps = 0
        self.syncs = 0

    def setup(self):
        self.exchange = Exchange(self.transport, self.trainer.compressor, self.trainer.memory)
        self.anchor = self.flat_params().clone()
        self._momentum_exchange = None
        if self.average_momentum:
            self._momentum_exchange = Exchange(self.transport, "none", "none")

    # -- local steps and averaging ---------------------------------------------------------------------------
    def local_step(self) -> None:
        self.optimizer_step()
        self.local_steps += 1

    def average(self) -> None:
        """x ← x_anchor + mean_j C(x_j - x_anchor); the new anchor is the averaged model."""
        with self.tracer.span("average models", "communicate"):
            delta = self.flat_params() - self.anchor
            mean = self.exchange.aggregate(delta, key="model")
            self.anchor.add_(mean)
            self.set_flat_params(self.anchor)
            if self._momentum_exchange is not None:
                bufs = self._momentum_buffers()
                if bufs:
                    flat = torch.cat([b.reshape(-1) for b in bufs])
                    flat = self._momentum_exchange.aggregate(flat, key="momentum")
                    offset = 0
                    for b in bufs:
                        b.copy_(flat[offset:offset + b.numel()].view_as(b))
                        offset += b.numel()
        self.local_steps = 0
        self.syncs += 1

    def _momentum_buffers(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out.append(buf)
        return out

    def step(self):
        self.local_step()
        if self.local_steps >= self.period:
            self.average()

    def close(self):
        if self.local_steps:
            self.average()

    def metrics(self):
        return {"period": self.period, "syncs": self.syncs}

    def state_dict(self):
        return {"exchange": self.exchange.state_dict(), "anchor": self.anchor.clone(),
                "local_steps": self.local_steps, "syncs": self.syncs}

    def load_state_dict(self, state):
        self.exchange.load_state_dict(state["exchange"])
        self.anchor = state["anchor"].clone()
        self.local_steps, self.syncs = state["local_steps"], state["syncs"]


@register("postlocalsgd")
class PostLocalSGD(LocalSGD):
    """Post-local SGD (Lin, Stich, Jaggi [121]): synchronous SGD until step `switch`, then local SGD."""

    def __init__(self, switch: int = 100, period: int = 4, average_momentum: bool = False,
                 allreduce: str = "gloo", architecture: str | None = None):
        super().__init__(period, average_momentum, allreduce, architecture)
        if not isinstance(switch, int) or switch < 0:
            raise UserError(f"postlocalsgd switch must be a step number >= 0, got {switch!r}")
        self.switch = switch
        self.steps = 0

    def setup(self):
        super().setup()
        self.grad_exchange = Exchange(self.transport, "none", "none")

    def step(self):
        self.steps += 1
        if self.steps <= self.switch:  # phase 1: mini-batch SGD on the mean gradient (seed 000 eq. 6)
            self.set_flat_grad(self.grad_exchange.aggregate(self.flat_grad(), key="grad"))
            self.optimizer_step()
            self.anchor = self.flat_params().clone()
            return
        super().step()

    def metrics(self):
        return {**super().metrics(), "switch": self.switch}

    def state_dict(self):
        return {**super().state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.steps = state["steps"]
