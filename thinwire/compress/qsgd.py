"""`qsgd`: QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic 2017, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding", arXiv 1610.02132): C(g_i) = ||g||_2 sign(g_i) xi_i(g, s), xi the unbiased random
rounding of s|g_i|/||g|| to the levels {0, 1/s, ..., 1} (s intervals), the norm taken per bucket. Sign and level
travel as one code in [0, 2s], packed to ceil(log2(2s + 1)) bits, plus one fp32 norm per bucket.

"allreduce": the ranks agree on the per-bucket max of their norms (the levels stay unbiased: |g_i| <= the agreed
norm) and sum the signed levels in an integer type wide enough for world_size of them (8 bits up to 127/s ranks,
then int16, which gloo sums as int32). "allgather": each rank's packed codes and norms (with s = 7, 4-bit codes:
chosen on 2–3 ranks; `thinwire.exchange.choose`).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from .base import Payload, constant
from .bitpack import pack, unpack, value_table
from .finite import check_scale
from .int8 import ScaledLevels, widened
from .kernels import blockwise
from .rounding import stochastic_codes


def bucket_norms(flat: torch.Tensor, bucket: int, ord: float) -> torch.Tensor:
    """fp32 norm of each bucket of `bucket` elements (the last may be shorter)."""
    n = flat.numel()
    full = (n // bucket) * bucket
    dt = None if flat.dtype == torch.float64 else torch.float32   # vector_norm never narrows: a float64 norm, then fp32
    parts = [torch.linalg.vector_norm(flat[:full].view(-1, bucket), ord=ord, dim=1, dtype=dt)]
    if full < n:
        parts.append(torch.linalg.vector_norm(flat[full:], ord=ord, dtype=dt).reshape(1))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).float()


def scale_buckets(codes: torch.Tensor, factors: torch.Tensor, bucket: int) -> torch.Tensor:
    """fp32 codes * factor of the code's bucket, for flat `codes` (values past the last bucket take the last
    factor). On the CPU in place when the codes are fp32 already, bucket by bucket; elsewhere the same products
    out of place (`scaled_buckets`), the form a compiler fuses (Inductor's scheduler, torch 2.11 to 2.13, fails on
    the in-place form inside a kernel that also reinterprets a lookup's bytes: KeyError 'op3')."""
    if codes.device.type != "cpu":
        return scaled_buckets(codes, factors, bucket)
    n = codes.numel()
    full = (n // bucket) * bucket
    out = codes.to(torch.float32)
    out[:full].view(-1, bucket).mul_(factors[: n // bucket].view(-1, 1))
    if full < n:
        out[full:].mul_(factors[-1])
    return out


def scaled_buckets(codes: torch.Tensor, factors: torch.Tensor, bucket: int) -> torch.Tensor:
    """`scale_buckets` out of place (any device; a new tensor): the whole buckets as rows times a column of
    factors, the tail times the last factor (no per-element index arithmetic)."""
    n = codes.numel()
    rows = n // bucket
    f = codes.to(torch.float32)
    head = (f[:rows * bucket].view(rows, bucket) * factors[:rows].view(-1, 1)).view(-1)
    return head if rows * bucket == n else torch.cat([head, f[rows * bucket:] * factors[-1]])


def decode4(packed: torch.Tensor, factors: torch.Tensor, table: torch.Tensor, bucket: int):
    """fp32 levels of a block's packed 4-bit codes (a byte's two as one int64 of `table`) times their buckets'
    factors: `QSGD.decompress`'s kernel (up to 7 values past the block's end, cut by `blockwise`)."""
    return (scale_buckets(table.index_select(0, packed.to(torch.int32)).view(torch.float32), factors, bucket),)


@compressors.register("qsgd")
class QSGD(ScaledLevels):
    randomness = "local"
    x_memcpy = 8.0

    def __init__(self, levels: int = 7, bucket: int = 512, norm: str = "l2", seed: int = 0):
        if not 1 <= levels <= 127:
            raise UserError(f"qsgd: levels (s, the number of intervals) must be in 1..127, got {levels}")
        if bucket < 1:
            raise UserError(f"qsgd: bucket must be >= 1 element, got {bucket}")
        if norm not in ("l2", "max"):
            raise UserError(f"qsgd: norm must be one of l2, max; got {norm!r}")
        super().__init__(seed)
        self.levels, self.bucket, self.norm = int(levels), int(bucket), norm
        self.bits = math.ceil(math.log2(2 * self.levels + 1))

    def _norms(self, flat):
        return bucket_norms(flat, self.bucket, 2 if self.norm == "l2" else math.inf)

    def agree(self, tensor, key=None, step=0):
        return self._norms(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        norms = self._norms(flat) if agreed is None else agreed.float()
        check_scale(norms, self.name, key, flat)
        s = self.levels
        inv = torch.where(norms > 0, s / norms, 0.0)      # an all-zero bucket codes as level 0
        codes = stochastic_codes(flat, inv, s, self.uniforms, self.bucket, bits=self.bits)
        if self.bits not in (1, 2, 4, 8):        # (1, 2, 4: packed by the kernel; 8: the codes are the bytes)
            codes = pack(codes, self.bits, inplace=True)
        return self._payload(codes, norms, tensor, agreed, {"norms": norms})

    def sum_payload(self, payload, world_size):
        if "norms" not in payload.ctx:
            raise ValueError("qsgd: only payloads compressed under agreed norms can be summed")
        ctx = dict(payload.ctx, summed=True)
        codes = unpack(payload.tensors[0], self.bits, ctx["numel"])
        return Payload([codes.to(widened(self.levels * max(2, world_size))).sub_(self.levels)], ctx=ctx)

    def decompress(self, payload):
        ctx = payload.ctx
        norms = ctx["norms"] if "norms" in ctx else payload.tensors[1]
        levels = payload.tensors[0]
        if not ctx["summed"] and self.bits == 4:      # one lookup per byte: its two levels, as one int64
            table = constant(("qsgd-levels", self.levels), levels.device, lambda: value_table(
                4, [float(c - self.levels) for c in range(16)], "cpu").view(torch.int64).view(-1))
            factors = norms.reshape(-1) / self.levels
            out, = blockwise(decode4, ctx["numel"], [(levels.reshape(-1), (4, 8)), (factors, (1, self.bucket))],
                             [(1, 1)], table, self.bucket, align=math.lcm(8, self.bucket))
            return out.to(ctx["dtype"]).view(ctx["shape"])
        if not ctx["summed"]:
            codes = unpack(levels, self.bits, ctx["numel"])
            if codes.data_ptr() == levels.data_ptr():     # 8-bit codes are the payload itself
                codes = codes.clone()
            # c - s on the bytes (wrapping: read as int8 it is the signed level), then one cast and one multiply
            levels = codes.sub_(self.levels).view(torch.int8)
        out = scale_buckets(levels, norms / self.levels, self.bucket)
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def packed_bits(self, numel):
        """The codes and one fp32 norm per bucket."""
        return self.bits + 32.0 * math.ceil(numel / self.bucket) / max(numel, 1)

    def sum_dtypes(self, numel, world_size):
        """The signed levels widened for world_size of them, plus the norms agreed first (their max)."""
        total = max(2 * self.levels, world_size * self.levels)
        return [(widened(total), 1, 1), (torch.float32, math.ceil(numel / self.bucket), max(numel, 1))]
