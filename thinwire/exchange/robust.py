"""Robust aggregation: the exchange's mean over ranks replaced by a rule that one bad replica cannot move anywhere.

The exchange gathers every rank's contribution (decoded where a compressor is set) and `Robust.reduce` combines
the n tensors x_1..x_n (flat, one per rank) into one:

- `median`: the coordinate-wise median, med{x_i}_k = the median of the k-th coordinates (Yin, Chen, Ramchandran,
  Bartlett 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", arXiv 1803.01498,
  Definition 1; Algorithm 1, option I). For an even count, the mean of the two middle values.
- `trimmed`: the coordinate-wise β-trimmed mean (ibid., Definition 2; Algorithm 1, option II): per coordinate the
  b largest and b smallest values removed, the rest averaged. Yin et al. remove a fraction β ≥ α, the fraction of
  bad replicas; here b = ⌈βn⌉ (at least one value per end whenever β > 0), never more than ⌊(n − 1)/2⌋, so one value
  is always left (b = ⌊(n − 1)/2⌋ is the median). `trim` β in (0, 1/2), default 0.25: one of four replicas.
- `clip`: centered clipping (Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust
  Optimization", arXiv 2012.10333, §4, the CC rule): v ← v + (1/n) Σ_i clip_τ(x_i − v), clip_τ(z) = z min(1,
  τ/‖z‖), iterated `CLIP_ITERS` times, starting from the previous aggregate of the same key (the paper starts from
  the last round's; the first exchange of a key, with none yet, starts from the coordinate-wise median). `clip` τ
  > 0; by default (None) twice the median of the ranks' distances ‖x_i − v‖ at each iteration (thinwire's choice:
  the scale of an update differs between models and algorithms, and an honest rank sits near the median distance).

Every rule first rejects a contribution that holds a non-finite value (NaN/Inf) whole; the rule runs over the
rest (all rejected: the mean, NaN, so the non-finite policy sees it). Below 3 ranks no rule can outvote one rank:
the median of 2 values is their mean. `mean` is no `Robust` (`make` returns None): the exchange's usual path.

Counts, for the report (`metrics`): the exchanges reduced, the contributions rejected (non-finite), the ranks
clipped (`clip`: at the last iteration, ‖x_i − v‖ > τ), and per rank the fraction of its coordinates the rule left
out (median, trimmed: outside the kept middle) or the exchanges where it was clipped (`clip`). Every rank computes
the same aggregate from the same gathered contributions, so the counts agree too. The rule runs in the gather's
`then` (local work only); the clipping centre of a key is read and replaced there, and each key's exchanges are
waited for in order, the same on every rank.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ..errors import UserError

AGGREGATES = ("mean", "median", "trimmed", "clip")
DEFAULT_TRIM = 0.25
CLIP_ITERS = 3


def _number(name: str, value, low: float, high: float = math.inf) -> float:
    """`value` (a number or a CLI string) as a float in (low, high): else a one-line UserError."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not (math.isfinite(v) and low < v < high):
        span = f"> {low:g}" if high == math.inf else f"in ({low:g}, {high:g})"
        raise UserError(f"{name} must be a number {span}, got {value!r}")
    return v


def make(aggregate: str = "mean", trim=None, clip=None) -> "Robust | None":
    """The rule `aggregate` names with its parameter (None for the mean); a one-line UserError where a name or a
    value is bad or a parameter belongs to another rule."""
    if aggregate not in AGGREGATES:
        raise UserError(f"unknown aggregate {aggregate!r}; valid: {', '.join(AGGREGATES)}")
    if trim is not None and aggregate != "trimmed":
        raise UserError(f"trim is the trimmed mean's fraction: give it with aggregate=trimmed, not {aggregate}")
    if clip is not None and aggregate != "clip":
        raise UserError(f"clip is centered clipping's radius τ: give it with aggregate=clip, not {aggregate}")
    if aggregate == "mean":
        return None
    return Robust(aggregate, trim=_number("trim", DEFAULT_TRIM if trim is None else trim, 0, 0.5),
                  clip=None if clip is None else _number("clip", clip, 0))


