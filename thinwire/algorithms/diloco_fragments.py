"""Streaming DiLoCo's fragments as `diloco` cuts them (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch", arXiv 2501.18512, §2.2): the model's parameters, flattened in
model order (fragment 0 is the input side), in F consecutive ranges of equal element counts. The paper cuts between
layers of equal size (so does torchft, per module); cutting elements makes every fragment 1/F of the model whatever
its layers, and where the boundaries fall between tensors the fragments are torchft's.

A segment is a parameter's elements in one fragment: the whole parameter, unless a fragment boundary cuts it, then
a 1-D slice of it (a cut parameter must be contiguous); `diloco` keeps θ per segment. A piece is the segments of a
bucket's parameters in one fragment, in the bucket's order: what one exchange carries, under the piece's key (its
error feedback is kept per key). `Fragments(params, F)` holds the boundaries, the segments (`segs`: (parameter,
fragment, lo, hi)) and their indices by parameter and by fragment; `local(k)` is segment k of the worker's own
parameters (a view), `pieces` and `key` a piece's segments and key, `layout` every piece's (key, numel).
"""
from __future__ import annotations

import torch

from ..errors import UserError


def fragment_bounds(total: int, fragments: int) -> list[int]:
    """The F + 1 boundaries of F consecutive element ranges of equal size (±1) over `total` elements."""
    if fragments > total:
        raise UserError(f"diloco fragments must be at most the number of model parameters ({total}), got "
                        f"{fragments}")
    return [total * f // fragments for f in range(fragments + 1)]


def segments(sizes: list[int], bounds: list[int]) -> list[tuple[int, int, int, int]]:
    """(parameter, fragment, lo, hi): each parameter's elements [lo, hi) in each fragment, in model order."""
    out, offset = [], 0
    for i, n in enumerate(sizes):
        for f in range(len(bounds) - 1):
            lo, hi = max(bounds[f], offset), min(bounds[f + 1], offset + n)
            if lo < hi:
                out.append((i, f, lo - offset, hi - offset))
        offset += n
    return out


class Fragments:
    """`params` (in model order) cut into `count` fragments."""

    def __init__(self, params: list, count: int):
        sizes = [p.numel() for p in params]
        self.params, self.count = params, count
        self.bounds = fragment_bounds(sum(sizes), count)
        self.segs = segments(sizes, self.bounds)
        self.by_param: list[list[int]] = [[] for _ in params]          # parameter -> its segments
        self.by_fragment: list[list[int]] = [[] for _ in range(count)]
        for k, (i, f, lo, hi) in enumerate(self.segs):
            p = params[i]
            if hi - lo < p.numel() and not p.is_contiguous():
                raise UserError(f"diloco: a fragment boundary cuts parameter {i} {tuple(p.shape)}, which is not "
                                f"contiguous; use fewer fragments or a contiguous layout")
            self.by_param[i].append(k)
            self.by_fragment[f].append(k)

    def local(self, k: int) -> torch.Tensor:
        """Segment k of the worker's own parameters (a view, shaped like its θ)."""
        i, _, lo, hi = self.segs[k]
        p = self.params[i].detach()
        return p if hi - lo == p.numel() else p.view(-1)[lo:hi]

    def pieces(self, bucket, f: int) -> list[int]:
        """The segments of the bucket's parameters in fragment f, in the bucket's order."""
        return [k for i in bucket.members for k in self.by_param[i] if self.segs[k][1] == f]

    def key(self, bucket, f: int) -> str:
        return bucket.key if self.count == 1 else f"{bucket.key}@{f}"

    def layout(self, buckets) -> list[list[tuple[str, int]]]:
        """Per fragment: (key, numel) of its pieces, bucket by bucket (its elements in backward order)."""
        out: list[list[tuple[str, int]]] = [[] for _ in range(self.count)]
        for bucket in buckets:
            for f in range(self.count):
                n = sum(self.segs[k][3] - self.segs[k][2] for k in self.pieces(bucket, f))
                if n:
                    out[f].append((self.key(bucket, f), n))
        return out
