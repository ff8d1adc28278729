"""`fp8`: 8-bit floating-point quantization of (outer) gradients, as Streaming DiLoCo communicates them
(Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch",
arXiv 2501.18512: the outer gradients travel in low precision and are accumulated in fp32).

Per chunk of `chunk` elements (0: one chunk for the whole tensor) with max-abs a_c, the scale s_c = a_c / F maps
the chunk onto the format's finite range [-F, F] (F = 448 for e4m3, 57344 for e5m2), and
    q_i = fp8(x_i / s_c)           (torch's float8_e4m3fn / float8_e5m2 cast: round to nearest even)
    D(q)_i = fp32(q_i) · s_c
Each element travels as its 8 raw bits (the fp8 tensor viewed as uint8, so every wire and the parameter server
carry it) plus one fp32 scale per chunk. Payloads of different ranks cannot be summed in fp8: they are all-gathered
and each decoded and summed in fp32 ("allgather"). Relative error ≤ 2^-4 (e4m3, 3 mantissa bits) or 2^-3 (e5m2)
above the subnormal range; biased (deterministic rounding), so `--memory residual` keeps what rounding drops.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._chunks import Chunked, check_chunk
from .base import Payload
from .finite import check_scale
from .qsgd import bucket_norms, scale_buckets

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@compressors.register("fp8")
class FP8(Chunked):
    """FP8 (e4m3 or e5m2, torch's float8 dtypes) with a per-chunk fp32 scale; all-gathered, summed in fp32."""

    def __init__(self, format: str = "e4m3", chunk: int = 0):
        if format not in FORMATS:
            raise UserError(f"fp8: format must be one of {', '.join(FORMATS)}; got {format!r}")
        self.format, self.dtype8 = format, FORMATS[format]
        self.fmax = float(torch.finfo(self.dtype8).max)
        self.chunk = check_chunk("fp8", chunk, allow_zero=True)

    def _bucket(self, n: int) -> int:
        return self.chunk or max(n, 1)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        bucket = self._bucket(flat.numel())
        amax = bucket_norms(flat, bucket, math.inf)
        check_scale(amax, self.name, key, flat)
        scales = amax / self.fmax
        inv = torch.where(scales > 0, 1.0 / scales, 0.0)     # an all-zero chunk codes as zeros
        y = scale_buckets(flat.to(torch.float32, copy=True), inv, bucket).clamp_(-self.fmax, self.fmax)
        q = y.to(self.dtype8).view(torch.uint8)
        return Payload([q, scales], ctx=self.context(tensor.shape, tensor.dtype))

    def _decode32(self, payload):
        q, scales = payload.tensors
        vals = q.reshape(-1).view(self.dtype8).to(torch.float32)
        return scale_buckets(vals, scales.reshape(-1), self._bucket(payload.ctx["numel"]))

    def nominal_bits(self, numel):
        return 8.0 + 32.0 * math.ceil(numel / self._bucket(numel)) / max(numel, 1)
