"""`gaussiank`: Gaussian-k (Shi, Chu, Cheung, See 2019; seed 002 §4.3.2, seed 000 §2.4.14 in the catalog).

Models g as N(μ, σ²) and sends |g − μ| ≥ z σ with z = Φ⁻¹(1 − ρ/2), i.e. thr = μ + σ Φ⁻¹(1 − ρ/2) on the right
tail (catalog 3.4 [O]); then corrects the estimate up to 5 times: fewer than 2k/3 selected → thr × 0.5, more
than 4k/3 → thr × 1.5. The fit and the corrections use a random sample (≥ 64 expected hits above the
threshold; the whole tensor when small), so the tensor is passed over once; the count is within [2k/3, 4k/3] of
the SAMPLE's estimate unless the 5 corrections run out.
"""
from __future__ import annotations

from statistics import NormalDist

import torch

from . import compressors
from ._sparse import SparseCompressor, beyond, check_collective, check_ratio, generator, num_kept


@compressors.register("gaussiank")
class GaussianK(SparseCompressor):
    """Gaussian-k: threshold from the normal fit μ + σΦ⁻¹(1−ρ/2), adjusted ×0.5/×1.5 toward k = ρ·d."""

    def __init__(self, ratio: float = 0.01, adjust: int = 5, seed: int = 0, sparse_collective: str = "allgather"):
        self.sparse_collective = check_collective(sparse_collective)   # exchange/sparse.py
        self.ratio = check_ratio(ratio)
        self.adjust = int(adjust)
        self.seed = seed
        self.z = NormalDist().inv_cdf(1 - self.ratio / 2) if self.ratio < 1 else 0.0

    def select(self, flat, key, step):
        d = flat.numel()
        k = num_kept(self.ratio, d)
        if k >= d:
            return torch.arange(d)
        # μ, σ and the corrections are computed on a random sample (exact when the tensor is small); only the
        # final selection passes over the whole tensor
        s = min(d, max(4096, int(64 * d / k)))
        sample = flat if s == d else flat[torch.randint(d, (s,), generator=generator(self.seed, key, step))]
        sample = sample.float()
        std, mean = torch.std_mean(sample) if s > 1 else (torch.zeros(()), sample.mean())
        dev = (sample - mean).abs()
        thr = float(self.z * std)
        want = k * s / d

        def count(t):  # a zero threshold would send exact zeros: keep only non-zero deviations then
            return int((dev >= t).sum()) if t > 0 else int((dev > 0).sum())
        for _ in range(self.adjust):
            c = count(thr)
            if c < 2 * want / 3:
                thr *= 0.5
            elif c > 4 * want / 3:
                thr *= 1.5
            else:
                break
        return torch.nonzero(beyond(flat, thr, float(mean))).squeeze(1)

    def nominal_bits(self, numel):
        return self.sparse_bits(num_kept(self.ratio, numel), numel)
