"""`fp8`: 8-bit floating-point quantization of (outer) gradients, as Streaming DiLoCo communicates them
(Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch",
arXiv 2501.18512: the outer gradients travel in low precision and are accumulated in fp32).

Per chunk of `chunk` elements (0: the whole tensor) with max-abs a_c, s_c = a_c / F maps the chunk onto the
format's finite range [-F, F] (F = 448 for e4m3, 57344 for e5m2): q_i = fp8(x_i / s_c) (torch's float8 cast,
round to nearest even), D(q)_i = fp32(q_i) · s_c. Each element travels as its 8 raw bits plus one fp32 scale per
chunk; payloads are all-gathered and summed in fp32. Relative error ≤ 2^-4 (e4m3) or 2^-3 (e5m2) above the
subnormal range; biased (deterministic rounding): `--memory residual` keeps what rounding drops.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._chunks import Chunked, check_chunk
from .base import Payload, constant
from .finite import check_scale
from .fp4 import chunk_amax
from .int8 import maxabs
from .kernels import blockwise, scratch
from .qsgd import scale_buckets

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def encode(x: torch.Tensor, inv: torch.Tensor | None, fmax: float, chunk: int, dtype8: torch.dtype):
    """(the fp8 codes of x / s as bytes, the chunks' scales s = max-abs / F, or None): the kernel of
    `FP8.compress`; `inv` = 1/s of the whole tensor, or None to find each chunk's (chunk > 0)."""
    f = x.to(torch.float32)
    y = scratch(f.shape, torch.float32, f.device)
    scales = None
    if inv is None:
        scales = chunk_amax(torch.abs(f, out=y), chunk) / fmax
        y = scale_buckets(y.copy_(f), torch.where(scales > 0, 1.0 / scales, 0.0), chunk)
    else:
        torch.mul(f, inv.reshape(-1)[:1].sum(), out=y)       # (the one 1/s; an empty tensor has none)
    y.clamp_(-fmax, fmax)
    q = y.to(dtype8).view(torch.uint8)
    return (q,) if scales is None else (q, scales)


def decode_kernel(q: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor]:
    """fp32 values of fp8 codes (bytes) by `table` lookup (the tensor's one scale folded into it): the kernel
    of `FP8._decode32` without chunks."""
    return (table.index_select(0, q.to(torch.int32)),)


def decode_chunks(q: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, chunk: int) -> tuple[torch.Tensor]:
    """fp32 values of fp8 codes (bytes) by `table` lookup times their chunks' scales: `FP8._decode32`'s
    kernel with chunks."""
    return (scale_buckets(table.index_select(0, q.to(torch.int32)), scales, chunk),)


@compressors.register("fp8")
class FP8(Chunked):
    """FP8 (e4m3 or e5m2, torch's float8 dtypes) with a per-chunk fp32 scale; all-gathered, summed in fp32."""
    x_memcpy = 14.0

    def __init__(self, format: str = "e4m3", chunk: int = 0):
        if format not in FORMATS:
            raise UserError(f"fp8: format must be one of {', '.join(FORMATS)}; got {format!r}")
        self.format, self.dtype8 = format, FORMATS[format]
        self.fmax = float(torch.finfo(self.dtype8).max)
        self.chunk = check_chunk("fp8", chunk, allow_zero=True)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        n = flat.numel()
        if self.chunk:           # each block finds its chunks' scales
            q, scales = blockwise(encode, n, [(flat, (1, 1))], [(1, 1), (1, self.chunk)], None, self.fmax,
                                  self.chunk, self.dtype8, align=self.chunk)
            check_scale(scales, self.name, key, flat)
            return Payload([q, scales], ctx=self.context(tensor.shape, tensor.dtype))
        amax = maxabs(flat, empty=0)
        check_scale(amax, self.name, key, flat)
        scales = amax / self.fmax
        inv = torch.where(scales > 0, 1.0 / scales, 0.0)     # an all-zero tensor codes as zeros
        q, = blockwise(encode, n, [(flat, (1, 1))], [(1, 1)], inv, self.fmax, 0, self.dtype8)
        return Payload([q, scales], ctx=self.context(tensor.shape, tensor.dtype))

    def _decode32(self, payload):
        q, scales = payload.tensors
        n = payload.ctx["numel"]
        table = constant(("fp8-values", self.format), q.device,       # fp32 of each code (a lookup: the cast is slow)
                         lambda: torch.arange(256, dtype=torch.uint8, device="cpu").view(self.dtype8).float())
        if n == 0:
            return torch.zeros(0, device=q.device)
        if not self.chunk:       # the tensor's one scale folded into the table: one lookup per element
            return blockwise(decode_kernel, n, [(q.reshape(-1), (1, 1))], [(1, 1)], table * scales.reshape(()))[0]
        return blockwise(decode_chunks, n, [(q.reshape(-1), (1, 1)), (scales.reshape(-1), (1, self.chunk))],
                         [(1, 1)], table, self.chunk, align=self.chunk)[0]

    def nominal_bits(self, numel):
        return 8.0 + 32.0 * math.ceil(numel / (self.chunk or max(numel, 1))) / max(numel, 1)
