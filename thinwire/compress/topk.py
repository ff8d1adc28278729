"""`topk`: the k largest-magnitude coordinates (Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory", arXiv
1809.07599, Top-k): C(g) = g ⊙ 1[|g_i| ≥ |g|_(k)].

Biased (a contraction: ‖g − C(g)‖² ≤ (1 − k/d)‖g‖²), so pair it with `--memory residual`.
The selection is an exact top-k found by a sampled threshold search (see `_sparse.topk_indices`), not a full
sort: a sample sets a threshold a little below the k-th magnitude, one pass keeps the candidates, and torch.topk
runs on those few (falling back to a full torch.topk in the rare case the sample overshot).
"""
from __future__ import annotations

import torch

from . import compressors
from ._sparse import SparseCompressor, generator, index_dtype, num_kept, pack_codes, topk_indices, unpack_codes
from .base import Payload


@compressors.register("topk")
class TopK(SparseCompressor):
    """Top-k sparsification: the k = ratio·d largest |g_i| as (values, indices); all-gather + index_add_."""

    fixed_size = True
    x_memcpy = 12.0

    def select(self, flat, key, step):
        return topk_indices(flat, num_kept(self.ratio, flat.numel()), generator(self.seed, key, step))


class QuantizedTopK(TopK):
    """Top-k whose kept values travel as `bits`-bit codes under one fp32 scale: payload (indices, codes, scale),
    built in fp32 (stc, qsparse). A subclass says how values become codes (`quantize`) and back (`dequantize`)."""

    index_slot = 0            # indices first
    accumulate_dtype = torch.float32
    bits = 1

    def quantize(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes in [0, 2^bits), the one-element fp32 scale) of the kept values `vals` (fp32)."""
        raise NotImplementedError(f"{type(self).__name__} must define quantize")

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp32 values of `codes` (int64) under `scale` (a 0-d tensor)."""
        raise NotImplementedError(f"{type(self).__name__} must define dequantize")

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        d = flat.numel()
        idx = self.select(flat, key, step)
        codes, scale = self.quantize(flat[idx].float())
        return Payload([idx.to(index_dtype(d)), pack_codes(codes, self.bits), scale],
                       ctx=(tensor.shape, tensor.dtype, d))

    def densify(self, payload):
        return None               # (indices, codes, scale): no dense form

    def _contribution(self, tensors):
        idx, codes, scale = tensors
        idx = idx.reshape(-1).long()
        return idx, self.dequantize(unpack_codes(codes, idx.numel(), self.bits), scale.reshape(-1)[0])

    def nominal_bits(self, numel):
        return self.sparse_bits(num_kept(self.ratio, numel), numel, value_bits=self.bits) + 32.0 / max(1, numel)
