"""`fp4`: 4-bit floating-point quantization of (outer) gradients, as Streaming DiLoCo communicates them
(Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch",
arXiv 2501.18512: outer gradients sent as 4-bit floats, accumulated in fp32; the paper's 4-bit format is E3M0,
1 sign bit, 3 exponent bits and no mantissa bit).

A code is a sign bit and a magnitude code m ∈ 0..7; per chunk of `chunk` elements with max-abs a_c,
D(code)_i = ±a_c · v_m, the magnitudes v normalized so the chunk's max-abs is the format's largest value:
    e3m0: v = (0, 2^-6, 2^-5, 2^-4, 2^-3, 2^-2, 2^-1, 1)   (0 and seven powers of two: no mantissa)
    e2m1: v = (0, 0.5, 1, 1.5, 2, 3, 4, 6) / 6             (the OCP MX FP4 value set)
and m the nearest magnitude to |x_i| / a_c (a tie goes to the smaller). Two codes per byte plus one fp32 scale
per chunk: 4 + 32/chunk bits per element, all-gathered and summed in fp32. Error per element: e3m0 at most |x|/3
above a_c·2^-6 and a_c·2^-7 below; e2m1 at most a_c/24 below a_c/6 and |x|/5 above. Biased (deterministic):
pair with `--memory residual`.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._chunks import Chunked, check_chunk
from .base import Payload, constant
from .bitpack import pack_kernel, value_table
from .finite import check_scale
from .kernels import BLOCK, blockwise, cpu_blocks, fresh, scratch
from .qsgd import scale_buckets

MAGNITUDES = {"e3m0": [0.0] + [2.0 ** -e for e in range(6, -1, -1)],
              "e2m1": [v / 6 for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)]}
# G with every midpoint between consecutive magnitudes a multiple of 1/G: ceil(G |x| / a_c) then names the
# magnitude code by one table lookup (faster than a search over the 7 midpoints)
GRID = {"e3m0": 128, "e2m1": 24}


def chunk_amax(a: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 max of each chunk of the non-negative 1-D `a` (the last chunk may be shorter)."""
    n = a.numel()
    full = n - n % chunk
    head = a[:full].view(-1, chunk).amax(1)
    return torch.cat([head, a[full:].amax().reshape(1)]) if full < n else head


def _sign(x: torch.Tensor, value: int, out: torch.Tensor) -> torch.Tensor:
    """`value` where x's sign bit is set, else 0, as int32 (x fp32): its bits shifted down arithmetically to 0 or
    −1, then masked (a comparison into an integer tensor costs twice these two on the CPU). −0.0 counts as
    negative: its code decodes to −0.0, the same number."""
    return torch.bitwise_right_shift(x.view(torch.int32), 31, out=out).bitwise_and_(value)


def encode(x: torch.Tensor, table: torch.Tensor | None, grid: int, chunk: int):
    """(4-bit codes packed 2 per byte, each chunk's max-abs) of a block of whole chunks (the data's last chunk
    may be short): the kernel of `FP4.compress`. The magnitude code of y = G |x| / a_c is #{midpoints < y}: for
    e3m0 (table None; G = 128, midpoints 1, 3, 6, ..., 96) the exponent of y rounded at 1.5 (y's bits plus
    2^22 − 1, shifted), at least 1 above y = 1; else `table[ceil(y)]`, whose second half holds the codes of
    negative x. (No ceil/floor op: on the CPU those run on the thread pool even for small blocks.)"""
    f = x.to(torch.float32)
    dev = x.device
    a = torch.abs(f, out=scratch(f.shape, torch.float32, dev))
    amax = chunk_amax(a, chunk)
    inv = torch.where(amax > 0, grid / amax, 0.0)
    y = scale_buckets(a, inv, chunk)                                             # G |x| / a_c in [0, G]
    tmp = scratch(f.shape, torch.int32, dev)
    if table is None:
        code = y.view(torch.int32)                                              # (y's bits, in place)
        torch.gt(code, 0x3F800000, out=tmp)                                     # y > 1
        code.add_(0x3FFFFF - (127 << 23)).bitwise_right_shift_(23)               # log2 of y rounded at 1.5: 0..7
        torch.maximum(code, tmp, out=code)                                      # (1, 1.5] -> 1
        code.bitwise_or_(_sign(f, 8, tmp))
    else:
        j = y.to(torch.int32)
        j.add_(torch.lt(j, y, out=tmp))                                           # ceil for y >= 0
        j.add_(_sign(f, grid + 2, tmp))
        code = table.index_select(0, j)
    return pack_kernel(code.to(torch.uint8), 4), amax


