"""`countsketch`: a Count Sketch of the tensor (seed 002 §4.3.3; catalog 3.5 [O]), linear so all-reduce sums it.

r rows × c columns; row j has a bucket hash h_j: [d] → [c] and a sign hash s_j: [d] → {±1}, drawn from a seed
shared by every rank (seed, key); pairwise independent, and structured so that inserting and querying sweep
memory in order (see `_hash`). Insert: S[j, h_j(i)] += s_j(i) g_i; query: ĝ_i = median_j s_j(i) S[j, h_j(i)].
Because S(g₁) + S(g₂) = S(g₁ + g₂), the all-reduced sketch is the sketch of the sum and its query estimates the
sum. Wire size r·c floats (c = the first prime ≥ ratio·d / r), independent of the number of ranks. With one row the estimate
is unbiased; with several the median is not (but is far less noisy). Pair with `--memory residual`.
The hashes are drawn once per (key, size) and cached as int32 table slots (rows·d·4 bytes: 192 MB for 2^24
elements and 3 rows).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors
from ._sparse import check_ratio, generator
from .base import Compressor, Payload


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
    """Count Sketch (rows × ~ratio·d/rows table, shared hashes): linear, summed by all-reduce; median query."""

    linear = True
    randomness = "shared"
    aggregation = "allreduce"
    fixed_size = True

    def __init__(self, ratio: float = 0.1, rows: int = 3, seed: int = 0):
        self.ratio = check_ratio(ratio)
        if not isinstance(rows, int) or rows < 1:
            raise UserError(f"rows must be an integer >= 1, got {rows}")
        self.rows, self.seed = rows, seed
        self.unbiased = rows == 1
        self._hashes: dict = {}
        self._z = torch.empty(0, device="cpu")     # regrown on the gradient's device
        self._est = torch.empty(0, device="cpu")

    def columns(self, d: int) -> int:
        """c, the table's columns: the first prime >= ratio·d / rows (prime: see `_hash`)."""
        return next_prime(max(1, math.ceil(self.ratio * d / self.rows)))

    def _hash(self, key, d: int, device="cpu"):
        """(slots: rows × nb·c int32, signs: rows × c, c, nb), cached per (key, d).

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
            c = self.columns(d)
            nb = max(1, math.ceil(d / c))
            g = generator(self.seed, "countsketch", key, d)
            slots = torch.empty(self.rows, nb, c, dtype=torch.int32, device=g.device)   # built on the host, moved once
            if nb <= c:
                lo = torch.arange(c, dtype=torch.int32, device=g.device).view(1, c)
                hi = torch.arange(nb, device=g.device).view(nb, 1)
                for j in range(self.rows):
                    a = int(torch.randint(1, max(2, c), (1,), generator=g, device=g.device)) % c
                    b = int(torch.randint(c, (1,), generator=g, device=g.device))
                    sa = torch.randint(2, (nb, 1), generator=g, device=g.device)
                    t = torch.add(lo, ((a * hi + b) % c).to(torch.int32), out=slots[j])   # lo + (a·hi + b) mod c
                    t.sub_((t >= c).to(torch.int32) * c)                               # ... mod c
                    t.add_((2 * c * j + sa * c).to(torch.int32))                      # row j's [S, −S] slot
                signs = torch.randint(2, (self.rows, c), generator=g, device=g.device).float().mul_(-2).add_(1)
            else:
                for j in range(self.rows):
                    sa = torch.randint(2, (nb, c), generator=g, device=g.device)
                    slots[j] = torch.randint(c, (nb, c), generator=g, device=g.device) + sa * c + 2 * c * j
                signs = None
            slots = slots.view(self.rows, nb * c)
            got = (slots.to(device), None if signs is None else signs.to(device), c, nb)
            self._hashes[(key, d, str(device))] = got
        return got

    def _signed(self, flat: torch.Tensor, signs: torch.Tensor | None, j: int, c: int, nb: int) -> torch.Tensor:
        """flat · sb_j over nb·c elements (zero past d), in a reused buffer."""
        d = flat.numel()
        if self._z.numel() < nb * c or self._z.device != flat.device:
            self._z = torch.empty(nb * c, device=flat.device)
        z = self._z[: nb * c]
        full = d // c
        if signs is None:
            z[:d].copy_(flat)
        else:
            torch.mul(flat[: full * c].view(full, c), signs[j], out=z[: full * c].view(full, c))
            if full * c < d:
                torch.mul(flat[full * c:], signs[j, : d - full * c], out=z[full * c: d])
        z[d:].zero_()
        return z

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        d = flat.numel()
        slots, signs, c, nb = self._hash(key, d, flat.device)
        doubled = torch.zeros(self.rows, 2, c, device=flat.device)
        for j in range(self.rows):                   # one scatter-add per hash function (rows is small)
            doubled.view(-1).index_add_(0, slots[j], self._signed(flat, signs, j, c, nb))
        table = doubled[:, 0].sub_(doubled[:, 1])    # S[j, b] = sum of s_j(i) g_i over h_j(i) = b
        return Payload([table.reshape(-1)], ctx=(tensor.shape, tensor.dtype, d, key))

    def decompress(self, payload):
        shape, dtype, d, key = payload.ctx
        slots, signs, c, nb = self._hash(key, d, payload.tensors[0].device)
        table = payload.tensors[0].reshape(self.rows, 1, c).float()
        signed = torch.cat([table, -table], dim=1).view(-1)     # [S_j, -S_j] per row, as the slots index it
        if self._est.numel() < self.rows * nb * c or self._est.device != table.device:   # reused: a fresh rows·d tensor page-faults on every call
            self._est = torch.empty(self.rows * nb * c, device=table.device)
        est = self._est[: self.rows * nb * c].view(self.rows, nb * c)
        for j in range(self.rows):
            torch.index_select(signed, 0, slots[j], out=est[j])
            if signs is not None:
                est[j].view(nb, c).mul_(signs[j])
        return _median_rows(est[:, :d]).to(dtype).view(shape)

    def aggregate(self, payloads):
        total = payloads[0].tensors[0].reshape(-1).clone()
        for p in payloads[1:]:
            total += p.tensors[0].reshape(-1)
        return self.decompress(Payload([total], payloads[0].ctx))

    def nominal_bits(self, numel):
        return 32.0 * self.rows * self.columns(numel) / max(1, numel)
