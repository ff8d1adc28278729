"""`gaussiank`: Gaussian-k (Shi, Chu, Cheung, See 2019, "Understanding Top-k Sparsification in
Distributed Deep Learning", arXiv 1911.08772).

Models g as N(μ, σ²) and sends |g − μ| ≥ z σ with z = Φ⁻¹(1 − ρ/2), as the paper does, then corrects the threshold
up to `adjust` times: fewer than 2k/3 selected → × 0.5, more than 4k/3 → × 1.5. μ and σ come from the whole tensor
(Σg and Σg², two fast reductions: a sample's σ misses by ~1%, which moves the count at z = 2.58 by ~7%); each
correction re-counts the whole tensor from |g − μ| in a reused buffer. On normal data the first threshold lands
within a few per cent of k.
"""
from __future__ import annotations

from statistics import NormalDist

import torch

from ..registry import NON_NEGATIVE
from . import compressors
from ._sparse import SparseCompressor, num_kept
from .threshold import Scratch, reselect, select_beyond


@compressors.register("gaussiank")
class GaussianK(SparseCompressor):
    """Gaussian-k: threshold from the normal fit μ + σΦ⁻¹(1−ρ/2), adjusted ×0.5/×1.5 toward k = ρ·d."""
    limits = {"adjust": NON_NEGATIVE}     # rounds of adjustment
    x_memcpy = 10.0

    def __init__(self, ratio: float = 0.01, adjust: int = 5, seed: int = 0):
        super().__init__(ratio, seed)
        self.adjust = int(adjust)
        self.z = NormalDist().inv_cdf(1 - self.ratio / 2) if self.ratio < 1 else 0.0
        self._scratch = Scratch()

    def select(self, flat, key, step):
        d = flat.numel()
        k = num_kept(self.ratio, d)
        if k >= d:
            return torch.arange(d, device=flat.device)
        f = flat if flat.dtype == torch.float32 else flat.float()
        total, squares = f.sum().double(), torch.dot(f, f).double()     # two fast reductions (std_mean is slow)
        mean = float(total / d)
        std = float(((squares - total * total / d).clamp(min=0) / max(1, d - 1)).sqrt())
        thr = self.z * std
        idx, dev = select_beyond(f, thr, mean, self._scratch)
        for _ in range(self.adjust):
            c = idx.numel()
            if c < 2 * k / 3:
                thr *= 0.5
            elif c > 4 * k / 3:
                thr *= 1.5
            else:
                break
            idx = reselect(dev, thr, self._scratch) if dev is not None else select_beyond(f, thr, mean)[0]
        return idx
