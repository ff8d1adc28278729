"""`threshold`: every coordinate with |g_i| ≥ v (Threshold-v: Dutta et al. 2020, "On the Discrepancy between
the Theoretical Analysis and Practical Implementations of Compressed Communication for Distributed Deep Learning",
arXiv 1911.08250, AAAI 2020). O(d), no sorting, but the number sent varies with the gradient's scale (sizes are
exchanged before the gather). Biased: use `--memory residual`.

The default v = 0.01 is set for gradients, not unit-variance data: it keeps 2–5% of a fresh `digits-mlp` /
`digits-cnn` / `mnist1d-cnn` gradient (v = 0.001 kept ~50%: no saving), none of `wide-mlp`'s at first (the
residual accumulates them), 99% of N(0, 1). Where the (value, index) pairs would outweigh the tensor, it sends
the tensor with the others zeroed (`dense_payload`): never more bytes than no compression.

`select_beyond` (the mask |g − c| ≥ v and its indices), shared with `dgc` and `gaussiank`: |g − c| and the mask
in reused buffers, the indices from `nonzero` over the mask read as int64 words (8 flags each: 8× fewer elements
to scan), then over the 8 flags of each non-zero word only.
"""
from __future__ import annotations

from statistics import NormalDist

import torch

from ..errors import UserError
from . import compressors
from ._sparse import SparseCompressor, beyond, dense_pays, dense_payload, sparse_payload
from .base import reused
from .kernels import fresh, host_read

SMALL = 1 << 16       # below this, the plain mask + nonzero is as fast


