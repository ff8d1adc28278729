"""`threshold2bit`: MXNet's 2-bit threshold quantizer, the compressor of BIT-SGD and CD-SGD (Yu, Dong, Xu, Ouyang,
Liao 2021, "CD-SGD: Distributed Stochastic Gradient Descent with Compression and Delay Compensation", arXiv
2106.10796, §2.3, §3.4.1).

Each element becomes +α where it is ≥ α, −α where it is ≤ −α, and 0 otherwise; with the `residual` memory the
dropped part x − Q(x) waits for the next step, so small gradients accumulate until they cross ±α. The codes
(0 → 0, 1 → +α, 2 → −α) are packed four per byte: 2 bits per element, no scale (α is a parameter).

Default α = 0.15625 = (0.5/32)/(1 − 0.9). MXNet's default and Yu et al.'s LeNet setting (§4.2, plain SGD) is
α = 0.5 on the *sum* of gradients over a batch of 32 per GPU (the 1/batch rescale is the optimizer's); thinwire's
losses are batch means, hence 0.5/32, and under heavy-ball momentum μ the quantity that crosses the threshold
carries momentum (u ≈ g/(1 − μ)), hence the division by 1 − μ at thinwire's usual μ = 0.9. Measured on
digits-mlp, 4 workers, lr 0.2, μ = 0.9 (docs/matrix.md): at 0.015625 bsp, bitsgd, dts, delayed and backup ended
at 0.10–0.83, at 0.15 every algorithm reaches the target. An element moves by at most α per step, so α far below
the largest gradient entries throttles them, and far above it leaves most entries waiting
(docs/benchmarks/cdsgd-accuracy.md).

Biased, not linear: two ranks' packed codes cannot be added byte-wise (1 + 2 = 3 is no code), so the payloads
are all-gathered and each rank sums the decoded contributions (`aggregate`).
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Compressor, Payload
from .bitpack import decode, pack_kernel, unpack
from .kernels import blockwise, scratch

def encode(x: torch.Tensor, a: float):
    """MXNet's 2-bit codes 1[x >= a] | 1[x <= −a] << 1 of a block, packed four per byte: the kernel of
    `Threshold2Bit.compress`."""
    up = torch.ge(x, a, out=scratch(x.shape, torch.int8, x.device))
    up.add_(torch.le(x, -a, out=scratch(x.shape, torch.int8, x.device)), alpha=2)
    return (pack_kernel(up.view(torch.uint8), 2),)


@compressors.register("threshold2bit")
class Threshold2Bit(Compressor):
    """2-bit threshold quantizer (MXNet, Yu et al. 2021): ±threshold where |x| ≥ threshold, else 0; 2 bits per
    element."""

    unbiased = False
    linear = False
    aggregation = "allgather"
    fixed_size = True
    x_memcpy = 6.0

    def __init__(self, threshold: float = 0.15625):   # (0.5 / batch 32) / (1 − μ 0.9) (the module docstring)
        if not (isinstance(threshold, (int, float)) and threshold > 0):
            raise UserError(f"threshold2bit: threshold must be a number > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        packed, = blockwise(encode, flat.numel(), [(flat, (1, 1))], [(2, 8)], self.threshold)   # Yu et al. §3.4.1
        return Payload([packed], ctx=(tensor.shape, tensor.dtype, tensor.numel()))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        a = self.threshold                     # code 1 -> +a, 2 -> -a: one table lookup per byte
        table_dtype = torch.float64 if dtype == torch.float64 else torch.float32   # (float64 stays exact)
        return decode(payload.tensors[0], 2, n, (0.0, a, -a, 0.0), dtype=table_dtype).to(dtype).view(shape)

    def aggregate(self, payloads):
        """Σ_ranks Q(x_r): count the signs in int32, multiply by α once."""
        shape, dtype, n = payloads[0].ctx
        count = torch.zeros(n, dtype=torch.int32, device=payloads[0].tensors[0].device)
        for p in payloads:
            codes = unpack(p.tensors[0], 2, p.ctx[2])
            count += (codes & 1).to(torch.int8) - (codes >> 1).to(torch.int8)     # +1 / −1 / 0 per element
        return (count.to(dtype) * self.threshold).view(shape)

    def nominal_bits(self, numel):
        return 2.0
