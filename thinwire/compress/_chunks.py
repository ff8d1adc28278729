"""Chunked payloads, shared by `fp8`, `fp4`, `demo` and `sparseloco`.

A flat tensor of n elements is cut into rows of `chunk` elements plus one shorter tail row. Top-k per chunk keeps
`k` entries of every full row and ceil(k · tail / chunk) of the tail (the same density): what is kept depends only
on (n, chunk, k), so the payload size is fixed by the shape and an index needs only its position inside its chunk,
ceil(log2 chunk) bits, packed. All four decode to fp32 and sum the ranks' contributions in fp32 (Streaming
DiLoCo's "fp32 accumulation"), casting to the tensor's dtype once at the end.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import UserError
from .base import Compressor
from .bitpack import pack, packed_nbytes, unpack
from .kernels import cpu_blocks, scratch

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
            g = group_size(width, kk) if x.device.type == "cpu" and rows > 1 and x.dtype in _BITS else 0
            i = grouped_topk(block, kk, g) if g else torch.topk(block.abs(), kk, dim=1, sorted=False).indices
            idx.append(i.reshape(-1))
            vals.append(block.gather(1, i).reshape(-1))
        if not idx:
            return torch.zeros(0, dtype=torch.int64, device=x.device), x.new_zeros(0)
        return torch.cat(idx), torch.cat(vals)


def group_size(width: int, k: int) -> int:
    """The group size of `grouped_topk` for rows of `width` keeping `k`: the largest power of two up to 16 that
    divides the width and leaves at least 8k groups; 0 where that is under 4 (torch.topk is as fast there)."""
    g = 16
    while g >= 4 and (width % g or width // g < 8 * k):
        g //= 2
    return g if g >= 4 else 0


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}
ROWS = 128                   # rows of a block of `grouped_topk` (a 4096-wide block: 2 MB, in the caches)


def grouped_topk(x: torch.Tensor, k: int, g: int) -> torch.Tensor:
    """The in-row indices of the k largest |x| of every row of the 2-D CPU tensor `x` (as torch.topk gives them,
    unsorted), from a tenth of the elements: each row is cut into width/g groups of g (strided: element j is in
    group j mod width/g), and the k largest |x| lie in the k groups with the largest maxima. (Let t be the k-th
    largest group maximum: the k groups above it hold k elements ≥ t, so the row's k-th largest is ≥ t, and an
    element of the top k sits in a group whose maximum is ≥ t, one of those k, up to ties at t, which torch.topk
    breaks arbitrarily too.) So: the group maxima, their top k, the k·g elements of those groups, their top k —
    block by block of rows, in the caches. The magnitudes are compared as the integers of their bits (ordered
    as the floats are, for non-negative ones; NaN above all, as torch.topk has it)."""
    rows, width = x.shape
    bits, w = _BITS[x.dtype], width // g
    out = torch.empty(rows, k, dtype=torch.int64, device="cpu")          # (a CPU path)
    with cpu_blocks() as next_block:
        for lo in range(0, rows, ROWS):
            next_block()
            blk = x[lo:lo + ROWS]
            r = blk.shape[0]
            a = torch.abs(blk, out=scratch(blk.shape, blk.dtype, blk.device)).view(bits).view(r, g, w)
            top = row_top(torch.amax(a, 1), k)                                          # (r, k) groups
            sel = row_top(a.gather(2, top.unsqueeze(1).expand(r, g, k)).view(r, g * k), k)   # of their elements
            member = sel.div(k, rounding_mode="floor")                                  # cand[., i·k + j]:
            group = top.gather(1, sel.sub_(member * k))                                 # element i·w + top[j]
            out[lo:lo + r] = member.mul_(w).add_(group)
    return out


def row_top(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (rows, k) of the k largest of each row of the 2-D integer CPU tensor `v`, in row order: the k-th
    largest value of each row by numpy's partition (a vectorised selection of values: ~7x torch.topk's speed on
    rows of a few hundred), then the entries at or above it. Where a tie at the k-th leaves some row more than
    k of those, torch.topk picks (as it would have anyway)."""
    n = v.shape[1]
    kth = torch.from_numpy(np.partition(v.numpy(), n - k, axis=1)[:, n - k:n - k + 1])
    hit = torch.nonzero(v >= kth)
    if hit.shape[0] != v.shape[0] * k:               # (every row has at least k: exactly k in all of them)
        return torch.topk(v, k, dim=1, sorted=False).indices
    return hit[:, 1].view(v.shape[0], k)


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
