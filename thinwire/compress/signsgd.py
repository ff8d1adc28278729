"""`signsgd`: one bit per element, the sign (seed 002 §5.1, SignSGD [56,57]: C(g) = 1[g >= 0], D(b) = 2b - 1),
combined across ranks by majority vote. Zero counts as positive (ties go to +1, as in GRACE)."""
from __future__ import annotations

import torch

from . import compressors
from .base import Compressor, Payload
from .bitpack import decode, pack
from .finite import check_tensor


def sign_bits(flat: torch.Tensor) -> torch.Tensor:
    """The packed bits 1[x >= 0], one per element."""
    return pack(torch.ge(flat, 0).view(torch.uint8), 1, inplace=True)


def signs(bits: torch.Tensor, numel: int, scale=1.0) -> torch.Tensor:
    """fp32 tensor of scale * (2b - 1) from packed bits (a table lookup per byte); `scale` a number or a
    one-element tensor (kept on the device)."""
    return decode(bits, 1, numel, (-1.0, 1.0), scale=scale)


@compressors.register("signsgd")
class SignSGD(Compressor):
    """Packed sign bits; the exchange takes the element-wise majority vote; `decompress` gives +-1."""

    unbiased = False
    linear = False
    randomness = "none"
    aggregation = "majority"
    fixed_size = True         # the payload size depends only on the shape

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        check_tensor(flat, self.name, key)
        return Payload([sign_bits(flat)], ctx=(tensor.shape, tensor.dtype, flat.numel()))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        return signs(payload.tensors[0], n).to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 1.0
