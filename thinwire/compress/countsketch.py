"""`countsketch`: a Count Sketch of the tensor (seed 002 §4.3.3; catalog 3.5 [O]), linear so all-reduce sums it.

r rows × c columns; row j has a bucket hash h_j: [d] → [c] and a sign hash s_j: [d] → {±1}, drawn from a seed
shared by every rank (seed, key). Insert: S[j, h_j(i)] += s_j(i) g_i; query: ĝ_i = median_j s_j(i) S[j, h_j(i)].
Because S(g₁) + S(g₂) = S(g₁ + g₂), the all-reduced sketch is the sketch of the sum and its query estimates the
sum. Wire size r·c floats (c = ⌈ratio·d / r⌉), independent of the number of ranks. With one row the estimate
is unbiased; with several the median is not (but is far less noisy). Pair with `--memory residual`.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._sparse import check_ratio, generator
from .base import Compressor, Payload


def _median_rows(est: torch.Tensor) -> torch.Tensor:
    """Element-wise median over the rows; closed forms for 1–3 rows (a sort over rows is far slower)."""
    if est.shape[0] == 1:
        return est[0]
    if est.shape[0] == 2:
        return (est[0] + est[1]) / 2
    if est.shape[0] == 3:
        a, b, c = est
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    return est.median(dim=0).values


@compressors.register("countsketch")
class CountSketch(Compressor):
    """Count Sketch (rows × ratio·d/rows table, shared hashes): linear, summed by all-reduce; median query."""

    linear = True
    randomness = "shared"
    aggregation = "allreduce"
    fixed_size = True

    def __init__(self, ratio: float = 0.1, rows: int = 3, seed: int = 0):
        self.ratio = check_ratio(ratio)
        if not isinstance(rows, int) or rows < 1:
            raise UserError(f"rows must be an integer >= 1, got {rows}")
        self.rows, self.seed = rows, seed
        self.unbiased = rows == 1
        self._hashes: dict = {}

    def _hash(self, key, d: int):
        """Flat table offsets j·c + h_j(i) (rows × d) and signs s_j(i), cached per (key, d)."""
        got = self._hashes.get((key, d))
        if got is None:
            c = max(1, math.ceil(self.ratio * d / self.rows))
            g = generator(self.seed, "countsketch", key, d)
            buckets = torch.randint(c, (self.rows, d), generator=g)
            offsets = buckets + torch.arange(self.rows).unsqueeze(1) * c
            signs = torch.randint(2, (self.rows, d), generator=g).float().mul_(2).sub_(1)
            got = (offsets, signs, c)
            self._hashes[(key, d)] = got
        return got

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1).float()
        d = flat.numel()
        offsets, signs, c = self._hash(key, d)
        table = torch.zeros(self.rows * c).index_add_(0, offsets.reshape(-1), (signs * flat).reshape(-1))
        return Payload([table], ctx=(tensor.shape, tensor.dtype, d, key))

    def decompress(self, payload):
        shape, dtype, d, key = payload.ctx
        offsets, signs, _ = self._hash(key, d)
        est = signs * payload.tensors[0].reshape(-1)[offsets]
        return _median_rows(est).to(dtype).view(shape)

    def aggregate(self, payloads):
        total = payloads[0].tensors[0].reshape(-1).clone()
        for p in payloads[1:]:
            total += p.tensors[0].reshape(-1)
        return self.decompress(Payload([total], payloads[0].ctx))

    def nominal_bits(self, numel):
        return 32.0 * self.rows * max(1, math.ceil(self.ratio * numel / self.rows)) / max(1, numel)
