"""`threshold`: every coordinate with |g_i| ≥ v (Threshold-v, Dutta et al.; seed 002 §4.3.2).

O(d), no sorting, but the number sent varies with the gradient's scale (the payload size is exchanged before
the gather). Biased: use `--memory residual`.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from ._sparse import SparseCompressor, beyond, check_collective


@compressors.register("threshold")
class Threshold(SparseCompressor):
    """Threshold-v sparsification: send g_i where |g_i| ≥ v, as (values, indices)."""

    def __init__(self, threshold: float = 0.001, sparse_collective: str = "allgather"):
        self.sparse_collective = check_collective(sparse_collective)   # exchange/sparse.py
        if not threshold >= 0:
            raise UserError(f"threshold must be >= 0, got {threshold}")
        self.threshold = float(threshold)

    def select(self, flat, key, step):
        return torch.nonzero(beyond(flat, self.threshold) if self.threshold > 0 else flat == flat).squeeze(1)

    def nominal_bits(self, numel):
        return 48.0 if numel <= 1 << 15 else 64.0  # per SENT element; the count depends on the data
