"""Shared pieces of the sparsifiers: the (values, indices) payload, fast exact top-k, bit packing of codes.

Indices travel as int16 when the tensor has at most 2^15 elements, else int32 (the index vector is the
unavoidable cost of a sparse payload, so it takes no more bits than the tensor needs).
"""
from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from ..errors import UserError
from . import bitpack
from ._select import beyond_indices
from .base import Compressor, Payload
from .kernels import fresh
from .rounding import rank

SMALL = 1 << 15          # below this many elements torch.topk is as fast as anything


def check_ratio(ratio: float, name: str = "ratio") -> float:
    if not 0 < ratio <= 1:
        raise UserError(f"{name} must be in (0, 1], got {ratio}")
    return float(ratio)


def num_kept(ratio: float, numel: int) -> int:
    return min(numel, max(1, int(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int16 if numel <= SMALL else torch.int32


def generator(*parts: Any) -> torch.Generator:
    """Seeded identically on every rank from (seed, key, step) (Python's hash() is salted per process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF)


def local_generator(seed: int) -> torch.Generator:
    """Independent randomness per rank (stochastic rounding must not be correlated across ranks)."""
    return generator(seed, "local", rank())


def topk_indices(flat: torch.Tensor, k: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the k largest |flat|, exactly (ties broken arbitrarily, as torch.topk does).

    A threshold search instead of a full selection: estimate from a random sample a threshold that a little
    more than k elements pass, keep the candidates (one compare, one nonzero), then an exact top-k among
    those few. If the estimate let fewer than k through (rare: the margin is 4 standard deviations of the
    sample count) it falls back to torch.topk, so the result is always the exact top-k set.
    """
    d = flat.numel()
    if k >= d:
        return torch.arange(d, device=flat.device)
    if d <= SMALL or k > d // 16:
        return torch.topk(flat.abs(), k, sorted=False).indices
    s = min(d, max(4096, int(64 * d / k)))
    sample = flat[torch.randint(d, (s,), generator=gen, device=gen.device).to(flat.device)].abs()
    expected = k * s / d
    kk = min(s, int(expected + 4 * math.sqrt(expected) + 2))
    thr = torch.topk(sample, kk, sorted=False).values.min()
    t = float(thr)
    cand = beyond_indices(flat, t) if t > 0 else torch.nonzero(flat != 0).squeeze(1)
    if cand.numel() < k:
        return torch.topk(flat.abs(), k, sorted=False).indices
    return cand.index_select(0, torch.topk(flat.index_select(0, cand).abs_(), k, sorted=False).indices)


def beyond(flat: torch.Tensor, thr: float, center: float = 0.0) -> torch.Tensor:
    """|flat − center| ≥ thr as a mask, by two compares (no |x| temporary: less memory traffic than abs)."""
    if thr <= 0:
        return flat != center
    return (flat >= center + thr).logical_or_(flat <= center - thr)


class SparseCompressor(Compressor):
    """Payload = (values in the tensor's dtype, indices); aggregated by all-gather + index_add_."""

    unbiased = False
    linear = False
    aggregation = "allgather"
    is_sparse = True
    index_slot = 1            # the position of the index tensor in the payload
    dense_ok = True           # a payload heavier than the tensor goes dense (off under an index coder: `Coded`)

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        """About k = ratio·d coordinates kept; `seed` seeds any sampling."""
        self.ratio = check_ratio(ratio)
        self.seed = seed

    def select(self, flat: torch.Tensor, key: Any, step: int) -> torch.Tensor:
        """Indices (int64) of the coordinates to send."""
        raise NotImplementedError

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        idx = self.select(flat, key, step)     # (index_select: 2x faster than flat[idx] here)
        ctx = (tensor.shape, tensor.dtype, flat.numel())
        if self.dense_ok and dense_pays(idx.numel(), flat):   # (values and indices would outweigh the tensor)
            dense = fresh(flat.numel(), flat.dtype, flat.device).zero_()
            return dense_payload(dense.index_copy_(0, idx.long(), flat.index_select(0, idx)), ctx)
        return sparse_payload(flat, idx, ctx)

    def densify(self, payload: Payload) -> Payload | None:
        """The payload as a dense one (`dense_payload`), or None where this payload type has no dense form."""
        return dense_payload(self.decompress(payload).reshape(-1), payload.ctx)

    accumulate_dtype: torch.dtype | None = None   # None: sum in the tensor's own dtype

    def _contribution(self, tensors) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(indices, values) of one rank's payload (int16 indices widened: index_add_ takes int32 or int64);
        indices None for a dense payload (see `dense_payload`)."""
        vals, idx = tensors
        idx, vals = idx.reshape(-1), vals.reshape(-1)
        if idx.numel() == 0 and vals.numel():
            return None, vals
        return idx.long() if idx.dtype == torch.int16 else idx, vals

    def _accumulate(self, parts, ctx) -> torch.Tensor:
        shape, dtype, numel = ctx
        acc = self.accumulate_dtype or dtype
        device = parts[0][1].device
        out = fresh(numel, acc, device)                          # (a fresh output on huge pages)
        if all(idx is not None for idx, _ in parts):             # sparse only: one index_add_ over every pair
            idx, vals = parts[0] if len(parts) == 1 else [torch.cat(t) for t in zip(*parts)]   # (one: no copy)
            return out.zero_().index_add_(0, idx, vals.to(acc)).to(dtype).view(shape)
        for i, (idx, vals) in enumerate(parts):                  # in rank order, as the concatenation sums
            if idx is None:
                out.copy_(vals) if i == 0 else out.add_(vals.to(acc))
            else:
                (out.zero_() if i == 0 else out).index_add_(0, idx, vals.to(acc))
        return out.to(dtype).view(shape)

    def decompress(self, payload):
        return self._accumulate([self._contribution(payload.tensors)], payload.ctx)

    def aggregate(self, payloads):
        """Σ_ranks of the sparse contributions: one index_add_ over every rank's (index, value) pairs."""
        return self._accumulate([self._contribution(p.tensors) for p in payloads], payloads[0].ctx)

    def sparse_bits(self, kept: float, numel: int, value_bits: float = 32.0) -> float:
        return kept * (value_bits + torch.iinfo(index_dtype(numel)).bits) / max(1, numel)

    def nominal_bits(self, numel):
        return min(32.0, self.sparse_bits(num_kept(self.ratio, numel), numel))   # (dense past 32 bits: fp32)


def dense_pays(kept: int, flat: torch.Tensor) -> bool:
    """Whether `kept` (value, index) pairs of `flat` weigh at least the dense tensor: a sparsifier then sends the
    tensor with the dropped entries zeroed (`dense_payload`), never more bytes than no compression would."""
    n = flat.numel()
    return n > 0 and kept * (flat.element_size() + index_dtype(n).itemsize) >= n * flat.element_size()


def sparse_payload(flat: torch.Tensor, idx: torch.Tensor, ctx) -> Payload:
    """A sparsifier's payload: the values of `flat` at `idx` and the indices in the narrowest type that holds them."""
    return Payload([flat.index_select(0, idx), idx.to(index_dtype(flat.numel()))], ctx=ctx)


def dense_payload(values: torch.Tensor, ctx) -> Payload:
    """A sparsifier's payload as the whole tensor (dropped entries zero) and no indices: what `_contribution`
    reads as dense. (A sparse payload with no indices has no values either, so the two cannot be confused.)"""
    return Payload([values, torch.empty(0, dtype=index_dtype(values.numel()), device=values.device)], ctx=ctx)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned integer codes < 2^bits, `bits` bits each, into uint8 (A's vectorised `bitpack`)."""
    return bitpack.pack(codes.reshape(-1).to(torch.uint8), bits)


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: n codes as int64."""
    return bitpack.unpack(packed.reshape(-1), bits, n).to(torch.int64)