class Scratch:
    """Reused buffers for |g − c| and its mask (fresh 64 MB tensors page-fault on every call)."""

    def __init__(self):
        self.dev = torch.empty(0, device="cpu")     # regrown on the requested device
        self.mask = torch.empty(0, dtype=torch.bool, device="cpu")

    def get(self, n: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        self.dev, dev = reused(self.dev, n, device)
        self.mask, mask = reused(self.mask, n, device)
        return dev, mask


_FULL = 0x0101010101010101      # an int64 word of 8 set bool flags


def mask_indices(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the set flags of a 1-D bool `mask`. Sparse masks: sorted int64, as `torch.nonzero` gives them.
    Dense masks (most 8-flag words set): int32, the words whose 8 flags are all set first (8 consecutive indices
    each, no scan), then the others' — a permutation of the sorted list (no int64 list to cast, no concatenation)."""
    n = mask.numel()
    n8 = n - n % 8
    words = mask[:n8].view(torch.int64)
    hit = torch.nonzero(words).squeeze(1)
    tail = torch.nonzero(mask[n8:]).squeeze(1) + n8 if n8 < n else None
    if 4 * hit.numel() <= words.numel():       # sparse: scan the 8 flags of the non-zero words only
        flags = mask[:n8].view(-1, 8).index_select(0, hit).view(-1)
        idx = (hit.unsqueeze(1) * 8 + torch.arange(8, device=mask.device)).view(-1)[flags]
        return idx if tail is None else torch.cat([idx, tail])
    full = words.index_select(0, hit) == _FULL
    whole = hit[full].to(torch.int32).mul_(8).unsqueeze(1)
    some = hit[~full]
    flags = mask[:n8].view(-1, 8).index_select(0, some).view(-1)
    part = (some.unsqueeze(1) * 8 + torch.arange(8, device=mask.device)).view(-1)[flags]
    f8 = 8 * whole.shape[0]
    nt = 0 if tail is None else tail.numel()
    out = torch.empty(f8 + part.numel() + nt, dtype=torch.int32, device=mask.device)       # written in place: no concatenation
    torch.add(whole, torch.arange(8, dtype=torch.int32, device=mask.device), out=out[:f8].view(-1, 8))
    out[f8: f8 + part.numel()] = part
    if nt:
        out[f8 + part.numel():] = tail
    return out


def mask_count(mask: torch.Tensor) -> torch.Tensor:
    """How many flags of a 1-D bool `mask` are set, as a 0-d int64 tensor: each int64 word of 8 flags times
    0x0101…01 carries their sum (at most 8: no carry) in its top byte (a bool tensor's own sum is ~10x slower)."""
    n8 = mask.numel() - mask.numel() % 8
    count = mask[:n8].view(torch.int64).mul(_FULL).bitwise_right_shift_(56).sum()
    return count + mask[n8:].sum() if n8 < mask.numel() else count


def select_beyond(flat: torch.Tensor, thr: float, center: float = 0.0,
                  scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indices of |flat − center| ≥ thr (≠ center when thr ≤ 0; see `mask_indices` for their order and type),
    the buffer holding |flat − center| or None). The buffer lets a caller re-threshold without recomputing it (valid until the next call)."""
    n = flat.numel()
    if n < SMALL or flat.dtype != torch.float32 or scratch is None:
        return torch.nonzero(beyond(flat, thr, center)).squeeze(1), None
    dev = scratch.get(n, flat.device)[0]
    if center:
        torch.sub(flat, center, out=dev).abs_()
    else:
        torch.abs(flat, out=dev)
    return reselect(dev, thr, scratch), dev


def beyond_mask(dev: torch.Tensor, thr: float, scratch: Scratch) -> torch.Tensor:
    """dev ≥ thr (dev > 0 when thr ≤ 0) into the scratch's reused mask, for a |flat − center| buffer."""
    mask = scratch.get(dev.numel(), dev.device)[1]
    return torch.ge(dev, thr, out=mask) if thr > 0 else torch.gt(dev, 0, out=mask)


def reselect(dev: torch.Tensor, thr: float, scratch: Scratch) -> torch.Tensor:
    """Indices of dev ≥ thr for the |flat − center| buffer that `select_beyond` returned."""
    return mask_indices(beyond_mask(dev, thr, scratch))


@compressors.register("threshold")
class Threshold(SparseCompressor):
    """Threshold-v sparsification: send g_i where |g_i| ≥ v, as (values, indices)."""
    x_memcpy = 8.0

    def __init__(self, threshold: float = 0.01):
        if not threshold >= 0:
            raise UserError(f"threshold must be >= 0, got {threshold}")
        self.threshold = float(threshold)
        self._scratch = Scratch()

    def select(self, flat, key, step):
        if self.threshold == 0:                        # v = 0 keeps everything (exact zeros included)
            return torch.nonzero(flat == flat).squeeze(1)
        return select_beyond(flat, self.threshold, scratch=self._scratch)[0]

    def compress(self, tensor, key=None, step=0, agreed=None):
        """Large fp32 tensors: one pass makes the mask |g| ≥ v and counts it (one host read of the count); then
        the (value, index) pairs, or, where they would outweigh the tensor (most entries pass), the tensor with
        the others zeroed in a second pass (`dense_payload`)."""
        flat = tensor.reshape(-1)
        n = flat.numel()
        if n < SMALL or flat.dtype != torch.float32 or self.threshold == 0:
            return super().compress(tensor, key, step)
        ctx = (tensor.shape, tensor.dtype, n)
        mask = beyond_mask(torch.abs(flat, out=self._scratch.get(n, flat.device)[0]), self.threshold, self._scratch)
        if self.dense_ok and dense_pays(int(host_read(mask_count(mask))), flat):
            zero = torch.zeros((), dtype=flat.dtype, device=flat.device)
            return dense_payload(torch.where(mask, flat, zero, out=fresh(n, flat.dtype, flat.device)), ctx)
        return sparse_payload(flat, mask_indices(mask), ctx)

    def nominal_bits(self, numel):
        """Bits per element for N(0, 1) entries (the benchmark's input): P(|Z| ≥ v) · (32 + index bits), or 32
        where that is more (the dense payload). The real payload depends on the data's scale: Threshold-v
        fixes v, not the count."""
        keep = 2 * NormalDist().cdf(-self.threshold)
        return min(32.0, self.sparse_bits(keep * numel, numel))
