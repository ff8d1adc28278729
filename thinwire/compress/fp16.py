"""`fp16`: cast to half precision (Micikevicius et al. 2018, "Mixed Precision Training", arXiv 1710.03740, §3.2
loss scaling: C(g) = fp16(s g), D(q) = fp32(q) / s)."""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Compressor, Payload
from .finite import check_tensor


class Cast(Compressor):
    """A cast to a 16-bit float type, summable by all-reduce in that type."""

    unbiased = False          # round-to-nearest: a tiny deterministic bias
    fixed_size = True         # the payload size depends only on the shape
    wire_dtype = torch.float16

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise UserError(f"{self.name}: scale must be > 0 (a loss scale, 1 for none), got {scale}")
        self.scale = float(scale)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        if self.scale != 1.0:
            flat = flat * self.scale
        half = flat.to(self.wire_dtype)
        check_tensor(half, self.name, key)        # also catches values that overflowed the 16-bit range
        return Payload([half], ctx=(tensor.shape, tensor.dtype, 1.0))

    def context(self, shape, dtype, key=None, step=0):
        return (torch.Size(shape), dtype, 1.0)      # 1.0: not pre-scaled by `sum_payload`

    def decompress(self, payload):
        shape, dtype, mult = payload.ctx
        out = payload.tensors[0].to(torch.float32)
        factor = mult / self.scale
        if factor != 1.0:
            out.mul_(factor)
        return out.to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 16.0


@compressors.register("fp16")
class FP16(Cast):
    """fp16 cast. For all-reduce, `sum_payload` divides by the world size first (as PyTorch's
    `fp16_compress_hook` does) so that the fp16 sum of the ranks cannot overflow."""
    x_memcpy = 2.0

    def sum_payload(self, payload, world_size):
        shape, dtype, _ = payload.ctx
        return Payload([payload.tensors[0] / world_size], ctx=(shape, dtype, float(world_size)))
