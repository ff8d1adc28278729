"""`natural`: natural compression (seed 002 §5.2.2, NC [84], in the corrected form of the catalog, erratum 3):
|t| in [a, 2a) with a = 2^floor(log2|t|) becomes a with probability (2a - |t|) / a, else 2a; 0 stays 0. Unbiased,
E||C(x) - x||^2 <= ||x||^2 / 8. Bit-exact on the fp32 encoding: adding a uniform 23-bit integer r to the bits of
|t| carries into the exponent exactly when mantissa + r >= 2^23, i.e. with probability mantissa / 2^23, and the
mantissa is then dropped. Sent: the 8 exponent bits (a byte) and the sign (1 bit, packed): 9 bits per element.
Codes of different ranks are not additive: gathered."""
from __future__ import annotations

import torch

from . import compressors
from .base import Compressor, Payload, ScratchLock
from .bitpack import decode, pack
from .finite import check_tensor
from .rounding import Uniforms


@compressors.register("natural")
class Natural(Compressor):
    unbiased = True
    linear = False
    randomness = "local"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape

    def __init__(self, seed: int = 0):
        self.uniforms = Uniforms(seed)
        self._mask = torch.empty(0, dtype=torch.bool, device="cpu")     # regrown on the gradient's device
        self._wide = torch.empty(0, dtype=torch.int32, device="cpu")
        self._wide_lock = ScratchLock()      # decompress may run on several threads at once (see Compressor)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        check_tensor(flat, self.name, key)
        n = flat.numel()
        bits = flat.view(torch.int32)
        work = self.uniforms.mantissas(n, flat.device)
        work.add_(bits)                        # the sign bit stays out of the way (shifted out below)
        work.bitwise_right_shift_(23)          # sign | exponent (+ carry); the low byte is the exponent
        exponent = work.to(torch.uint8)        # int32 -> uint8 keeps the low byte
        exponent.clamp_(max=254)               # |t| >= 2^127 may not round up to 2^128 = inf (biased there only)
        if self._mask.numel() < n or self._mask.device != flat.device:                   # a reused mask: a fresh n-byte tensor page-faults
            self._mask = torch.empty(n, dtype=torch.bool, device=flat.device)
        sign = pack(torch.lt(flat, 0, out=self._mask[:n]).view(torch.uint8), 1, inplace=True)
        return Payload([exponent, sign], ctx=(tensor.shape, tensor.dtype, n))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        exponent, sign = payload.tensors
        word = decode(sign, 1, n, [0, -(1 << 31)], torch.int32)       # sign << 31, one lookup per byte
        with self._wide_lock:
            if self._wide.numel() < n or self._wide.device != sign.device:               # the exponents widened into a reused buffer (a mixed
                self._wide = torch.empty(n, dtype=torch.int32, device=sign.device)     # uint8/int32 add is 2x slower than cast + add)
            wide = self._wide[:n]
            wide.copy_(exponent)
            word.add_(wide, alpha=1 << 23)                             # + exponent << 23 (disjoint bits: an or)
        return word.view(torch.float32).to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 9.0

    def state_dict(self):
        return {"uniforms": self.uniforms.state_dict()}

    def load_state_dict(self, state):
        self.uniforms.load_state_dict(state["uniforms"])
