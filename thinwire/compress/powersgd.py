"""`powersgd`: rank-r PowerSGD (Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", arXiv 1905.13727, Algorithms 1 and 2).

For each matrix M (a parameter of ndim ≥ 2 reshaped to a × b, after error feedback M = G + e):
    P = M Q            Q warm-started from the previous step (first: N(0,1) from a seed shared by all ranks)
    P ← Σ_ranks P      round "P" (one buffer for every matrix and every uncompressed tensor)
    P̂ = orthogonalise(P)  (column Gram–Schmidt; the scale of P does not matter, so the sum serves as the mean)
    Q = Mᵀ P̂;  Q ← Σ_ranks Q   round "Q"
    mean over ranks ≈ P̂ Qᵀ / n,  this rank's own contribution = P̂ (Mᵀ P̂)ᵀ (what the memory subtracts)
1-D tensors (biases, norms) and matrices too small to gain ((a + b) r ≥ a b) travel uncompressed in round "P";
a flat tensor (bucket, whole model) is split by `shapes`, the parameter shapes it is made of (without them a 1-D
tensor goes uncompressed). Aggregation "custom": the exchange sums each round (`thinwire.exchange.rounds`), the
compressor does the local math (`begin`, `after_P`, `after_Q`). Use with `--memory powersgd` (e ← M − own
contribution: PowerSGD needs EF, as its Algorithm 2 has it, though Wang et al. 2023's survey, Table 1, lists it
without).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors, memories
from ._sparse import generator
from .base import Compressor, Memory, Payload, Result, Round


def orthogonalize(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Column Gram–Schmidt (r columns, r small), in place; eps keeps zero columns finite. Each column is
    orthogonalised twice ("twice is enough"): a nearly dependent column, normalised, would otherwise leave
    P̂ far from orthonormal and P̂P̂ᵀ far from a projection."""
    for i in range(p.shape[1]):
        col = p[:, i]
        for _ in range(2 if i else 1):
            if i:
                prev = p[:, :i]
                col -= prev @ (prev.t() @ col)
            col /= col.norm() + eps
    return p


