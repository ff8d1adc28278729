"""`residual`: error feedback (seed 002 §2.3 / catalog §1.3 and §10.3, Stich et al. [22]; the beta, gamma form of
GRACE's ResidualMemory): c = beta e + gamma g is compressed, and e <- c - D(C(c)) keeps what was not sent.
With beta = gamma = 1: sum of what was sent + the final residual = sum of the inputs (nothing is lost, only delayed).
State is per key (parameter, bucket or whole model); a key whose shape changes starts again from a zero residual."""
from __future__ import annotations

from ..errors import UserError
from . import memories
from .base import Memory


@memories.register("residual")
class Residual(Memory):
    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        if not (beta >= 0 and gamma > 0):
            raise UserError(f"residual: beta must be >= 0 and gamma > 0, got beta={beta}, gamma={gamma}")
        self.beta, self.gamma = float(beta), float(gamma)
        self.residuals: dict = {}

    def compensate(self, tensor, key):
        e = self.residuals.get(key)
        if e is None or e.shape != tensor.shape:
            return tensor * self.gamma if self.gamma != 1.0 else tensor
        out = tensor * self.gamma if self.gamma != 1.0 else tensor.clone()
        return out.add_(e, alpha=self.beta) if self.beta != 0 else out

    def update(self, tensor, key, sent):
        """`tensor`: what `compensate` returned; `sent`: the decompressed local payload."""
        self.residuals[key] = tensor - sent.to(tensor.dtype).view(tensor.shape)

    def state_dict(self):
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state):
        self.residuals = dict(state.get("residuals", {}))
