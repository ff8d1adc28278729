"""`natural`: natural compression (Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019, "Natural
Compression for Distributed Deep Learning", arXiv 1905.10988; the compression surveys print it garbled):
|t| in [a, 2a) with a = 2^floor(log2|t|) becomes a with probability (2a - |t|) / a, else 2a; 0 stays 0. Unbiased,
E||C(x) - x||^2 <= ||x||^2 / 8. Bit-exact on the fp32 encoding: adding a uniform 23-bit integer r to the bits of
|t| carries into the exponent exactly when mantissa + r >= 2^23, i.e. with probability mantissa / 2^23, and the
mantissa is then dropped. Sent: the 8 exponent bits (a byte) and the sign (1 bit, packed): 9 bits per element.
Codes of different ranks are not additive: gathered."""
from __future__ import annotations

import math

import torch

from . import compressors
from .base import Payload
from .bitpack import pack_kernel, value_table
from .finite import check_tensor
from .kernels import blockwise, scratch
from .rounding import Stochastic


def encode(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """(exponent bytes, packed sign bits) of a block of whole table rows (`a` their row factors, `b` the
    columns'): a uniform 23-bit integer added to |t|'s bits carries into the exponent with probability
    mantissa / 2^23 (the module docstring); the kernel of `Natural.compress`."""
    m = x.numel()
    work = torch.bitwise_xor(a.view(-1, 1), b, out=scratch((a.numel(), b.shape[1]), torch.int32, x.device))
    work = work.view(-1)[:m]
    work.add_(x.view(torch.int32))          # the sign bit stays out of the way (shifted out below)
    work.bitwise_right_shift_(23)           # sign | exponent (+ carry); the low byte is the exponent
    exponent = scratch(m, torch.uint8, x.device)
    exponent.copy_(work)                    # int32 -> uint8 keeps the low byte
    exponent.clamp_(max=254)                # |t| >= 2^127 may not round up to 2^128 = inf (biased there only)
    neg = torch.lt(x, 0, out=scratch(m, torch.int8, x.device))
    return exponent, pack_kernel(neg.view(torch.uint8), 1)


def decode_kernel(exponent: torch.Tensor, sign: torch.Tensor, table: torch.Tensor):
    """fp32 bits (sign << 31 | exponent << 23) of a block: one table row per sign byte (its eight sign words),
    plus the exponents shifted up (disjoint bits: an add is an or); the kernel of `Natural.decompress`."""
    word = table.index_select(0, sign.to(torch.int32)).view(-1)
    m = exponent.numel()
    wide = scratch(m, torch.int32, exponent.device)
    wide.copy_(exponent)                    # widened first (a mixed uint8/int32 add is 2x slower than cast + add)
    return (word[:m].add_(wide, alpha=1 << 23),)


@compressors.register("natural")
class Natural(Stochastic):
    linear = False
    randomness = "local"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape
    x_memcpy = 6.0

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1).float()
        check_tensor(flat, self.name, key)
        n = flat.numel()
        a, b = self.uniforms.factors(n, 23, flat.device)
        exponent, sign = blockwise(encode, n, [(flat, (1, 1)), (a.view(-1), (1, b.shape[1]))], [(1, 1), (1, 8)], b,
                                   align=math.lcm(8, b.shape[1]))
        return Payload([exponent, sign], ctx=(tensor.shape, tensor.dtype, n))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        exponent, sign = payload.tensors
        table = value_table(1, [0, -(1 << 31)], sign.device, torch.int32)        # a byte's eight signs << 31
        word, = blockwise(decode_kernel, n, [(exponent.reshape(-1), (1, 1)), (sign.reshape(-1), (1, 8))], [(1, 1)],
                          table)
        return word.view(torch.float32).to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 9.0