def decode_kernel(packed: torch.Tensor, amax: torch.Tensor, table: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fp32 values of a block's packed codes times their chunks' max-abs: the kernel of `FP4._decode32`
    (`blockwise` trims what lies past the data). `table` holds each byte's two fp32 values as one int64 (a 1-D
    lookup: twice as fast as rows of two floats)."""
    vals = table.index_select(0, packed.to(torch.int32)).view(torch.float32)    # (up to 7 past the block's end)
    return (scale_buckets(vals, amax, chunk),)


def decode_into(packed: torch.Tensor, amax: torch.Tensor, table: torch.Tensor, chunk: int,
                out: torch.Tensor) -> torch.Tensor:
    """`decode_kernel` on the CPU, block by block, each block's lookup written straight into its slice of `out`
    (fp32, an even number of values: a byte's two values are one int64 of `table`) and scaled there: no
    temporary per block and no copy out of one."""
    n = out.numel()
    step = max(math.lcm(8, chunk), BLOCK - BLOCK % math.lcm(8, chunk))
    with cpu_blocks() as next_block:
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            next_block()
            codes = scratch(hi // 2 - lo // 2, torch.int32, packed.device).copy_(packed[lo // 2:hi // 2])
            torch.index_select(table, 0, codes, out=out[lo:hi].view(torch.int64))
            rows = (hi - lo) // chunk
            out[lo:lo + rows * chunk].view(rows, chunk).mul_(amax[lo // chunk:lo // chunk + rows].view(-1, 1))
            if lo + rows * chunk < hi:
                out[lo + rows * chunk:hi].mul_(amax[lo // chunk + rows])
    return out


@compressors.register("fp4")
class FP4(Chunked):
    """FP4 (e3m0 as in Streaming DiLoCo, or e2m1) with a per-chunk fp32 scale, packed 2 per byte; summed in fp32."""
    x_memcpy = 21.0

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
        # the code of G|x|/a_c: for j = ceil of it (at most G + 1 by round-off), the magnitude code, | 8 when x < 0
        codes = self._codes + (self._codes[-1],)
        signed = codes + tuple(c | 8 for c in codes)
        table = constant(("fp4-codes", signed), flat.device,
                         lambda: torch.tensor(signed, dtype=torch.uint8, device="cpu"))   # once per device
        packed, amax = blockwise(encode, flat.numel(), [(flat, (1, 1))], [(4, 8), (1, self.chunk)],
                                 None if self.format == "e3m0" else table, self.grid, self.chunk,
                                 align=math.lcm(8, self.chunk))
        check_scale(amax, self.name, key, flat)
        return Payload([packed, amax], ctx=self.context(tensor.shape, tensor.dtype))

    def _decode32(self, payload):
        packed, amax = payload.tensors
        n = payload.ctx["numel"]
        table = value_table(4, self._values, packed.device).view(torch.int64).view(-1)   # a byte's two values
        packed, amax = packed.reshape(-1), amax.reshape(-1)
        if packed.device.type == "cpu" and n % 2 == 0 and n > BLOCK:
            return decode_into(packed, amax, table, self.chunk, fresh(n, torch.float32, packed.device))
        return blockwise(decode_kernel, n, [(packed, (4, 8)), (amax, (1, self.chunk))],
                         [(1, 1)], table, self.chunk, align=math.lcm(8, self.chunk))[0]

    def nominal_bits(self, numel):
        return 4.0 + 32.0 * math.ceil(numel / self.chunk) / max(numel, 1)
