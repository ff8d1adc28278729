"""Chunked payloads, shared by `fp8`, `fp4`, `demo` and `sparseloco`.

A flat tensor of n elements is cut into rows of `chunk` elements plus one shorter tail row (n mod chunk). Top-k per
chunk keeps `k` entries of every full row and ceil(k · tail / chunk) of the tail (the same density), so what is
kept depends only on (n, chunk, k): every rank knows it, the payload size is fixed by the shape, and an index
needs only its position inside its chunk, ceil(log2 chunk) bits, packed (a 12-bit index of a 4096-chunk travels
as one byte plus a packed nibble). All four compressors decode to fp32 and sum the ranks' contributions in fp32
(the "fp32 accumulation" of Streaming DiLoCo), casting to the tensor's dtype once at the end.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from .base import Compressor
from .bitpack import pack, packed_nbytes, unpack

MAX_CHUNK = 1 << 16          # in-chunk indices take at most 16 bits


def check_chunk(name: str, chunk: int, allow_zero: bool = False) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not (0 if allow_zero else 1) <= chunk <= MAX_CHUNK:
        lo = "0 (one scale per tensor)" if allow_zero else "1"
        raise UserError(f"{name}: chunk must be an integer in {lo}..{MAX_CHUNK}, got {chunk!r}")
    return chunk


def check_topk(name: str, topk: int, chunk: int) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk:
        raise UserError(f"{name}: topk (entries kept per chunk) must be an integer in 1..chunk={chunk}, got {topk!r}")
    return topk


def index_bits(chunk: int) -> int:
    """Bits of an index inside a chunk: ceil(log2 chunk), at least 1."""
    return max(1, math.ceil(math.log2(chunk)))


def pack_index(local: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """In-chunk indices (< chunk) as `index_bits(chunk)`-bit codes: one packed tensor, or (low byte, packed high
    bits) when more than 8 bits are needed."""
    b = index_bits(chunk)
    if b <= 8:
        return [pack(local.to(torch.uint8), b, inplace=True)]
    return [local.bitwise_and(255).to(torch.uint8), pack(local.bitwise_right_shift(8).to(torch.uint8), b - 8,
                                                         inplace=True)]


def unpack_index(tensors: list[torch.Tensor], count: int, chunk: int) -> tuple[torch.Tensor, int]:
    """Inverse of `pack_index`: (int64 indices, how many payload tensors they took)."""
    b = index_bits(chunk)
    if b <= 8:
        return unpack(tensors[0], b, count).to(torch.int64), 1
    lo = tensors[0].reshape(-1).to(torch.int64)
    hi = unpack(tensors[1], b - 8, count).to(torch.int64)
    return lo.bitwise_or_(hi.bitwise_left_shift_(8)), 2


def index_nbytes(count: int, chunk: int) -> int:
    b = index_bits(chunk)
    return packed_nbytes(count, b) if b <= 8 else count + packed_nbytes(count, b - 8)


class Layout:
    """The rows of an n-element tensor cut into `chunk`-element chunks and the number kept in each (`k` per full
    row, the same density in the tail). `groups` = [(start, rows, width, kept per row)], at most two."""

    def __init__(self, n: int, chunk: int, k: int):
        self.n, self.chunk, self.k = n, chunk, k
        full, tail = divmod(n, chunk)
        self.groups = []
        if full:
            self.groups.append((0, full, chunk, min(k, chunk)))
        if tail:
            self.groups.append((full * chunk, 1, tail, min(tail, max(1, math.ceil(k * tail / chunk)))))
        self.rows = sum(g[1] for g in self.groups)
        self.kept = sum(g[1] * g[3] for g in self.groups)
        self._row_of = self._offsets = None

    def row_of(self, device="cpu") -> torch.Tensor:
        """The row (chunk number) of each kept entry, in payload order (int64, length `kept`, on `device`)."""
        device = torch.device(device)
        if self._row_of is None or self._row_of.device != device:
            parts, base = [], 0
            for _, rows, _, kk in self.groups:
                parts.append(torch.arange(base, base + rows, device=device).repeat_interleave(kk))
                base += rows
            self._row_of = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
            starts = [torch.full((rows,), start, device=device) + torch.arange(rows, device=device) * width for start, rows, width, _ in self.groups]
            self._offsets = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64, device=device)
        return self._row_of

    def positions(self, local: torch.Tensor) -> torch.Tensor:
        """Flat positions of kept entries from their in-chunk indices."""
        rows = self.row_of(local.device)
        return self._offsets[rows] + local

    def topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in-chunk indices int64, values) of the largest |x| of every chunk, row by row (x flat, length n)."""
        idx, vals = [], []
        for start, rows, width, kk in self.groups:
            block = x[start:start + rows * width].view(rows, width)
            i = torch.topk(block.abs(), kk, dim=1, sorted=False).indices
            idx.append(i.reshape(-1))
            vals.append(block.gather(1, i).reshape(-1))
        if not idx:
            return torch.zeros(0, dtype=torch.int64, device=x.device), x.new_zeros(0)
        return torch.cat(idx), torch.cat(vals)


class Layouts:
    """`Layout`s by tensor size, built once (a compressor sees the same few sizes every step)."""

    def __init__(self, chunk: int, k: int):
        self.chunk, self.k = chunk, k
        self._cache: dict[int, Layout] = {}

    def __call__(self, n: int) -> Layout:
        lay = self._cache.get(n)
        if lay is None:
            if len(self._cache) > 256:
                self._cache.clear()
            lay = self._cache[n] = Layout(n, self.chunk, self.k)
        return lay


class Chunked(Compressor):
    """A compressor of chunked payloads (fixed size, gathered): each rank's contribution is decoded to fp32, the
    contributions are summed in fp32 (`_sum32`) and cast to the tensor's dtype once."""

    unbiased = False
    linear = False
    randomness = "none"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape

    def context(self, shape, dtype, key=None, step=0):
        return {"shape": torch.Size(shape), "dtype": dtype, "numel": torch.Size(shape).numel()}

    def _decode32(self, payload) -> torch.Tensor:
        """One payload's contribution, flat fp32 (a fresh tensor). Each subclass defines it (fp4, fp8) or
        overrides `_sum32` instead (demo, sparseloco)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither _decode32 nor _sum32")

    def _sum32(self, payloads) -> torch.Tensor:
        """Σ of the payloads' contributions, flat fp32."""
        out = self._decode32(payloads[0])
        for p in payloads[1:]:
            out += self._decode32(p)
        return out

    def aggregate(self, payloads):
        ctx = payloads[0].ctx
        return self._sum32(payloads).to(ctx["dtype"]).view(ctx["shape"])

    def decompress(self, payload):
        return self.aggregate([payload])
