"""`countsketch`: a Count Sketch of the tensor (Charikar, Chen, Farach-Colton 2002, "Finding Frequent Items in
Data Streams", ICALP 2002) with heavy-hitter recovery.

r rows × c columns (c = the first prime ≥ ratio·d / r); row j has a bucket hash h_j: [d] → [c] and a sign hash
s_j: [d] → {±1}, pairwise independent, drawn from a seed every rank shares (seed, key) and laid out so that
inserting and querying sweep memory in order (`_hash`). Insert: S[j, h_j(i)] += s_j(i) g_i; query: ĝ_i = median_j
s_j(i) S[j, h_j(i)]. S(g₁) + S(g₂) = S(g₁ + g₂): the summed sketch is the sketch of the sum.

`heavy` > 0 (the default): the two rounds of Sketched-SGD (Ivkin et al., NeurIPS 2019, Algorithm 1 / §4; FetchSGD,
Rothchild et al., ICML 2020, Algorithm 1 line "Δ = Top-k(U(S_e))", notes the same second round): round "sketch"
sums the sketches over the ranks (r·c floats), every rank queries the summed sketch and takes the same k = heavy·d
coordinates of largest |estimate|, round "values" sums the ranks' exact values there (k floats). The aggregate is
exact on those k coordinates and zero elsewhere, and this rank's contribution is its own values there, so with
`--memory residual` (Sketched-SGD's error accumulation) the residual keeps exactly what was not sent, bounded like
top-k's. Tensors too small to gain (r·c + k ≥ d) are summed exactly (round "dense"). Aggregation "custom": the
exchange sums each round, the compressor does the local math (`begin`, `after_sketch`, `after_values`); the
single-process `compress` makes the sketch and this rank's values at the top-k of its own estimate.
Wire: 32 (r·c + k) / d bits per element.

`heavy=0`: the plain one-round sketch, linear and summable, decoded to the dense median estimate (unbiased with one
row). It errs on every coordinate by ~‖g‖/√c, so not with error feedback: the residual accumulates that error (the
dense estimate is not a contraction) and training diverges.
Defaults ratio 0.3, heavy 0.05 (11 bits per element): heavy hitters are found only where they stand above the
sketch's error; at ratio 0.1, heavy 0.01 on digits-mlp the recovered coordinates were nearly random (0.15–0.85 at
lr 0.2, momentum 0.9), at the defaults every algorithm reaches the target (docs/matrix.md). A sketch pays off on
large, heavy-tailed tensors; on small dense ones prefer `topk`. The hashes are cached per (key, size) as int32
table slots (rows·d·4 bytes: 192 MB for 2^24 elements and 3 rows).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._select import largest
from ._sparse import check_ratio, generator, num_kept
from .base import Compressor, Payload, Result, Round, ScratchLock, reused
from .kernels import seed_of


def _median_rows(est: torch.Tensor) -> torch.Tensor:
    """Element-wise median over the rows of `est` (a scratch buffer: rows 0 and 1 are overwritten), as a fresh
    tensor; closed forms for 1–3 rows (a sort over rows is far slower)."""
    if est.shape[0] == 1:
        return est[0].clone()
    if est.shape[0] == 2:
        return torch.add(est[0], est[1]).mul_(0.5)
    if est.shape[0] == 3:
        a, b, c = est
        out = torch.minimum(a, b)                    # median = max(min(a, b), min(max(a, b), c))
        torch.maximum(a, b, out=a)
        torch.minimum(a, c, out=a)
        return torch.maximum(out, a, out=out)
    return est.median(dim=0).values


def next_prime(n: int) -> int:
    """The smallest prime >= n (trial division: c is at most a few million here)."""
    n = max(2, n)
    while any(n % p == 0 for p in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


@compressors.register("countsketch")
class CountSketch(Compressor):
    """Count Sketch (rows × ~ratio·d/rows table, shared hashes); heavy > 0: the exact top heavy·d coordinates of
    the summed sketch's estimate in a second summed round (Sketched-SGD); heavy = 0: one linear, summable payload."""

    randomness = "shared"
    fixed_size = True
    x_memcpy = 8.0

    def __init__(self, ratio: float = 0.3, rows: int = 3, heavy: float = 0.05, seed: int = 0):
        self.ratio = check_ratio(ratio)
        if not isinstance(rows, int) or rows < 1:
            raise UserError(f"rows must be an integer >= 1, got {rows}")
        if not 0 <= heavy <= 1:
            raise UserError(f"countsketch: heavy (the fraction of coordinates recovered exactly, 0 for the plain "
                            f"sketch) must be in [0, 1], got {heavy}")
        self.rows, self.seed, self.heavy = rows, seed, float(heavy)
        if self.heavy > 0:      # two rounds: the sketch, then the exact heavy coordinates (not summable alone)
            self.aggregation, self.linear, self.unbiased = "custom", False, False
            self.rounds = ("sketch", "values")     # ("dense" alone where the tensor is too small to gain)
        else:
            self.unbiased = rows == 1
        self._hashes: dict = {}
        self._layouts: dict = {}
        self._est = torch.empty(0, device="cpu")
        self._est_lock = ScratchLock()       # queried on several threads at once (see Compressor)

    def columns(self, d: int) -> int:
        """c, the table's columns: the first prime >= ratio·d / rows (prime: see `_hash`)."""
        return next_prime(max(1, math.ceil(self.ratio * d / self.rows)))

    def _draws(self, key, d: int):
        """The hash functions' random draws for (key, d), on the host: (c, nb, per row (a_j, b_j, sa_j) and the
        signs sb (rows × c)) when nb <= c, else (c, nb, per row (bucket, sa) of every element, None)."""
        c = self.columns(d)
        nb = max(1, math.ceil(d / c))
        g = generator(self.seed, "countsketch", key, d)
        rows = []
        if nb <= c:
            for _ in range(self.rows):
                a = int(torch.randint(1, c, (1,), generator=g, device=g.device))     # (c >= 2: a prime)
                b = int(torch.randint(c, (1,), generator=g, device=g.device))
                rows.append((a, b, torch.randint(2, (nb, 1), generator=g, device=g.device)))
            signs = torch.randint(2, (self.rows, c), generator=g, device=g.device).float().mul_(-2).add_(1)
            return c, nb, rows, signs
        for _ in range(self.rows):
            sa = torch.randint(2, (nb, c), generator=g, device=g.device)
            rows.append((torch.randint(c, (nb, c), generator=g, device=g.device), sa))
        return c, nb, rows, None

    def _hash(self, key, d: int, device="cpu"):
        """(slots: rows × nb·c int32, signs: rows × c, c, nb), cached per (key, d): the hash functions as one
        index per element into a doubled table [S, −S] per row (the definition; `_sketch` and `_estimate` run
        the block-cyclic ones block by block, and index with these slots only when nb > c).

        Element i = hi·c + lo (the tensor cut into nb blocks of c) goes, in row j, to bucket
        h_j(i) = (lo + a_j·hi + b_j) mod c with sign s_j(i) = sa_j[hi]·sb_j[lo], a_j uniform on [1, c), b_j on
        [0, c), sa, sb uniform ±1. With c prime and nb <= c, any two elements collide with probability
        <= 1/(c − 1) (same block: never; else (hi − hi')·a_j is uniform on the non-zero residues), and the
        product of two different elements' signs has mean 0 independently of the buckets: the pairwise
        independence the Count Sketch bounds use. Each block lands on the table as one cyclic run, so the
        scatter and the gather sweep memory in order. sa is folded into the slot (a doubled table [S, −S] per
        row), sb is one broadcast multiply. When nb > c (tiny sketches) every element gets a random bucket
        and sign instead."""
        got = self._hashes.get((key, d, str(device)))
        if got is None:
            c, nb, draws, signs = self._draws(key, d)
            slots = torch.empty(self.rows, nb, c, dtype=torch.int32, device="cpu")   # built on the host, moved once
            if signs is not None:
                lo = torch.arange(c, dtype=torch.int32, device="cpu").view(1, c)
                hi = torch.arange(nb, device="cpu").view(nb, 1)
                for j, (a, b, sa) in enumerate(draws):
                    t = torch.add(lo, ((a * hi + b) % c).to(torch.int32), out=slots[j])   # lo + (a·hi + b) mod c
                    t.sub_((t >= c).to(torch.int32) * c)                               # ... mod c
                    t.add_((2 * c * j + sa * c).to(torch.int32))                      # row j's [S, −S] slot
            else:
                for j, (bucket, sa) in enumerate(draws):
                    slots[j] = bucket + sa * c + 2 * c * j
            slots = slots.view(self.rows, nb * c)
            got = (slots.to(device), None if signs is None else signs.to(device), c, nb)
            self._hashes[(key, d, str(device))] = got
        return got

    def _blocks(self, key, d: int, device):
        """(c, per row the blocks' (start, length, shift, negated) with shift = (a_j·hi + b_j) mod c, the signs sb
        (rows × c) on `device`), cached per (key, d, device), for nb <= c; None when nb > c."""
        k = (key, d, str(device))
        got = self._layouts.get(k)
        if got is None:
            c, nb, draws, signs = self._draws(key, d)
            if signs is None:
                got = (None,)
            else:
                got = (c, [[(hi * c, min(c, d - hi * c), (a * hi + b) % c, bool(neg))
                            for hi, neg in enumerate(sa.view(-1).tolist())]       # host: the draws, once per key
                           for a, b, sa in draws], signs.to(device))
            self._layouts[k] = got
        return None if got[0] is None else got

    def _sketch(self, flat: torch.Tensor, key) -> torch.Tensor:
        """The r·c table of fp32 `flat` (1-D): S_j = P_j − N_j, P_j (N_j) the sum of the blocks whose sa_j is +1
        (−1), each block times sb_j added onto the table as one cyclic run starting at its shift, in block
        order. So every bucket sums its elements in index order: the same numbers in the same order on every
        device (a scatter-add's atomics on a GPU add in any order, and the heavy hitters then differ)."""
        d = flat.numel()
        got = self._blocks(key, d, flat.device)
        if got is None:                  # random buckets (tiny sketches): summed in float64, which is exact here
            slots, signs, c, nb = self._hash(key, d, flat.device)
            doubled = torch.zeros(self.rows, 2, c, dtype=torch.float64, device=flat.device)
            z = torch.zeros(nb * c, dtype=torch.float64, device=flat.device)
            z[:d] = flat
            for j in range(self.rows):
                doubled.view(-1).index_add_(0, slots[j], z)
            return doubled[:, 0].sub_(doubled[:, 1]).float().reshape(-1)
        c, blocks, signs = got
        sides = torch.zeros(2, self.rows, c, device=flat.device)        # (P, N)
        for j in range(self.rows):
            for start, n, shift, neg in blocks[j]:
                side = sides[int(neg), j]
                first = min(n, c - shift)                             # the run up to the table's end ...
                side[shift:shift + first].addcmul_(flat[start:start + first], signs[j, :first])
                if first < n:                                          # ... and the rest from its start
                    side[:n - first].addcmul_(flat[start + first:start + n], signs[j, first:n])
        return sides[0].sub_(sides[1]).reshape(-1)

    def _dense(self, d: int) -> bool:
        """Heavy recovery of d elements sends r·c + k floats: no gain over the tensor itself."""
        return self.heavy > 0 and self.rows * self.columns(d) + num_kept(self.heavy, d) >= d

    def _heavy(self, table: torch.Tensor, key, d: int) -> torch.Tensor:
        """The k = heavy·d coordinates of largest |estimate| of the sketch `table`, ascending (every rank
        querying the same summed table gets the same ones)."""
        est = self._estimate(table, key, d).abs_()
        return largest(est, num_kept(self.heavy, d), seed_of(self.seed, "countsketch", key, d))

    def begin(self, tensor, key, step, shapes, world_size):
        """(heavy > 0) Round "sketch": this rank's sketch (or, too small to gain, round "dense": the tensor)."""
        flat = tensor.reshape(-1).float()
        if self._dense(flat.numel()):
            return Round("dense", flat.clone(), dict(tensor=tensor))
        return Round("sketch", self._sketch(flat, key), dict(tensor=tensor, flat=flat, key=key))

    def after_dense(self, last, summed):
        tensor = last.state["tensor"]
        return Result(summed.to(tensor.dtype).view(tensor.shape), tensor)

    def after_sketch(self, last, summed):
        """After Σ_ranks sketches: every rank takes the same heavy coordinates of the summed sketch's estimate;
        round "values" sends this rank's exact values there (Sketched-SGD)."""
        s = last.state
        flat = s["flat"]
        idx = self._heavy(summed, s["key"], flat.numel())
        vals = flat[idx]
        local = torch.zeros_like(flat).index_copy_(0, idx, vals)
        return Round("values", vals, dict(s, idx=idx, local=local))

    def after_values(self, last, summed):
        """The sum over ranks, exact on the heavy coordinates and zero elsewhere, and this rank's own values there."""
        s = last.state
        tensor = s["tensor"]
        total = torch.zeros_like(s["flat"]).index_copy_(0, s["idx"], summed)
        return Result(total.to(tensor.dtype).view(tensor.shape), s["local"].to(tensor.dtype).view(tensor.shape))

    def compress(self, tensor, key=None, step=0, agreed=None):
        """The sketch (heavy = 0); with heavy recovery, one rank's own two rounds: the sketch and its exact
        values at the top-k of its own estimate (the single-process form, for benchmarks and tests)."""
        flat = tensor.reshape(-1).float()
        d = flat.numel()
        ctx = (tensor.shape, tensor.dtype, d, key)
        if self._dense(d):
            return Payload([flat.clone()], ctx=ctx)
        table = self._sketch(flat, key)
        if self.heavy > 0:
            return Payload([table, flat[self._heavy(table, key, d)]], ctx=ctx)
        return Payload([table], ctx=ctx)

    def context(self, shape, dtype, key=None, step=0):
        return (torch.Size(shape), dtype, torch.Size(shape).numel(), key)   # the hashes follow (seed, key)

    def decompress(self, payload):
        shape, dtype, d, key = payload.ctx
        if self._dense(d):
            return payload.tensors[0].to(dtype).view(shape)
        table = payload.tensors[0]
        if self.heavy > 0:
            idx = self._heavy(table, key, d)
            out = torch.zeros(d, device=table.device).index_copy_(0, idx, payload.tensors[1].float())
            return out.to(dtype).view(shape)
        return self._estimate(table, key, d).to(dtype).view(shape)

    def _estimate(self, table: torch.Tensor, key, d: int) -> torch.Tensor:
        """ĝ_i = median_j s_j(i) S[j, h_j(i)] for every i (a fresh fp32 tensor)."""
        table = table.reshape(self.rows, -1).float()
        got = self._blocks(key, d, table.device)
        with self._est_lock:
            self._est, est = reused(self._est, self.rows * d, table.device)
            est = est.view(self.rows, d)
            if got is None:
                slots, signs, c, nb = self._hash(key, d, table.device)
                signed = torch.cat([table.view(self.rows, 1, c), -table.view(self.rows, 1, c)], dim=1).view(-1)
                for j in range(self.rows):      # [S_j, -S_j] per row, as the slots index it
                    est[j] = signed.index_select(0, slots[j][:d])
                return _median_rows(est)
            c, blocks, signs = got
            for j in range(self.rows):
                twice = table[j].repeat(2)                         # a cyclic run of the table is one slice of it
                signed = (twice, twice.neg())
                for start, n, shift, neg in blocks[j]:
                    torch.mul(signed[neg][shift:shift + n], signs[j, :n], out=est[j, start:start + n])
            return _median_rows(est)

    def aggregate(self, payloads):
        if self.heavy > 0:        # (gathered: each rank's own heavy coordinates, one by one)
            return super().aggregate(payloads)
        total = payloads[0].tensors[0].reshape(-1).clone()
        for p in payloads[1:]:
            total += p.tensors[0].reshape(-1)
        return self.decompress(Payload([total], payloads[0].ctx))

    def nominal_bits(self, numel):
        """32 r·c / d for the sketch, + 32 k / d for the heavy coordinates' values (32 when too small to gain)."""
        if self._dense(numel):
            return 32.0
        k = num_kept(self.heavy, numel) if self.heavy > 0 else 0
        return 32.0 * (self.rows * self.columns(numel) + k) / max(1, numel)