class Robust:
    """One robust rule (`median`, `trimmed` with `trim` β, `clip` with radius `clip` τ or None: adaptive) and its
    counts; `reduce(xs, key)` the aggregate of the ranks' flat contributions (the module docstring)."""

    def __init__(self, rule: str, trim: float = DEFAULT_TRIM, clip: float | None = None):
        self.rule, self.trim, self.clip = rule, trim, clip
        self.centres: dict[Any, torch.Tensor] = {}     # clip: the last aggregate per key
        self._lock = threading.Lock()
        self.exchanges = self.rejected = self.clipped = 0
        self.left: list[float] = []                     # per rank: coordinates left out (median, trimmed) or clips
        self.seen: list[float] = []                     # per rank: coordinates seen (median, trimmed) or exchanges

    def describe(self) -> str:
        return {"median": "median", "trimmed": f"trimmed(β={self.trim:g})",
                "clip": f"clip(τ={'2×median distance' if self.clip is None else f'{self.clip:g}'})"}[self.rule]

    def reduce(self, xs: list[torch.Tensor], key: Any = None) -> torch.Tensor:
        """The aggregate of `xs` (one flat tensor per rank, rank order) by the rule, the ranks' counts updated."""
        x = torch.stack([t.reshape(-1) for t in xs]).float()
        n = x.shape[0]
        ok = torch.isfinite(x).all(dim=1)
        keep = [i for i, good in enumerate(ok.tolist()) if good]   # host: n flags, once per exchange
        left, seen = [0.0] * n, [0.0] * n
        if not keep:
            out = x.mean(dim=0)
        else:
            kept = x[keep] if len(keep) < n else x
            if self.rule == "clip":
                out, clipped = self._clip(kept, key)
            else:
                out, outside = self._order_rule(kept)
            for j, i in enumerate(keep):
                left[i], seen[i] = ((float(clipped[j]), 1.0) if self.rule == "clip" else
                                    (float(outside[j]), float(x.shape[1])))
        with self._lock:
            if len(self.left) < n:
                grow = n - len(self.left)
                self.left += [0.0] * grow
                self.seen += [0.0] * grow
            self.exchanges += 1
            self.rejected += n - len(keep)
            if self.rule == "clip" and keep:
                self.clipped += int(sum(clipped))
            for i in range(n):
                self.left[i] += left[i]
                self.seen[i] += seen[i]
        return out.to(xs[0].dtype)

    def _order_rule(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Median or trimmed mean per coordinate (Yin et al. 2018, Definitions 1 and 2); and per row, the number
        of its coordinates left out of the kept middle."""
        m = x.shape[0]
        if self.rule == "median":
            lo, hi = (m - 1) // 2, m // 2 + 1                # the middle one (odd m) or two (even m)
        else:
            b = min(math.ceil(self.trim * m), (m - 1) // 2)
            lo, hi = b, m - b
        order = x.argsort(dim=0)
        middle = x.gather(0, order[lo:hi]).mean(dim=0)
        out_rows = torch.cat([order[:lo], order[hi:]]).reshape(-1)
        outside = torch.bincount(out_rows, minlength=m).tolist()   # host: m counts, once per exchange
        return middle, outside

    def _clip(self, x: torch.Tensor, key: Any) -> tuple[torch.Tensor, list[bool]]:
        """Centered clipping (Karimireddy et al. 2021, §4): CLIP_ITERS steps of v ← v + mean_i clip_τ(x_i − v)."""
        with self._lock:
            v = self.centres.get(key)
        if v is None or v.shape != x.shape[1:] or v.device != x.device:
            m = x.shape[0]
            s = x.sort(dim=0).values
            v = (s[(m - 1) // 2] + s[m // 2]) / 2             # no previous aggregate: the coordinate-wise median
        over = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        for _ in range(CLIP_ITERS):
            d = x - v
            norms = d.norm(dim=1)
            tau = (2 * norms.median() if self.clip is None else
                   torch.tensor(self.clip, dtype=norms.dtype, device=norms.device))
            scale = torch.clamp(tau / norms.clamp_min(torch.finfo(norms.dtype).tiny), max=1.0)
            v = v + (d * scale[:, None]).mean(dim=0)
            over = norms > tau
        with self._lock:
            self.centres[key] = v.detach().clone()
        return v, over.tolist()   # host: n flags, once per exchange

    # -- the report and state ----------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """The counts so far: `robust_rejected` (contributions with a non-finite value), `robust_clipped` (ranks
        clipped, summed over exchanges), `robust_left_out` (per rank: the fraction of its coordinates left out, or
        of the exchanges where it was clipped)."""
        with self._lock:
            frac = [round(a / b, 4) if b else 0.0 for a, b in zip(self.left, self.seen)]
            return {"robust_rule": self.describe(), "robust_exchanges": self.exchanges,
                    "robust_rejected": self.rejected, "robust_clipped": self.clipped, "robust_left_out": frac}

    def rekey(self) -> None:
        """The keys changed (buckets re-planned): the clipping centres start again from the median."""
        with self._lock:
            self.centres.clear()

    def state_dict(self) -> dict:
        with self._lock:
            return {"centres": {k: v.clone() for k, v in self.centres.items()}}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.centres = {k: v.clone() for k, v in state.get("centres", {}).items()}
