"""A faulty replica, emulated: `faulty="RANK:KIND"` makes rank RANK hand the exchange a corrupted contribution in
place of its own (a diverged worker, a flipped bit, a bug in one machine's stack, a malicious peer), so robust
aggregation (`thinwire.exchange.robust`) can be tried against it.

The corruption happens in one place, where the rank's contribution enters the exchange (`Exchange.program`, after
its own NaN/Inf check: the faulty rank sends what an honest one would refuse), whatever the algorithm sends
through it: bsp's gradient, local SGD's model delta, DiLoCo's pseudo-gradient. KIND:
- `scale`: the update × −10;
- `noise`: a random direction (a Gaussian draw, seeded by the key and the exchange's step) of the update's norm;
- `stale`: the update this rank sent under the same key at the previous exchange (its first: the current one);
- `nan`: every value NaN.
Every other rank is honest; the faulty one receives the aggregate like the others.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch

from ..errors import UserError

KINDS = ("scale", "noise", "stale", "nan")
SCALE = -10.0


def parse(spec) -> tuple[int, str] | None:
    """(rank, kind) of a "RANK:KIND" spec (None: no faulty rank); a one-line UserError where it is malformed."""
    if spec is None:
        return None
    rank, sep, kind = str(spec).partition(":")
    if not sep or not rank.strip().isdigit():
        raise UserError(f"--faulty takes RANK:KIND (e.g. 3:scale), got {spec!r}")
    if kind not in KINDS:
        raise UserError(f"unknown --faulty kind {kind!r}; valid: {', '.join(KINDS)}")
    return int(rank), kind


def check(spec, workers: int, peer: str | None = None) -> None:
    """`spec` well formed and its rank one of `workers` ranks (0..workers−1), and no `peer` (a race's other
    framework, which never runs thinwire's exchange, unless it corrupts the same contributions itself: pass None
    for it) asked to be faulty: else a one-line UserError."""
    got = parse(spec)
    if got is not None and got[0] >= workers:
        raise UserError(f"--faulty rank {got[0]} is not a worker: valid ranks 0..{workers - 1}")
    if got is not None and peer is not None:
        raise UserError(f"--faulty is emulated in thinwire's exchange; {peer!r} does not run it")


class Faulty:
    """The corruption of `kind` on rank `rank`; `corrupt(x, key, step, rank)` the contribution a rank hands on."""

    def __init__(self, spec):
        self.rank, self.kind = parse(spec)
        self.previous: dict[Any, torch.Tensor] = {}    # stale: the last update per key

    def corrupt(self, x: torch.Tensor, key: Any, step: int, rank: int) -> torch.Tensor:
        if rank != self.rank or not x.is_floating_point():
            return x
        if self.kind == "scale":
            return x * SCALE
        if self.kind == "nan":
            return torch.full_like(x, float("nan"))
        if self.kind == "noise":
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(repr((key, step)).encode()))
            # a host generator (the draw does not depend on the device), moved once
            g = torch.randn(x.shape, generator=gen, dtype=torch.float32, device="cpu").to(x.device, x.dtype)
            return g * (x.float().norm() / g.float().norm().clamp_min(1e-30)).to(x.dtype)
        old = self.previous.get(key)                    # stale
        self.previous[key] = x.detach().clone()
        return x if old is None or old.shape != x.shape else old