@compressors.register("powersgd")
class PowerSGD(Compressor):
    """PowerSGD rank-r low-rank compression (two summed rounds, warm start); 1-D tensors uncompressed."""

    unbiased = False
    linear = False
    randomness = "shared"
    aggregation = "custom"
    rounds = ("P", "Q")          # summed over ranks by the exchange; Q only where a matrix is compressed
    state_attrs = ("q",)         # the warm-start Q of each matrix
    x_memcpy = 10.0

    def __init__(self, rank: int = 2, warm_start: bool = True, seed: int = 0):
        if not isinstance(rank, int) or rank < 1:
            raise UserError(f"powersgd rank must be an integer >= 1, got {rank}")
        self.rank, self.warm_start, self.seed = rank, bool(warm_start), seed
        self.q: dict = {}
        self._seen: dict = {}          # numel -> the parameter shapes last compressed (for nominal_bits)

    def _layout(self, numel: int, shape, shapes):
        """(offset, a, b, r) of each compressed matrix; the rest goes uncompressed."""
        shapes = [tuple(shape)] if shapes is None else [tuple(s) for s in shapes]
        if sum(math.prod(s) for s in shapes) != numel:
            raise UserError(f"powersgd: shapes {shapes} do not add up to the tensor's {numel} elements")
        mats, off = [], 0
        for s in shapes:
            n = math.prod(s)
            if len(s) >= 2 and n:
                a, b = s[0], n // s[0]
                r = min(self.rank, a, b)
                if (a + b) * r < a * b:
                    mats.append((off, a, b, r))
            off += n
        return mats

    def _start(self, key, mat, step: int, device) -> torch.Tensor:
        """The Q that matrix `mat` = (offset, a, b, r) starts from: the last step's (warm start), else N(0, 1) drawn
        from a seed shared by all ranks."""
        _, a, b, r = mat
        q = self.q.get((key, *mat)) if self.warm_start else None
        if q is None:   # drawn per matrix shape, not per bucket or offset: the same start whatever the bucketing
            gen = generator(self.seed, "powersgd", a, b, 0 if self.warm_start else step)
            q = torch.randn(b, r, generator=gen, device="cpu").to(device)
        return q

    def begin(self, tensor, key, step, shapes, world_size):
        """Round P's local math: P = M Q for every matrix (Q warm-started), sent in one buffer with the tensors that
        travel uncompressed (1-D ones, matrices too small to gain)."""
        x = tensor.reshape(-1).float()
        mats = self._layout(x.numel(), tensor.shape, shapes)
        self._seen[x.numel()] = [tuple(tensor.shape)] if shapes is None else [tuple(t) for t in shapes]
        dense_mask = torch.ones(x.numel(), dtype=torch.bool, device=x.device)
        ps = []
        for off, a, b, r in mats:
            dense_mask[off:off + a * b] = False
            ps.append(x[off:off + a * b].view(a, b) @ self._start(key, (off, a, b, r), step, x.device))
        dense = x[dense_mask]
        buf = torch.cat([p.reshape(-1) for p in ps] + [dense])
        return Round("P", buf, dict(tensor=tensor, x=x, key=key, mats=mats, dense_mask=dense_mask, dense=dense,
                                    world_size=world_size))

    def after_P(self, last, summed):
        """After Σ_ranks P: orthogonalise each P̂ and take round Q's Mᵀ P̂ (or, with no matrix, the result)."""
        s = last.state
        x, mats, dense_mask = s["x"], s["mats"], s["dense_mask"]
        *p_sums, rest = summed.split([a * r for _, a, _, r in mats] + [s["dense"].numel()])
        total = torch.empty_like(x)
        local = torch.empty_like(x)
        total[dense_mask] = rest
        local[dense_mask] = s["dense"]
        hats = [orthogonalize(p.view(a, r).clone()) for p, (_, a, _, r) in zip(p_sums, mats)]
        q_local = [x[off:off + a * b].view(a, b).t() @ p_hat for p_hat, (off, a, b, _) in zip(hats, mats)]
        if not mats:
            return self._result(s["tensor"], total, local)
        qbuf = torch.cat([q.reshape(-1) for q in q_local])
        return Round("Q", qbuf, dict(s, total=total, local=local, hats=hats, q_local=q_local))

    def after_Q(self, last, summed):
        """After Σ_ranks Q: the mean's low-rank factors P̂ Qᵀ and this rank's own P̂ (Mᵀ P̂)ᵀ; the mean Q is the next
        step's warm start."""
        s = last.state
        total, local, key = s["total"], s["local"], s["key"]
        q_sums = summed.split([b * r for _, _, b, r in s["mats"]])
        for (off, a, b, r), p_hat, ql, q_sum in zip(s["mats"], s["hats"], s["q_local"], q_sums):
            q_sum = q_sum.view(b, r)
            total[off:off + a * b] = (p_hat @ q_sum.t()).reshape(-1)
            local[off:off + a * b] = (p_hat @ ql.t()).reshape(-1)
            self.q[(key, off, a, b, r)] = q_sum / s["world_size"]       # warm start from the mean Q
        return self._result(s["tensor"], total, local)

    @staticmethod
    def _result(tensor, total, local):
        return Result(total.to(tensor.dtype).view(tensor.shape), local.to(tensor.dtype).view(tensor.shape))

    def compress(self, tensor, key=None, step=0, agreed=None):
        """One rank's own low-rank payload [P̂, Q] (or [tensor] when not compressible): the single-process
        form, for benchmarks and tests; across ranks the exchange runs the rounds (`begin`, `after_P`, `after_Q`)."""
        mats = self._layout(tensor.numel(), tensor.shape, None)
        self._seen[tensor.numel()] = [tuple(tensor.shape)]
        if not mats:
            return Payload([tensor.reshape(-1)], ctx=(tensor.shape, tensor.dtype, None))
        _, a, b, r = mats[0]
        m = tensor.reshape(a, b).float()
        p_hat = orthogonalize(m @ self._start(key, mats[0], step, m.device))
        q = m.t() @ p_hat
        if self.warm_start:
            self.q[(key, 0, a, b, r)] = q
        return Payload([p_hat, q], ctx=(tensor.shape, tensor.dtype, (a, b, r)))

    def context(self, shape, dtype, key=None, step=0):
        mats = self._layout(torch.Size(shape).numel(), shape, None)
        return (torch.Size(shape), dtype, mats[0][1:] if mats else None)

    def decompress(self, payload):
        shape, dtype, dims = payload.ctx
        if dims is None:
            return payload.tensors[0].to(dtype).view(shape)
        a, b, r = dims
        p_hat, q = (t.reshape(-1) for t in payload.tensors)
        return (p_hat.view(a, r) @ q.view(b, r).t()).to(dtype).view(shape)

    def nominal_bits(self, numel, shapes=None):
        """Bits per element of the tensor's layout: 32 (a + b) r for each compressed a × b matrix (P and Q) plus
        32 for each element that travels uncompressed (1-D tensors, matrices too small to gain). `shapes`: the
        parameter shapes the tensor is made of; by default those of the last tensor of `numel` elements this
        compressor compressed, else (never seen) one square matrix."""
        if shapes is None:
            shapes = self._seen.get(numel)
        if shapes is None:
            side = max(1, math.isqrt(numel))
            shapes = [(side, numel // side)] + ([(numel - side * (numel // side),)] if numel % side else [])
        mats = self._layout(numel, (numel,), shapes)
        dense = numel - sum(a * b for _, a, b, _ in mats)
        return 32.0 * (dense + sum((a + b) * r for _, a, b, r in mats)) / max(1, numel)

    def regroup(self, key, pieces) -> None:
        """A bucket `key` made of `pieces` = [(old key, lo, hi)] in order (a DDP bucket rebuild): the warm-start Q
        of each matrix that starts in a piece follows it to `key` at its new offset (the old entries stay)."""
        at, moved = 0, {}
        for old, lo, hi in pieces:
            for (k, off, a, b, r), q in self.q.items():
                if k == old and old is not None and lo <= off < hi:
                    moved[(key, at + off - lo, a, b, r)] = q
            at += hi - lo
        self.q.update(moved)

    def rekey(self, old, new):
        """The buckets changed: each matrix's warm-start Q follows its elements to the new bucket and offset."""
        starts, at = {}, 0
        for k, n in old:
            starts[k], at = at, at + n
        bounds, at = [], 0
        for k, n in new:
            bounds.append((at, at + n, k))
            at += n
        moved = {}
        for (key, off, a, b, r), q in self.q.items():
            if key not in starts:
                moved[(key, off, a, b, r)] = q
                continue
            pos = starts[key] + off
            lo, _, k = next(t for t in bounds if t[0] <= pos < t[1])
            moved[(k, pos - lo, a, b, r)] = q
        self.q = moved


@memories.register("powersgd")
class PowerSGDMemory(Memory):
    """PowerSGD's error feedback: M = G + e is compressed; e ← M − (this rank's low-rank contribution)."""

    state_attrs = ("e",)

    def __init__(self):
        self.e: dict = {}

    def compensate(self, tensor, key):
        e = self.e.get(key)
        if e is None or e.shape != tensor.shape or e.dtype != tensor.dtype:
            return tensor
        return tensor + e

    def update(self, tensor, key, sent):
        self.e[key] = tensor - sent
