"""Tensor fusion: gradients grouped into flat buckets in backward order; each gradient is a view of its bucket.

`assign(params, bucket_bytes, first_bucket_bytes)` walks the parameters in backward order (the reverse of their
registration: the forward order of sequential models) and closes a bucket once it holds at least `bucket_bytes`
(Horovod / DDP-style fusion) or the dtype changes; `bucket_bytes=0` gives one bucket per parameter (WFBP).
`Buckets` makes every `p.grad` a view into its bucket's flat buffer (DDP's `gradient_as_bucket_view`): backward
accumulates straight into what goes on the wire, and each parameter is covered once, used in this step or not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tensors import views


def assign(params: list[torch.Tensor], bucket_bytes: float, first_bucket_bytes: float | None = None
           ) -> list[list[int]]:
    """Indices of `params` per bucket, buckets in backward order (the first bucket fills first)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    size = 0
    cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    for i in reversed(range(len(params))):
        p = params[i]
        if cur and (size >= cap or params[cur[-1]].dtype != p.dtype):   # full, or another dtype: closed
            groups.append(cur)
            cur, size, cap = [], 0, bucket_bytes
        cur.append(i)
        size += p.nbytes
    if cur:
        groups.append(cur)
    return groups


def adopt_view(p: torch.Tensor, v: torch.Tensor) -> None:
    """Make `p.grad` the view `v` again (a zero_grad(set_to_none) or a user may have replaced it): copy the
    value in, or zeros if it has none this step."""
    g = p.grad
    if g is None:
        v.zero_()
    elif g.data_ptr() != v.data_ptr():
        v.copy_(g)
    else:
        return
    p.grad = v


@dataclass
class Bucket:
    index: int
    members: list[int]                  # indices into the parameter list, backward order
    buffer: torch.Tensor                # flat, contiguous: the members' gradients
    views: list[torch.Tensor] = field(default_factory=list)   # per member, shaped like the parameter
    params: list[torch.Tensor] = field(default_factory=list)  # the members themselves
    key: str = ""                       # names the bucket's exchange state (residuals follow it)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def shapes(self) -> list[tuple]:
        return [tuple(p.shape) for p in self.params]

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-member tensors (parameters, momentum buffers...) as one flat tensor in the bucket's layout."""
        return torch.cat([t.reshape(-1) for t in tensors])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat tensor in the bucket's layout as per-member views shaped like the parameters."""
        return views(flat, self.params)


class Buckets:
    """Flat bucket buffers for `params` grouped by `groups`; `slot[i] = (bucket index, position)`."""

    def __init__(self, params: list[torch.Tensor], groups: list[list[int]]):
        seen = sorted(i for g in groups for i in g)
        if seen != list(range(len(params))):
            raise ValueError("buckets must cover every parameter exactly once")
        self.params = params
        self.buckets: list[Bucket] = []
        self.slot: list[tuple[int, int]] = [(0, 0)] * len(params)
        for b, members in enumerate(groups):
            ps = [params[i] for i in members]
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            self.buckets.append(Bucket(b, list(members), buf, views=views(buf, ps), params=ps,
                                       key=f"bucket:{members[0]}-{members[-1]}"))
            for k, i in enumerate(members):
                self.slot[i] = (b, k)
        with torch.no_grad():
            for i in range(len(params)):  # adopt existing gradients, then alias them
                self.adopt(i)

    def view(self, i: int) -> torch.Tensor:
        b, k = self.slot[i]
        return self.buckets[b].views[k]

    def adopt(self, i: int) -> None:
        """Make parameter i's gradient its bucket view again."""
        adopt_view(self.params[i], self.view(i))

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)
