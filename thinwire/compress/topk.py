"""`topk`: the k largest-magnitude coordinates (seed 002 §4.3.1; Stich et al.): C(g) = g ⊙ 1[|g_i| ≥ |g|_(k)].

Biased (a contraction: ‖g − C(g)‖² ≤ (1 − k/d)‖g‖²), so pair it with `--memory residual`.
The selection is an exact top-k found by a sampled threshold search (see `_sparse.topk_indices`), not a full
sort: a sample sets a threshold a little below the k-th magnitude, one pass keeps the candidates, and torch.topk
runs on those few (falling back to a full torch.topk in the rare case the sample overshot).
"""
from __future__ import annotations

from . import compressors
from ._sparse import SparseCompressor, generator, num_kept, topk_indices


@compressors.register("topk")
class TopK(SparseCompressor):
    """Top-k sparsification: the k = ratio·d largest |g_i| as (values, indices); all-gather + index_add_."""

    fixed_size = True

    def select(self, flat, key, step):
        return topk_indices(flat, num_kept(self.ratio, flat.numel()), generator(self.seed, key, step))
