"""Selecting the k largest magnitudes, the same coordinates on every device.

`torch.topk` leaves ties to the implementation, and a CPU and a GPU break them differently; where every rank must
take the same coordinates of the same numbers (the heavy hitters of a summed Count Sketch), `largest` takes every
magnitude above the k-th largest value t and, of those equal to t, the lowest indices: a function of the numbers
alone. On a GPU `torch.topk` finds t (no host read). On the CPU, where a full selection costs ~50 memcpys at
k = 1 %, a hashed sample sets a threshold a little below the k-th magnitude, one pass keeps the few that pass it,
and the selection runs on those (a full `torch.topk` in the rare case the sample overshot: the margin is four
standard deviations of the sample count).
"""
from __future__ import annotations

import math

import torch

from .kernels import BLOCK, cpu_blocks, random_bits, scratch

SMALL = 1 << 15          # below this many elements torch.topk is as fast as anything


def _first_at_threshold(a: torch.Tensor, t: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of a > t plus the lowest-index entries equal to t, k in all (t the k-th largest of `a`)."""
    above = a > t
    at = a == t
    need = k - above.sum()
    return above.logical_or_(at.logical_and_(at.cumsum(0) <= need))


def _nonzero_k(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The k set positions of `mask`, ascending, without a host read where torch can (nonzero_static)."""
    try:
        return torch.nonzero_static(mask, size=k).view(-1)
    except (AttributeError, NotImplementedError, RuntimeError):    # older torch / no kernel for the device
        return torch.nonzero(mask).view(-1)


def largest(a: torch.Tensor, k: int, key: int = 0) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest entries of the 1-D non-negative `a`, ties at the k-th value
    going to the lowest indices: the same on every device. `key` seeds the CPU's sample (it changes the speed
    of finding them, never which)."""
    d = a.numel()
    if k >= d:
        return torch.arange(d, device=a.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=a.device)
    if a.device.type != "cpu" or d <= SMALL or k > d // 16:
        t = torch.topk(a, k, sorted=False).values.min()
        return _nonzero_k(_first_at_threshold(a, t, k), k)
    s = min(d, max(4096, int(64 * d / k)))
    pos = random_bits(key, s, 31, a.device, torch.int64).remainder_(d)
    sample = a.index_select(0, pos)
    expected = k * s / d
    kk = min(s, int(expected + 4 * math.sqrt(expected) + 2))
    t0 = torch.topk(sample, kk, sorted=False).values.min()
    cand = torch.nonzero(a >= t0).view(-1)
    if cand.numel() < k:
        t = torch.topk(a, k, sorted=False).values.min()
        return _nonzero_k(_first_at_threshold(a, t, k), k)
    vals = a.index_select(0, cand)
    t = torch.topk(vals, k, sorted=False).values.min()
    return cand[_first_at_threshold(vals, t, k)]


def beyond_indices(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """Indices (int64, ascending) of |flat| >= thr (> 0): `torch.nonzero` of the mask, on the CPU block by block
    (the mask and |flat| of a block stay in cache; no tensor-sized temporaries), elsewhere at once."""
    n = flat.numel()
    if flat.device.type != "cpu" or n <= BLOCK:
        return torch.nonzero(flat.abs() >= thr).view(-1)
    parts = []
    with cpu_blocks() as next_block:
        for lo in range(0, n, BLOCK):
            next_block()
            x = flat[lo:lo + BLOCK]
            hit = torch.ge(torch.abs(x, out=scratch(x.shape, x.dtype, x.device)), thr,
                           out=scratch(x.shape, torch.bool, x.device))
            parts.append(torch.nonzero(hit).view(-1).add_(lo))
    return torch.cat(parts)
