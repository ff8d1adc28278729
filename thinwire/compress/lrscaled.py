"""`efsignsgd` memory: the learning-rate-scaled error feedback of EF-SignSGD (Karimireddy, Rebjock, Stich, Jaggi
2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", arXiv 1901.09847, Algorithm 1):
p_t = lr g_t + e_t, Delta_t = C(p_t), e_{t+1} = p_t - Delta_t, the aggregate divided by lr again (the optimizer
applies it). The exchange sees gradient units: `compensate` returns p_t / lr and `update` stores e = lr (p_t / lr -
D(C(p_t / lr))) = p_t - Delta_t for scale-equivariant compressors (all sign and norm-scaled ones). Keeping e in
update units is what differs from `residual` when lr changes: pass `ef_lr` = the optimizer's learning rate and,
under a schedule, set `memory.lr` before each step. Invariant: lr * sum(sent) + e_final = lr * sum(g) for a constant
lr. `momentum` as `residual`'s."""
from __future__ import annotations

from ..errors import UserError
from . import memories
from .base import Memory, optional_momentum


@memories.register("efsignsgd")
class LRScaledResidual(Memory):
    takes_momentum = True
    state_attrs = ("errors", "momenta")

    def __init__(self, ef_lr: float = 0.1, momentum: float | None = None):
        if not ef_lr > 0:
            raise UserError(f"efsignsgd memory: ef_lr (the optimizer's learning rate) must be > 0, got {ef_lr}")
        self.lr = float(ef_lr)
        self.momentum = optional_momentum(momentum, "efsignsgd memory: momentum")
        self.errors: dict = {}
        self.momenta: dict = {}

    def compensate(self, tensor, key):
        tensor = self.heavy_ball(tensor, key)        # momentum before compression, as `residual`
        e = self.errors.get(key)
        if e is None or e.shape != tensor.shape:
            return tensor
        return tensor.add(e, alpha=1.0 / self.lr)           # (lr g + e) / lr

    def update(self, tensor, key, sent):
        """`tensor`: what `compensate` returned (p / lr); `sent`: the decompressed local payload (Delta / lr)."""
        self.errors[key] = (tensor - sent.to(tensor.dtype).view(tensor.shape)).mul_(self.lr)

    def state_dict(self):
        return {"lr": self.lr, **super().state_dict()}

    def load_state_dict(self, state):
        self.lr = state.get("lr", self.lr)
        super().load_state_dict(state)
