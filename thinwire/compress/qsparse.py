"""`qsparse`: top-k, then QSGD of the kept values, scaled down (Qsparse-local-SGD: Basu, Data, Karakus,
Diggavi 2019, "Qsparse-local-SGD: Distributed SGD with Quantization, Sparsification, and Local Computations",
arXiv 1906.02367):

    QsTop_k(x) = Q_s(Top_k(x)) / (1 + β_{k,s}),  β_{k,s} = min(k/s², √k/s)        (Basu et al. 2019)

Q_s is QSGD with s levels on the k values v: ‖v‖₂ · sign(v_i) · ξ_i/s, ξ_i = ⌊s|v_i|/‖v‖₂⌋ + Bernoulli(frac)
(unbiased stochastic rounding, local randomness). Payload: indices, one fp32 norm, and the signed level
(in [−s, s]) as ⌈log2(2s+1)⌉ bits per kept value.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._sparse import local_generator
from .topk import QuantizedTopK


def qsgd_levels(v: torch.Tensor, s: int, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD's signed levels in [−s, s] of `v` (float) and its L2 norm (stochastic rounding, unbiased)."""
    norm = v.norm()
    if norm == 0:
        return torch.zeros(v.numel(), dtype=torch.int64, device=v.device), norm.reshape(1)
    scaled = v.abs() / norm * s
    low = scaled.floor()
    up = torch.rand(v.numel(), generator=gen, device=gen.device).to(v.device) < (scaled - low)
    levels = (low + up.float()).to(torch.int64) * torch.where(v < 0, -1, 1)
    return levels, norm.reshape(1)


@compressors.register("qsparse")
class QSparse(QuantizedTopK):
    """Top-k then QSGD of the values (s levels), scaled by 1/(1+β_{k,s}) as in Qsparse-local-SGD."""
    x_memcpy = 12.0

    def __init__(self, ratio: float = 0.01, levels: int = 7, seed: int = 0):
        super().__init__(ratio, seed)
        if not isinstance(levels, int) or levels < 1:
            raise UserError(f"levels must be an integer >= 1, got {levels}")
        self.levels = levels
        self.bits = math.ceil(math.log2(2 * levels + 1))
        self._gen = None   # local randomness for the rounding, seeded by (seed, rank) on first use

    def quantize(self, vals):
        if self._gen is None:
            self._gen = local_generator(self.seed)
        levels, norm = qsgd_levels(vals, self.levels, self._gen)
        return levels + self.levels, norm

    def dequantize(self, codes, norm):
        k, s = codes.numel(), self.levels
        beta = min(k / s ** 2, math.sqrt(k) / s)
        return (codes - s).float() * (norm / s / (1 + beta))

    def state_dict(self):
        return {"rng": self._gen.get_state()} if self._gen is not None else {}

    def load_state_dict(self, state):
        if "rng" in state:
            self._gen = self._gen or local_generator(self.seed)
            self._gen.set_state(state["rng"])
