"""`fp4`: 4-bit floating-point quantization of (outer) gradients, as Streaming DiLoCo communicates them
(Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch",
arXiv 2501.18512: outer gradients sent as 4-bit floats, accumulated in fp32; the paper's 4-bit format is E3M0,
1 sign bit, 3 exponent bits and no mantissa bit).

A 4-bit code is a sign bit and a 3-bit magnitude code m ∈ 0..7; per chunk of `chunk` elements with max-abs a_c,
    D(code)_i = ±a_c · v_m,
with the magnitudes v normalized so the chunk's max-abs is the format's largest value:
    e3m0: v = (0, 2^-6, 2^-5, 2^-4, 2^-3, 2^-2, 2^-1, 1)   (0 and seven powers of two: no mantissa)
    e2m1: v = (0, 0.5, 1, 1.5, 2, 3, 4, 6) / 6             (the OCP MX FP4 value set)
and m the nearest magnitude to |x_i| / a_c (round to nearest; a tie goes to the smaller one). Codes are bit-packed
two per byte (`bitpack`), plus one fp32 scale a_c per chunk: 4 + 32/chunk bits per element. The payloads cannot be
summed in 4 bits: they are all-gathered, decoded and summed in fp32 ("allgather"). Error per element: e3m0 at most
|x|/3 above a_c·2^-6 and a_c·2^-7 below; e2m1 at most a_c/24 below a_c/6 and |x|/5 above. Biased (deterministic):
pair with `--memory residual`.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._chunks import Chunked, check_chunk
from .base import Payload, constant
from .bitpack import decode, pack
from .finite import check_scale
from .qsgd import bucket_norms, scale_buckets

MAGNITUDES = {"e3m0": [0.0] + [2.0 ** -e for e in range(6, -1, -1)],
              "e2m1": [v / 6 for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)]}
# G with every midpoint between consecutive magnitudes a multiple of 1/G: ceil(G |x| / a_c) then names the
# magnitude code by one table lookup (faster than a search over the 7 midpoints)
GRID = {"e3m0": 128, "e2m1": 24}


@compressors.register("fp4")
class FP4(Chunked):
    """FP4 (e3m0 as in Streaming DiLoCo, or e2m1) with a per-chunk fp32 scale, packed 2 per byte; summed in fp32."""

    def __init__(self, format: str = "e3m0", chunk: int = 128):
        if format not in MAGNITUDES:
            raise UserError(f"fp4: format must be one of {', '.join(MAGNITUDES)}; got {format!r}")
        self.format = format
        self.chunk = check_chunk("fp4", chunk)
        mags = MAGNITUDES[format]
        self.grid = GRID[format]
        mids = [round((a + b) / 2 * self.grid) for a, b in zip(mags[1:], mags[:-1])]   # boundaries, units of 1/G
        # G|x|/a_c in (j - 1, j] lies beyond the boundaries b < j: magnitude code = #{b < j} (a tie goes down)
        self._codes = tuple(sum(b < j for b in mids) for j in range(self.grid + 1))
        self._values = tuple(mags) + tuple(-m for m in mags)    # code = sign << 3 | magnitude code

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        amax = bucket_norms(flat, self.chunk, math.inf)
        check_scale(amax, self.name, key, flat)
        inv = torch.where(amax > 0, self.grid / amax, 0.0)
        a = scale_buckets(flat.to(torch.float32, copy=True).abs_(), inv, self.chunk)    # G |x| / a_c in [0, G]
        j = a.ceil_().clamp_(max=self.grid).to(torch.int32)
        table = constant(("fp4-codes", self._codes), j.device,
                         lambda: torch.tensor(self._codes, dtype=torch.uint8, device="cpu"))   # once per device
        codes = table.index_select(0, j)                                          # the nearest magnitude (ties go down)
        codes.bitwise_or_(flat.lt(0).to(torch.uint8).bitwise_left_shift_(3))
        return Payload([pack(codes, 4, inplace=True), amax], ctx=self.context(tensor.shape, tensor.dtype))

    def _decode32(self, payload):
        packed, amax = payload.tensors
        vals = decode(packed, 4, payload.ctx["numel"], self._values)    # one table lookup per byte
        return scale_buckets(vals, amax.reshape(-1), self.chunk)

    def nominal_bits(self, numel):
        return 4.0 + 32.0 * math.ceil(numel / self.chunk) / max(numel, 1)
