"""`stc`: Sparse Ternary Compression (Sattler et al.): top-k, then every kept value becomes μ·sign(g_i) with
one mean μ = mean_{i∈top-k} |g_i| for the tensor (seed 002 §6, the ternary form of SBC's binarisation).

Payload: indices, 1 bit per kept sign, one fp32 μ. Biased: use `--memory residual`.
"""
from __future__ import annotations

import torch

from . import compressors
from ._sparse import index_dtype, num_kept, pack_codes, unpack_codes
from .base import Payload
from .topk import TopK


@compressors.register("stc")
class STC(TopK):
    """Sparse ternary compression: top-k positions, values μ·sign with one shared mean magnitude μ."""

    index_slot = 0            # indices first

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        d = flat.numel()
        idx = self.select(flat, key, step)
        vals = flat[idx].float()
        mu = vals.abs().mean().reshape(1)
        signs = pack_codes((vals >= 0).to(torch.int64), 1)
        return Payload([idx.to(index_dtype(d)), signs, mu], ctx=(tensor.shape, tensor.dtype, d))

    accumulate_dtype = torch.float32   # contributions are built in fp32

    def _contribution(self, tensors):
        idx, signs, mu = tensors
        idx = idx.reshape(-1).long()
        pos = unpack_codes(signs.reshape(-1), idx.numel(), 1)
        return idx, (pos.float() * 2 - 1) * mu.reshape(-1)[0]

    def nominal_bits(self, numel):
        return self.sparse_bits(num_kept(self.ratio, numel), numel, value_bits=1.0) + 32.0 / max(1, numel)
