"""`bsp`: bulk-synchronous parallel SGD (seed 000 §III-A, eq. 6): every step, the mean gradient of all workers."""
from __future__ import annotations

from ..exchange import Exchange
from . import register
from .base import Algorithm


@register("bsp")
class BSP(Algorithm):
    """Synchronous SGD: x_{t+1} = x_t - γ (1/n) Σ_i G_i(x_t) (seed 000 eq. 6), through any compressor."""

    architectures = ("allreduce",)

    def __init__(self, architecture: str | None = None):
        super().__init__(architecture)

    def setup(self):
        self.exchange = Exchange(self.transport, self.trainer.compressor, self.trainer.memory)

    def step(self):
        flat = self.flat_grad()
        mean = self.exchange.aggregate(flat, key="model")
        self.set_flat_grad(mean)
        self.optimizer_step()

    def state_dict(self):
        return {"exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.exchange.load_state_dict(state["exchange"])
