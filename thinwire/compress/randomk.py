"""`randomk`: k coordinates drawn uniformly without replacement (Stich, Cordonnier, Jaggi 2018, "Sparsified
SGD with Memory", arXiv 1809.07599, rand_k).

Every rank draws the SAME indices, from a seed derived from (seed, key, step), so only the k values travel and
they are summed by all-reduce (the shared indices make the payloads addable). `scale=True`:
C(g)_i = (d/k) g_i 1[i ∈ Ω], unbiased with E‖C(g) − g‖² = (d/k − 1)‖g‖²; `scale=False`: g ⊙ 1_Ω, biased,
E‖C(g) − g‖² = (1 − k/d)‖g‖², the form to use with error feedback (scaling by d/k inside error feedback amplifies
the residual: unstable).

Default ratio 0.5. The unbiased form multiplies the gradient noise: averaged over n workers the variance grows
by ω/n with ω = d/k − 1, and the step size that trains shrinks by about 1 + ω/n (the bound of unbiased
compressed SGD, e.g. Khirirat et al. 2018; DIANA's γ ≤ 1/(L(1 + 2ω/n))). On digits-mlp at its lr 0.2 and momentum
0.9, 4 workers: at k/d = 1 % (ω = 99) it ended at 0.09–0.20 under every algorithm, at 10 % at 0.34 (lr 0.05: 0.97),
at 50 % it reaches the target under every algorithm (docs/matrix.md). Error feedback (`scale=false`, `residual`)
does not rescue small ratios at momentum 0.9: each coordinate waits ~d/k steps, a staleness heavy-ball momentum
does not tolerate (0.11–0.19 at 1–25 %). For fewer bytes at the same step size use `topk`.

Drawing k of d without a full permutation: draw a few more than k with replacement (already in increasing order,
as exponential spacings: no sort), keep the distinct ones and drop a random few to leave k. By symmetry over [d]
the result is a uniform k-subset; it costs O(k), not O(d), and the sorted indices make the gather and the
scatter sweep memory in order.
"""
from __future__ import annotations

import torch

from . import compressors
from ._sparse import check_ratio, generator, num_kept
from .base import Compressor, Payload


def sample_without_replacement(d: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct indices of [d], a uniformly random k-subset (int64; in increasing order when k <= d / 4)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=gen.device)
    if k >= d or k > d // 4:
        return torch.randperm(d, generator=gen, device=gen.device)[:k]
    m = k + 2 * k * k // d + 16
    while True:
        # m i.i.d. uniform points of [0, d), drawn already sorted: the partial sums of m + 1 exponential gaps,
        # divided by their total, are the order statistics of m uniforms (no sort of m numbers needed)
        gaps = torch.empty(m + 1, dtype=torch.float64, device=gen.device).exponential_(generator=gen)
        points = gaps.cumsum_(0)
        idx = points[:m].mul_(d / float(points[m])).floor_().to(torch.int64).clamp_(max=d - 1)
        keep = torch.ones(m, dtype=torch.bool, device=gen.device)
        torch.ne(idx[1:], idx[:-1], out=keep[1:])              # distinct values: sorted, so drop repeats
        distinct = idx[keep]
        if distinct.numel() >= k:
            drop = sample_without_replacement(distinct.numel(), distinct.numel() - k, gen)
            keep = torch.ones(distinct.numel(), dtype=torch.bool, device=gen.device)
            keep[drop] = False                                  # a uniformly random subset of the excess
            return distinct[keep]
        m = int(m * 1.5) + 16


@compressors.register("randomk")
class RandomK(Compressor):
    """Random-k with indices shared by seed: only k values travel, summed by all-reduce; scale=d/k if unbiased."""

    linear = True
    randomness = "shared"
    aggregation = "allreduce"
    fixed_size = True

    def __init__(self, ratio: float = 0.5, scale: bool = True, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.scale = bool(scale)
        self.unbiased = self.scale
        self.seed = seed

    def compress(self, tensor, key=None, step=0, agreed=None):
        shape, dtype, d, idx = self.context(tensor.shape, tensor.dtype, key, step)
        idx = idx.to(tensor.device)
        return Payload([tensor.reshape(-1).index_select(0, idx)], ctx=(shape, dtype, d, idx))

    def context(self, shape, dtype, key=None, step=0):
        d = torch.Size(shape).numel()   # the indices every rank draws from the shared seed
        return (torch.Size(shape), dtype, d, sample_without_replacement(d, num_kept(self.ratio, d),
                                                                       generator(self.seed, key, step)))

    def decompress(self, payload):
        shape, dtype, d, idx = payload.ctx
        vals = payload.tensors[0].reshape(-1).to(dtype)
        if self.scale and idx.numel():
            vals = vals * (d / idx.numel())
        # (a receiver's `context` draws the indices on the host: they follow the payload to its device)
        return torch.zeros(d, dtype=dtype, device=vals.device).index_copy_(0, idx.to(vals.device), vals).view(shape)

    def aggregate(self, payloads):
        total = payloads[0].tensors[0].reshape(-1).clone()
        for p in payloads[1:]:
            total += p.tensors[0].reshape(-1)
        return self.decompress(Payload([total], payloads[0].ctx))

    def nominal_bits(self, numel):
        return 32.0 * num_kept(self.ratio, numel) / max(1, numel)
