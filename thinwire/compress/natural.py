"""`natural`: natural compression (Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019, "Natural
Compression for Distributed Deep Learning", arXiv 1905.10988; the compression surveys print it garbled):
|t| in [a, 2a) with a = 2^floor(log2|t|) becomes a with probability (2a - |t|) / a, else 2a; 0 stays 0. Unbiased,
E||C(x) - x||^2 <= ||x||^2 / 8. Bit-exact on the fp32 encoding: adding a uniform 23-bit integer r to the bits of
|t| carries into the exponent exactly when mantissa + r >= 2^23, i.e. with probability mantissa / 2^23, and the
mantissa is then dropped. Sent: the 8 exponent bits (a byte) and the sign (1 bit, packed): 9 bits per element.
Codes of different ranks are not additive: gathered."""
from __future__ import annotations

import torch

from . import compressors
from .base import Payload, ScratchLock, reused
from .bitpack import decode, pack
from .finite import check_tensor
from .rounding import Stochastic


@compressors.register("natural")
class Natural(Stochastic):
    unbiased = True
    linear = False
    randomness = "local"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self._mask = torch.empty(0, dtype=torch.bool, device="cpu")     # regrown on the gradient's device
        self._wide = torch.empty(0, dtype=torch.int32, device="cpu")
        self._wide_lock = ScratchLock()      # decompress may run on several threads at once (see Compressor)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1).float()
        check_tensor(flat, self.name, key)
        n = flat.numel()
        bits = flat.view(torch.int32)
        work = self.uniforms.mantissas(n, flat.device)
        work.add_(bits)                        # the sign bit stays out of the way (shifted out below)
        work.bitwise_right_shift_(23)          # sign | exponent (+ carry); the low byte is the exponent
        exponent = work.to(torch.uint8)        # int32 -> uint8 keeps the low byte
        exponent.clamp_(max=254)               # |t| >= 2^127 may not round up to 2^128 = inf (biased there only)
        self._mask, mask = reused(self._mask, n, flat.device)
        sign = pack(torch.lt(flat, 0, out=mask).view(torch.uint8), 1, inplace=True)
        return Payload([exponent, sign], ctx=(tensor.shape, tensor.dtype, n))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        exponent, sign = payload.tensors
        word = decode(sign, 1, n, [0, -(1 << 31)], torch.int32)       # sign << 31, one lookup per byte
        with self._wide_lock:
            self._wide, wide = reused(self._wide, n, sign.device)
            wide.copy_(exponent)        # widened first (a mixed uint8/int32 add is 2x slower than cast + add)
            word.add_(wide, alpha=1 << 23)                             # + exponent << 23 (disjoint bits: an or)
        return word.view(torch.float32).to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 9.0
