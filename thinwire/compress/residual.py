"""`residual`: error feedback (Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory", arXiv 1809.07599,
Algorithm 1; the beta, gamma form of GRACE's ResidualMemory): c = beta e + gamma g is compressed, and
e <- c - D(C(c)) keeps what was not sent. With beta = gamma = 1: sum of what was sent + the final residual = sum of
the inputs (nothing is lost, only delayed). State per key; a key whose shape changes starts from a zero residual.

`momentum` μ > 0 applies heavy-ball momentum before compression, EF-SGDM (Zheng, Huang, Kwok 2019, "Communication-
Efficient Distributed Blockwise Momentum SGD with Error-Feedback", Alg. 1 with its η moved to the optimizer):
u ← μ u + g, c = β e + γ u. Unset (None) it takes the optimizer's where the exchange carries gradients (`Memory` in
compress/base.py), else 0."""
from __future__ import annotations

from ..errors import UserError
from . import memories
from .base import Memory, optional_momentum


@memories.register("residual")
class Residual(Memory):
    takes_momentum = True
    state_attrs = ("residuals", "momenta")

    def __init__(self, beta: float = 1.0, gamma: float = 1.0, momentum: float | None = None):
        if not (beta >= 0 and gamma > 0):
            raise UserError(f"residual: beta must be >= 0 and gamma > 0, got beta={beta}, gamma={gamma}")
        self.beta, self.gamma = float(beta), float(gamma)
        self.momentum = optional_momentum(momentum, f"{self.name or 'residual'}: momentum")
        self.residuals: dict = {}
        self.momenta: dict = {}

    def compensate(self, tensor, key):
        tensor = self.heavy_ball(tensor, key)        # EF-SGDM: u ← μ u + g (μ = 0: g itself)
        e = self.residuals.get(key)
        if e is None or e.shape != tensor.shape:
            return tensor * self.gamma if self.gamma != 1.0 else tensor
        out = tensor * self.gamma if self.gamma != 1.0 else tensor.clone()
        return out.add_(e, alpha=self.beta) if self.beta != 0 else out

    def update(self, tensor, key, sent):
        """`tensor`: what `compensate` returned; `sent`: the decompressed local payload."""
        self.residuals[key] = tensor - sent.to(tensor.dtype).view(tensor.shape)
