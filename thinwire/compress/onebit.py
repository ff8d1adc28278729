"""`onebit`: 1-bit SGD (Seide, Fu, Droppo, Li, Yu 2014, "1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014): one bit per element, 1[g >= 0],
decoded to the mean of the non-negative values for 1 and the mean of the negative values for 0 (two fp32 per tensor,
as in GRACE; the original takes them per column). Meant to run with the `residual` memory. Ranks' means differ:
gathered."""
from __future__ import annotations

import torch

from . import compressors
from .base import Compressor, Payload, cast_back
from .finite import check_scale
from .bitpack import decode, pack_signs


@compressors.register("onebit")
class OneBit(Compressor):
    unbiased = False
    linear = False
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape
    needs_momentum_first = True
    x_memcpy = 6.0

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        n = flat.numel()
        # one pass: the bits 1[g >= 0], L = sum |g|, S = sum g and how many bits are set;
        # sum over g >= 0 = (S + L) / 2, sum over g < 0 = (S - L) / 2; all on the tensor's device
        bits, l1, total, npos = pack_signs(flat, stats=2)
        check_scale(total + l1, self.name, key, flat)
        sums = torch.stack([total - l1, total + l1]) / 2.0                       # (negative side, positive side)
        counts = torch.stack([n - npos, npos]).double()
        means = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).to(torch.float32)
        return Payload([bits, means], ctx=(tensor.shape, tensor.dtype, n))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        return cast_back(decode(payload.tensors[0], 1, n, payload.tensors[1]), dtype).view(shape)   # (mean-, mean+)[bit]

    def nominal_bits(self, numel):
        return 1.0 + 64.0 / max(numel, 1)
