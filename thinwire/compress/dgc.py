"""`dgc`: Deep Gradient Compression's sparsifier (Lin, Han, Mao, Wang, Dally 2018, "Deep Gradient
Compression: Reducing the Communication Bandwidth for Distributed Training", arXiv 1712.01887, ICLR 2018).

A threshold estimated by a top-k on a random sample (1% by default) selects about k = ρ·d coordinates of the
whole tensor. More than 1.03k pass: the exact top-k of those is taken, as the paper does ("an exact threshold is
then calculated from the filtered elements"); fewer than 0.97k: the threshold is lowered ×0.7 and re-applied, up
to 10 times (GRACE's refinement of the paper's 0.7k–1.3k band: the 3% band keeps the payload within 3% of its
nominal ρ·d pairs, at the price of the exact step on ~1 call in 5). The count sent is in [0.97k, 1.03k] but for
pathological tensors.

The recipe's warm-up lives here because it sets the density: over the first `warmup_steps` exchanges of a tensor
the density falls 25% → 6.25% → 1.5625% → 0.39% (the paper's warm-up training), then stays at `ratio`.
Momentum correction, masking and local clipping are the `dgc` memory's.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..registry import NON_NEGATIVE
from . import compressors, memories
from ._sparse import SparseCompressor, check_ratio, generator, num_kept
from .base import Memory, optional_momentum
from .threshold import Scratch, reselect, select_beyond


def warmup_density(ratio: float, step: int, warmup_steps: int) -> float:
    """The DGC sparsity warm-up: density 4^-(stage+1) over 4 equal stages of `warmup_steps`, then `ratio`."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return ratio
    stage = min(3, 4 * step // warmup_steps)
    return max(ratio, 0.25 ** (stage + 1))


@compressors.register("dgc")
class DGC(SparseCompressor):
    """DGC sparsification: sampled threshold + refinement (≈ ratio·d sent), with an optional density warm-up."""

    low, high = 0.97, 1.03      # the band of counts kept as they are (see the module docstring)
    limits = {"warmup_steps": NON_NEGATIVE}
    x_memcpy = 12.0

    def __init__(self, ratio: float = 0.01, sample: float = 0.01, warmup_steps: int = 0, seed: int = 0):
        super().__init__(ratio, seed)
        self.sample = check_ratio(sample, "sample")
        self.warmup_steps = int(warmup_steps)
        self._scratch = Scratch()

    def select(self, flat, key, step):
        d = flat.numel()
        k = num_kept(warmup_density(self.ratio, step, self.warmup_steps), d)
        if k >= d:
            return torch.arange(d, device=flat.device)
        s = min(d, max(256, int(self.sample * d)))
        sample = flat if s == d else flat[torch.randint(d, (s,), generator=generator(self.seed, key, step), device="cpu").to(flat.device)]
        ks = max(1, int(k * s / d))
        thr = float(torch.topk(sample.abs(), ks, sorted=False).values.min())
        idx, dev = select_beyond(flat, thr, scratch=self._scratch)
        for _ in range(10):
            if idx.numel() >= self.low * k:
                break
            thr *= 0.7
            idx = reselect(dev, thr, self._scratch) if dev is not None else select_beyond(flat, thr)[0]
        if idx.numel() > self.high * k:
            idx = idx[torch.topk(flat[idx].abs(), k, sorted=False).indices]
        return idx


@memories.register("dgc")
class DGCMemory(Memory):
    """DGC memory, per key: momentum correction, momentum factor masking, local clipping (Lin et al. 2018):
        g ← g · min(1, N^{-1/2} clip_norm / ‖g‖₂)     local gradient clipping (off when 0)
        u ← m u + g                                  momentum correction
        v ← v + u                                    error accumulation; v is what gets compressed
        v ← v − sent;  u ← u ⊙ ¬mask(sent)           after compression: momentum factor masking
    The momentum is inside the memory, so the optimizer runs WITHOUT it: `momentum` unset takes the optimizer's
    where gradients are exchanged (the Trainer hands it over); elsewhere the algorithm applies its own and the
    memory none (with 0.9 here too, CD-SGD + dgc stopped at 0.91 in the matrix). `Memory` in compress/base.py."""

    takes_momentum = True
    state_attrs = ("u", "v")
    default_momentum = 0.0    # not handed over (the algorithm applies its own: CD-SGD, DTS, local SGD): none here

    def __init__(self, momentum: float | None = None, clip_norm: float = 0.0):
        self.momentum = optional_momentum(momentum, "dgc memory momentum")
        if not clip_norm >= 0:
            raise UserError(f"clip_norm must be >= 0 (0 = no clipping), got {clip_norm}")
        self.clip_norm = float(clip_norm)
        self.world_size = 1
        self.u: dict = {}
        self.v: dict = {}

    def setup(self, world_size):
        self.world_size = world_size

    def compensate(self, tensor, key):
        g = tensor
        if self.clip_norm > 0:
            thr = self.clip_norm / math.sqrt(self.world_size)           # local gradient clipping: thr · N^{-1/2}
            norm = float(g.norm())
            if norm > thr:
                g = g * (thr / norm)
        u, v = self.u.get(key), self.v.get(key)
        if u is None or u.shape != g.shape or u.dtype != g.dtype:      # new key, or the bucketing changed
            u, v = torch.zeros_like(g), torch.zeros_like(g)
        u = u.mul(self.momentum_or_default()).add_(g)                   # u ← m u + g
        v = v.add(u)                                                    # v ← v + u
        self.u[key], self.v[key] = u, v
        return v

    def update(self, tensor, key, sent):
        self.v[key] = tensor - sent
        self.u[key] = self.u[key].masked_fill(sent != 0, 0)
