"""`randomk`: k coordinates drawn uniformly without replacement (Stich, Cordonnier, Jaggi 2018, "Sparsified
SGD with Memory", arXiv 1809.07599, rand_k).

Every rank draws the SAME indices, from a seed derived from (seed, key, step), so only the k values travel and
they are summed by all-reduce. `scale=True`: C(g)_i = (d/k) g_i 1[i ∈ Ω], unbiased with E‖C(g) − g‖² =
(d/k − 1)‖g‖²; `scale=False`: g ⊙ 1_Ω, biased, E‖C(g) − g‖² = (1 − k/d)‖g‖², the form for error feedback
(scaling by d/k inside error feedback amplifies the residual: unstable).

Default ratio 0.5. The unbiased form multiplies the gradient noise: averaged over n workers the variance grows by
ω/n with ω = d/k − 1, and the step size that trains shrinks by about 1 + ω/n (Khirirat et al. 2018; DIANA's
γ ≤ 1/(L(1 + 2ω/n))): on digits-mlp (lr 0.2, momentum 0.9, 4 workers) 1 % and 10 % missed the target, 50 % reached
it under every algorithm, and error feedback did not rescue small ratios (each coordinate waits ~d/k steps, a
staleness heavy-ball momentum does not tolerate; docs/matrix.md). For fewer bytes at the same step size: `topk`.

`sampling="stratified"` (the default): [d] is cut into k consecutive strata of ⌊d/k⌋ or ⌈d/k⌉ coordinates and one
coordinate is drawn uniformly in each (with `scale`, C(g)_i = m_s g_i in a stratum of m_s). Every coordinate is
kept with probability 1/m_s ≈ k/d, so C is unbiased with E‖C(g) − g‖² = Σ_s (m_s − 1)‖g_s‖², rand-k's variance
when k divides d (systematic sampling with a random start per stratum; the bounds above are all the analyses
use). The draws are offsets u_s m_s / 2^31 of pairwise-independent uniforms u_s (the xor table of
`rounding.Uniforms`, hashed on the tensor's device by `kernels.random_bits`): the same indices on every device and
rank, nothing from the host, and the gather and scatter sweep memory in order (uniform up to the grid m_s/2^31).
"uniform": a uniform k-subset, as Stich et al. define rand-k, drawn on the host without a full permutation (a few
more than k sorted points with replacement, as exponential spacings, the distinct ones kept and a random few
dropped; a permutation where k > d/4); the indices travel in the payload's context to the tensor's device.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from ._sparse import check_ratio, generator, num_kept
from .base import Compressor, Payload
from .kernels import cpu_blocks, fresh, fused, random_bits, scratch, seed_of

_COLS = 4096               # columns of a stratum table of pairwise-independent draws (as `Uniforms`)


def sample_without_replacement(d: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct indices of [d], a uniformly random k-subset (int64; in increasing order when k <= d / 4)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=gen.device)
    if k >= d or k > d // 4:
        return torch.randperm(d, generator=gen, device=gen.device)[:k]
    m = k + 2 * k * k // d + 16
    while True:
        # m i.i.d. uniform points of [0, d), drawn already sorted: the partial sums of m + 1 exponential gaps,
        # divided by their total, are the order statistics of m uniforms (no sort of m numbers needed)
        gaps = torch.empty(m + 1, dtype=torch.float64, device=gen.device).exponential_(generator=gen)
        points = gaps.cumsum_(0)
        idx = points[:m].mul_(d / float(points[m])).floor_().to(torch.int64).clamp_(max=d - 1)
        keep = torch.ones(m, dtype=torch.bool, device=gen.device)
        torch.ne(idx[1:], idx[:-1], out=keep[1:])              # distinct values: sorted, so drop repeats
        distinct = idx[keep]
        if distinct.numel() >= k:
            drop = sample_without_replacement(distinct.numel(), distinct.numel() - k, gen)
            keep = torch.ones(distinct.numel(), dtype=torch.bool, device=gen.device)
            keep[drop] = False                                  # a uniformly random subset of the excess
            return distinct[keep]
        m = int(m * 1.5) + 16


def strata(d: int, k: int) -> list[tuple[int, int, int]]:
    """The k strata of [d] as (first coordinate, strata, coordinates each): ⌈d/k⌉-wide ones first, then ⌊d/k⌋."""
    q, r = divmod(d, k)
    return [g for g in ((0, r, q + 1), (r * (q + 1), k - r, q)) if g[1] and g[2]]


def _bits(m: int) -> int:
    """Bits of a stratum's draw: log2 m for a power of two (the draw is the offset, exactly uniform); else 31 −
    bits of m while u·m fits int32 with a grid error m/2^bits ≤ 2^-15 (m < 256); else 31 (int64 arithmetic)."""
    if m & (m - 1) == 0:
        return m.bit_length() - 1
    return 31 - m.bit_length() if m.bit_length() <= 8 else 31


def _offsets(a: torch.Tensor, b: torch.Tensor, count: int, m: int) -> torch.Tensor:
    """Offsets in [0, m) of `count` strata from the table rows `a` (R x 1) and columns `b` (1 x C) of
    `_bits(m)`-bit draws: (a_i ^ b_j) · m / 2^bits read row by row (int32, or int64 for m >= 256; the draw
    itself for m a power of two)."""
    bits = _bits(m)
    u = torch.bitwise_xor(a, b, out=scratch((a.shape[0], b.shape[1]), torch.int32, a.device)).view(-1)[:count]
    if 1 << bits == m:
        return u
    if bits < 31:
        return u.mul_(m).bitwise_right_shift_(bits)
    off = scratch(count, torch.int64, a.device)
    off.copy_(u)
    return off.mul_(m).bitwise_right_shift_(31)


_NARROW = 2          # strata this narrow are written by bit masks, lane by lane (a scatter costs more)
_BLOCK = 1 << 18     # coordinates per CPU block: fewer, larger ops (a few int32 temporaries of a quarter of it)


_STARTS: dict = {}


def _starts(count: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """0, m, 2m, … (count of them): the first coordinate of each stratum of a CPU block (kept per (m, dtype);
    on the CPU an index_select of these plus the offsets costs less than a gather along rows of m)."""
    got = _STARTS.get((m, dtype))
    if got is None or got.numel() < count:
        got = _STARTS[m, dtype] = torch.arange(max(count, _BLOCK // m + 1), dtype=dtype, device="cpu").mul_(m)
    return got[:count]


def _lane_mask(off: torch.Tensor, j: int) -> torch.Tensor:
    """−1[off == j] (all bits set where the stratum drew lane j), int32."""
    return torch.eq(off, j, out=scratch(off.shape, torch.int32, off.device)).neg_()


def gather_kernel(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: int, into=None) -> torch.Tensor:
    """The drawn value of each stratum of `x` ((strata, m) coordinates): randomk's compress kernel. On the CPU
    an index_select at the strata's first coordinates plus the offsets (a third of the time of a gather along
    rows of m, and less than picking lanes by bit masks); compiled on a GPU, where pairs (m = 2) pick by a bit
    mask and the others gather. `into` (the CPU loop's slice of the payload): written in place."""
    off = _offsets(a, b, x.shape[0], m)
    if x.device.type == "cpu":
        pos = torch.add(_starts(x.shape[0], m, off.dtype), off, out=scratch(off.shape, off.dtype, x.device))
        return torch.index_select(x.view(-1), 0, pos, out=into) if into is not None else x.view(-1)[pos]
    if m != 2 or x.dtype != torch.float32:
        got = x.gather(1, off.view(-1, 1).long()).view(-1)
        return got if into is None else into.copy_(got)
    bits = x.view(torch.int32)          # x0 ^ ((x0 ^ x1) & −off)
    out = torch.bitwise_xor(bits[:, 0], bits[:, 1], out=scratch(off.shape, torch.int32, x.device))
    out = out.bitwise_and_(off.neg_()).bitwise_xor_(bits[:, 0]).view(torch.float32)
    return out if into is None else into.copy_(out)


def scatter_kernel(vals: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: int, scale: float,
                   into=None) -> torch.Tensor:
    """(strata, m) zeros but each stratum's drawn coordinate, vals · scale there: randomk's decompress kernel.
    On the CPU fp32 pairs are written as int64 words, single lanes through a bit mask, and wider strata by a 1-D
    scatter at flat positions; compiled on a GPU, a scatter along rows. `into` (the CPU loop's (strata, m) slice
    of the output): written in place."""
    off = _offsets(a, b, vals.numel(), m)
    v = torch.mul(vals, scale, out=scratch(vals.shape, vals.dtype, vals.device)) if scale != 1 else vals
    out = scratch((vals.numel(), m), vals.dtype, vals.device) if into is None else into
    if vals.device.type == "cpu" and (m > _NARROW or vals.dtype != torch.float32):    # flat positions: a 1-D
        pos = torch.add(_starts(off.numel(), m, off.dtype), off, out=scratch(off.shape, off.dtype, off.device))
        pos = scratch(off.shape, torch.int64, off.device).copy_(pos)           # (int64 adds: 5x slower)
        out.zero_().view(-1).scatter_(0, pos, v)      # scatter costs half of one along rows of m
        return out
    if vals.device.type != "cpu":
        return out.zero_().scatter_(1, off.view(-1, 1).long(), v.view(-1, 1))
    bits, lanes = v.view(torch.int32), out.view(torch.int32)
    if m == 2 and out.storage_offset() % 2:          # (pairs not on 8-byte words) lane 1: v & −off, lane 0: rest
        torch.bitwise_and(bits, off.neg_(), out=lanes[:, 1])
        torch.bitwise_xor(bits, lanes[:, 1], out=lanes[:, 0])
        return out
    if m == 2:           # a pair as one int64 word (lane 0 its low half): v's bits shifted 32·off up
        shift = torch.mul(off, 32, out=scratch(off.shape, torch.int64, off.device))
        torch.bitwise_left_shift(bits.view(torch.uint32).to(torch.int64), shift, out=out.view(torch.int64).view(-1))
        return out
    for j in range(m):
        torch.bitwise_and(bits, _lane_mask(off, j), out=lanes[:, j])
    return out


_fused_gather, _fused_scatter = fused(gather_kernel), fused(scatter_kernel)


def _tables(key: int, groups, device):
    """Per group of strata, its table's rows (R x 1) and columns (1 x C) of 31-bit draws, hashed from `key`."""
    out = []
    for g, (_, count, m) in enumerate(groups):
        cols = min(_COLS, count)
        rows = -(-count // cols)
        ab = random_bits(seed_of(key, g), rows + cols, _bits(m), device)
        out.append((ab[:rows].view(rows, 1), ab[rows:].view(1, cols)))
    return out


def _row_blocks(count: int, a: torch.Tensor, b: torch.Tensor, m: int):
    """(first stratum, strata, their table rows of `a`) of CPU blocks of whole table rows, about `_BLOCK`
    coordinates each, in `cpu_blocks`' setting (the arena taken back at each)."""
    cols = b.shape[1]
    step = cols * max(1, _BLOCK // (cols * m))
    with cpu_blocks() as next_block:
        for s in range(0, count, step):
            c = min(step, count - s)
            next_block()
            yield s, c, a[s // cols:s // cols - (-c // cols)]


@compressors.register("randomk")
class RandomK(Compressor):
    """Random-k with indices shared by seed: only k values travel, summed by all-reduce; scale=d/k if unbiased."""

    randomness = "shared"
    fixed_size = True
    x_memcpy = 4.0

    def __init__(self, ratio: float = 0.5, scale: bool = True, seed: int = 0, sampling: str = "stratified"):
        self.ratio = check_ratio(ratio)
        self.scale = bool(scale)
        self.unbiased = self.scale
        self.seed = seed
        if sampling not in ("stratified", "uniform"):
            raise UserError(f"randomk: sampling must be one of stratified, uniform; got {sampling!r}")
        self.sampling = sampling

    def compress(self, tensor, key=None, step=0, agreed=None):
        shape, dtype, d, draw = self.context(tensor.shape, tensor.dtype, key, step)
        flat = tensor.reshape(-1)
        if self.sampling == "uniform":
            return Payload([flat.index_select(0, draw.to(tensor.device))], ctx=(shape, dtype, d, draw))
        k = num_kept(self.ratio, d)
        out = fresh(k, flat.dtype, flat.device)
        groups = strata(d, k) if k else []
        done = 0
        for (start, count, m), (a, b) in zip(groups, _tables(draw, groups, flat.device)):
            x = flat[start:start + count * m].view(count, m)
            if flat.device.type != "cpu":
                out[done:done + count] = _fused_gather(x, a, b, m)
            else:               # blocks of whole table rows, in cache
                for s, c, rows in _row_blocks(count, a, b, m):
                    gather_kernel(x[s:s + c], rows, b, m, into=out[done + s:done + s + c])
            done += count
        return Payload([out], ctx=(shape, dtype, d, draw))

    def context(self, shape, dtype, key=None, step=0):
        """(shape, dtype, d, the draw every rank makes from the shared seed: the stratified offsets' 64-bit key,
        or the uniform sample's indices)."""
        d = torch.Size(shape).numel()
        if self.sampling == "uniform":
            draw = sample_without_replacement(d, num_kept(self.ratio, d), generator(self.seed, key, step))
        else:
            draw = seed_of(self.seed, "randomk", key, step)
        return (torch.Size(shape), dtype, d, draw)

    def decompress(self, payload):
        shape, dtype, d, draw = payload.ctx
        vals = payload.tensors[0].reshape(-1).to(dtype)
        if self.sampling == "uniform":
            if self.scale and draw.numel():
                vals = vals * (d / draw.numel())
            # (a receiver's `context` draws the indices on the host: they follow the payload to its device)
            out = torch.zeros(d, dtype=dtype, device=vals.device)
            return out.index_copy_(0, draw.to(vals.device), vals).view(shape)
        out = fresh(d, dtype, vals.device)
        groups = strata(d, vals.numel()) if vals.numel() else []
        done = 0
        for (start, count, m), (a, b) in zip(groups, _tables(draw, groups, vals.device)):
            scale = m if self.scale else 1
            region = out[start:start + count * m].view(count, m)
            if vals.device.type != "cpu":
                region.copy_(_fused_scatter(vals[done:done + count], a, b, m, scale))
            else:
                for s, c, rows in _row_blocks(count, a, b, m):
                    scatter_kernel(vals[done + s:done + s + c], rows, b, m, scale, into=region[s:s + c])
            done += count
        return out.view(shape)

    def aggregate(self, payloads):
        total = payloads[0].tensors[0].reshape(-1).clone()
        for p in payloads[1:]:
            total += p.tensors[0].reshape(-1)
        return self.decompress(Payload([total], payloads[0].ctx))

    def nominal_bits(self, numel):
        return 32.0 * num_kept(self.ratio, numel) / max(1, numel)
