"""`gaussiank`: Gaussian-k (Shi, Chu, Cheung, See 2019; seed 002 §4.3.2, seed 000 §2.4.14 in the catalog).

Models g as N(μ, σ²) and sends |g − μ| ≥ z σ with z = Φ⁻¹(1 − ρ/2), i.e. thr = μ + σ Φ⁻¹(1 − ρ/2) on the right
tail (catalog 3.4 [O]); then corrects the estimate up to 5 times: fewer than 2k/3 selected → thr × 0.5, more
than 4k/3 → thr × 1.5. O(d) per pass; the count is within [2k/3, 4k/3] unless the 5 corrections run out.
"""
from __future__ import annotations

from statistics import NormalDist

import torch

from . import compressors
from ._sparse import SparseCompressor, check_ratio, num_kept


@compressors.register("gaussiank")
class GaussianK(SparseCompressor):
    """Gaussian-k: threshold from the normal fit μ + σΦ⁻¹(1−ρ/2), adjusted ×0.5/×1.5 toward k = ρ·d."""

    def __init__(self, ratio: float = 0.01, adjust: int = 5):
        self.ratio = check_ratio(ratio)
        self.adjust = int(adjust)
        self.z = NormalDist().inv_cdf(1 - self.ratio / 2) if self.ratio < 1 else 0.0

    def select(self, flat, key, step):
        d = flat.numel()
        k = num_kept(self.ratio, d)
        if k >= d:
            return torch.arange(d)
        std, mean = torch.std_mean(flat.float()) if d > 1 else (torch.zeros(()), flat.float().mean())
        dev = (flat - mean.to(flat.dtype)).abs()
        thr = float(self.z * std)

        def passing(t):  # a zero threshold would send exact zeros: keep only non-zero deviations then
            return dev >= t if t > 0 else dev > 0
        mask = passing(thr)
        for _ in range(self.adjust):
            count = int(mask.sum())
            if count < 2 * k / 3:
                thr *= 0.5
            elif count > 4 * k / 3:
                thr *= 1.5
            else:
                break
            mask = passing(thr)
        return torch.nonzero(mask).squeeze(1)

    def nominal_bits(self, numel):
        return self.sparse_bits(num_kept(self.ratio, numel), numel)
