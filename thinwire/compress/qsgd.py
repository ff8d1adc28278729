"""`qsgd`: QSGD (seed 002 §5.2.1, [61]): C(g_i) = ||g||_2 sign(g_i) xi_i(g, s), xi the unbiased random rounding of
s|g_i|/||g|| to the levels {0, 1/s, ..., 1} (s intervals: erratum 4 of the catalog), the norm taken per bucket.
Sign and level travel as one code in [0, 2s], packed to ceil(log2(2s + 1)) bits, plus one fp32 norm per bucket.

"allreduce": the ranks agree on the per-bucket max of their norms (the levels stay unbiased, since
|g_i| <= agreed norm), and the signed levels are summed in an integer type wide enough for world_size of them;
that widened type is what crosses the wire then (8 bits up to 127/s ranks, then int16, which gloo sums as int32).
"allgather": the packed codes and norms of each rank travel. "auto" (default): all-reduce unless the all-gather
sends fewer bytes at the world size (with s = 7, 4-bit codes: gathered on 2–3 ranks; `pick_collective`).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from .base import Compressor, Payload
from .bitpack import pack, unpack
from .finite import check_scale
from .int8 import summed_level_bits, widen
from .rounding import Uniforms, stochastic_codes


def bucket_norms(flat: torch.Tensor, bucket: int, ord: float) -> torch.Tensor:
    """fp32 norm of each bucket of `bucket` elements (the last may be shorter)."""
    n = flat.numel()
    full = (n // bucket) * bucket
    wide = flat.dtype == torch.float64      # vector_norm never narrows its input: a float64 norm, then fp32
    dt = None if wide else torch.float32
    parts = [torch.linalg.vector_norm(flat[:full].view(-1, bucket), ord=ord, dim=1, dtype=dt)]
    if full < n:
        parts.append(torch.linalg.vector_norm(flat[full:], ord=ord, dtype=dt).reshape(1))
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out.float() if wide else out


def scale_buckets(codes: torch.Tensor, factors: torch.Tensor, bucket: int, offset: int) -> torch.Tensor:
    """fp32 (codes - offset) * factor of the code's bucket, for flat integer `codes` (code `offset` gives exactly 0)."""
    n = codes.numel()
    full = (n // bucket) * bucket
    out = codes.to(torch.float32)
    if offset:
        out.sub_(offset)
    out[:full].view(-1, bucket).mul_(factors[: n // bucket].view(-1, 1))
    if full < n:
        out[full:].mul_(factors[-1])
    return out


@compressors.register("qsgd")
class QSGD(Compressor):
    unbiased = True
    linear = True
    randomness = "local"
    aggregation = "allreduce"
    fixed_size = True         # the payload size depends only on the shape
    pick_by_bytes = True

    def __init__(self, levels: int = 7, bucket: int = 512, norm: str = "l2", aggregation: str = "auto",
                 seed: int = 0):
        if not 1 <= levels <= 127:
            raise UserError(f"qsgd: levels (s, the number of intervals) must be in 1..127, got {levels}")
        if bucket < 1:
            raise UserError(f"qsgd: bucket must be >= 1 element, got {bucket}")
        if norm not in ("l2", "max"):
            raise UserError(f"qsgd: norm must be one of l2, max; got {norm!r}")
        if aggregation not in ("auto", "allreduce", "allgather"):
            raise UserError(f"qsgd: aggregation must be one of auto, allreduce, allgather; got {aggregation!r}")
        self.levels, self.bucket, self.norm = int(levels), int(bucket), norm
        self.aggregation = "allreduce" if aggregation == "auto" else aggregation
        self.pick_by_bytes = aggregation == "auto"
        self.bits = math.ceil(math.log2(2 * self.levels + 1))
        self.uniforms = Uniforms(seed)

    def _norms(self, flat):
        return bucket_norms(flat, self.bucket, 2 if self.norm == "l2" else math.inf)

    def agree(self, tensor, key=None, step=0):
        return self._norms(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        n = flat.numel()
        norms = self._norms(flat) if agreed is None else agreed.float()
        check_scale(norms, self.name, key, flat)
        s = self.levels
        inv = torch.where(norms > 0, s / norms, 0.0)      # an all-zero bucket codes as level 0
        codes = stochastic_codes(flat, inv, s, self.uniforms, self.bucket)
        packed = pack(codes, self.bits, inplace=True)
        ctx = {"shape": tensor.shape, "dtype": tensor.dtype, "numel": n, "summed": False}
        if agreed is not None:
            ctx["norms"] = norms
            return Payload([packed], ctx=ctx)
        return Payload([packed, norms], ctx=ctx)

    def sum_payload(self, payload, world_size):
        ctx = dict(payload.ctx)
        if "norms" not in ctx:
            raise ValueError("qsgd: only payloads compressed under agreed norms can be summed")
        codes = unpack(payload.tensors[0], self.bits, ctx["numel"])
        levels = widen(codes, max(2 * self.levels, world_size * self.levels)).sub_(self.levels)
        ctx["summed"] = True
        return Payload([levels], ctx=ctx)

    def context(self, shape, dtype, key=None, step=0):
        # not agreed (the scale travels in the payload) and not summed
        return {"shape": torch.Size(shape), "dtype": dtype, "numel": torch.Size(shape).numel(), "summed": False}

    def decompress(self, payload):
        ctx = payload.ctx
        norms = ctx["norms"] if "norms" in ctx else payload.tensors[1]
        factors = norms / self.levels
        if ctx["summed"]:
            out = scale_buckets(payload.tensors[0], factors, self.bucket, 0)
        else:
            codes = unpack(payload.tensors[0], self.bits, ctx["numel"])
            if codes.data_ptr() == payload.tensors[0].data_ptr():     # 8-bit codes are the payload itself
                codes = codes.clone()
            # c - s on the bytes (wrapping: read as int8 it is the signed level), then one cast and one multiply
            levels = codes.sub_(self.levels).view(torch.int8)
            out = scale_buckets(levels, factors, self.bucket, 0)
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def nominal_bits(self, numel, world_size=None):
        """Packed: the codes and one fp32 norm per bucket; at `world_size` ranks: what the exchange sends there."""
        if world_size is not None:
            return self.wire_bits(numel, world_size)[1]
        return self.bits + 32.0 * math.ceil(numel / self.bucket) / max(numel, 1)

    def summed_bits(self, numel, world_size):
        """The signed levels widened for world_size of them, plus the norms agreed first (a max all-reduce)."""
        total = max(2 * self.levels, world_size * self.levels)
        return summed_level_bits(total) + 32.0 * math.ceil(numel / self.bucket) / max(numel, 1)

    def state_dict(self):
        return {"uniforms": self.uniforms.state_dict()}

    def load_state_dict(self, state):
        self.uniforms.load_state_dict(state["uniforms"])
