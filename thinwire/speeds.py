"""Emulated worker speeds: each worker computes at a factor of the fastest one's speed, step by step.

A worker at speed s (0 < s <= 1) waits out the difference after each step's forward pass, before its backward:
(1/s - 1) x its compute (this step's forward and the last step's backward, both measured; the first backward,
with its one-time work, is not taken for the second step's). It sleeps, burning no CPU; the wait is on its
training clock and a span of its own in the trace (`slow`). Waiting *before* the backward makes the gradients of
a slow worker leave late, as a slow device's would: a synchronous algorithm waits for them, and communication
that overlaps the backward does not hide the slowness.

A profile (`--speeds`, `tw.launch(..., speeds=)`) is one spec or several joined by `@T>` (a change when the
training clock reaches T seconds):
- `1,1,1,0.5`: one factor per worker (the fastest is 1; every factor in (0, 1]);
- `A:B`: two speeds, the first half of the workers at A/max(A, B), the second half at B/max(A, B) (`1:3`);
- a name: `equal`; `one-half` (the last worker at 0.5); `two-speeds` (`1:3`); `stragglers`
  (`stragglers:p=0.02,factor=0.25,steps=10`: every worker, every step, starts with probability p an episode of
  `steps` steps at `factor`; the draws come from a stream seeded by the run's seed and the rank, so a seed
  repeats them);
- `equal@30>one-half`: equal speeds, then from 30 s of training on, one worker at half speed.
`thinwire list` shows the names. A bad spec is a one-line `UserError` before any worker starts.

The hooks (`Slowdown.install`) put the wait into any model: a forward pre-hook notes when a training forward
starts, and a hook on its output's gradient waits at the very start of the backward. A loop that times its own
steps (thinwire's) calls `forward_started`, `backward_starting` and `backward_ended` itself instead.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from .errors import UserError
from .trace import NULL

NAMES = {"equal": "every worker at full speed",
         "one-half": "the last worker at half speed",
         "two-speeds": "two speeds 1:3, half the workers each (the first half slower)",
         "stragglers": "each worker, each step: a 2 % chance of 10 steps at a quarter speed"}
STRAGGLERS = {"p": 0.02, "factor": 0.25, "steps": 10}


@dataclass(frozen=True)
class Segment:
    """One spec of a profile: fixed factors per worker (`factors`, or `ratio` A:B for the two halves, or the last
    worker at `last`), and straggler episodes (`stragglers`: (p, factor, steps))."""
    factors: tuple | None = None
    ratio: tuple | None = None
    last: float | None = None
    stragglers: tuple | None = None

    def factor(self, rank: int, workers: int) -> float:
        if self.factors is not None:
            return self.factors[rank]
        if self.ratio is not None:
            a, b = self.ratio
            return (a if rank < workers // 2 else b) / max(a, b)
        if self.last is not None and rank == workers - 1:
            return self.last
        return 1.0

    @property
    def equal(self) -> bool:
        return (self.stragglers is None and self.ratio is None and self.last is None
                and (self.factors is None or all(f == 1 for f in self.factors)))


@dataclass(frozen=True)
class Profile:
    """A parsed `--speeds` spec: its segments and the training time (s) from which each applies."""
    spec: str
    segments: tuple          # ((start_s, Segment), ...), the first from 0
    workers: int | None      # the worker count its factor lists name (None: any)

    @property
    def equal(self) -> bool:
        return all(seg.equal for _, seg in self.segments)

    def check_workers(self, workers: int) -> None:
        if self.workers is not None and self.workers != workers:
            raise UserError(f"--speeds {self.spec!r} gives {self.workers} factors for {workers} workers")
        if workers < 2 and any(seg.ratio is not None for _, seg in self.segments):
            raise UserError(f"--speeds {self.spec!r}: two speeds need at least 2 workers")

    def segment(self, at_s: float) -> Segment:
        """The segment in force at training time `at_s`."""
        now = self.segments[0][1]
        for start, seg in self.segments:
            if at_s >= start:
                now = seg
        return now

    def factors(self, workers: int, at_s: float = 0.0) -> list[float]:
        """Every worker's fixed factor (stragglers aside) at training time `at_s`."""
        seg = self.segment(at_s)
        return [seg.factor(r, workers) for r in range(workers)]

    def mean_factors(self, workers: int) -> list[float]:
        """Each worker's long-run speed under the first segment (what the planner predicts from). A straggler
        spends a share q = pL / (1 + pL) of its steps in episodes at `factor` (an episode starts only outside one),
        and times per step add up: 1/s = (1 - q)/f + q/(f·factor)."""
        seg = self.segments[0][1]
        out = []
        for r in range(workers):
            f = seg.factor(r, workers)
            if seg.stragglers is not None:
                p, slow, steps = seg.stragglers
                q = p * steps / (1 + p * steps)
                f = 1.0 / ((1 - q) / f + q / (f * slow))
            out.append(f)
        return out


def _number(text: str, what: str, spec: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UserError(f"--speeds {spec!r}: {what} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise UserError(f"--speeds {spec!r}: {what} must be finite, got {text}")
    return v


def _stragglers(text: str, spec: str) -> Segment:
    values = dict(STRAGGLERS)
    rest = text[len("stragglers"):]
    if rest:
        if not rest.startswith(":"):
            raise UserError(f"--speeds {spec!r}: write stragglers:p=P,factor=F,steps=L")
        for item in rest[1:].split(","):
            key, eq, value = item.partition("=")
            if not eq or key not in values:
                raise UserError(f"--speeds {spec!r}: stragglers take p=, factor=, steps= (got {item!r})")
            values[key] = _number(value, key, spec)
    p, factor, steps = values["p"], values["factor"], values["steps"]
    if not 0 <= p <= 1:
        raise UserError(f"--speeds {spec!r}: stragglers' p must be in [0, 1], got {p:g}")
    if not 0 < factor <= 1:
        raise UserError(f"--speeds {spec!r}: stragglers' factor must be in (0, 1], got {factor:g}")
    if steps != int(steps) or not 1 <= steps <= 10 ** 6:
        raise UserError(f"--speeds {spec!r}: stragglers' steps must be a whole number in [1, 1e6], got {steps:g}")
    return Segment(stragglers=(p, factor, int(steps)))


def _segment(text: str, spec: str) -> Segment:
    text = text.strip()
    named = {"equal": Segment(), "one-half": Segment(last=0.5), "two-speeds": Segment(ratio=(1.0, 3.0))}
    if text in named:
        return named[text]
    if text.startswith("stragglers"):
        return _stragglers(text, spec)
    if ":" in text:
        a, _, b = text.partition(":")
        ratio = (_number(a, "a speed", spec), _number(b, "a speed", spec))
        if min(ratio) <= 0:
            raise UserError(f"--speeds {spec!r}: both speeds of A:B must be positive")
        return Segment(ratio=ratio)
    if not text or not (text[0].isdigit() or text[0] == "."):
        raise UserError(f"unknown --speeds profile {text!r}; valid: factors per worker (1,1,1,0.5), two speeds "
                        f"A:B, {', '.join(NAMES)}, or SPEC@SECONDS>SPEC")
    factors = tuple(_number(p, "a speed factor", spec) for p in text.split(","))
    if any(not 0 < f <= 1 for f in factors):
        raise UserError(f"--speeds {spec!r}: every factor must be in (0, 1] (1: the fastest worker's speed)")
    return Segment(factors=factors)


def parse(spec: "str | Profile | None") -> Profile | None:
    """The `Profile` of a `--speeds` spec; None for None, '' and 'equal' (every worker at full speed)."""
    if spec is None or isinstance(spec, Profile):
        return spec
    if not isinstance(spec, str):
        raise UserError(f"--speeds must be a string such as '1,1,1,0.5' or a profile name, got {spec!r}")
    spec = spec.strip()
    if spec in ("", "equal"):
        return None
    parts, segments, start, workers = spec.split(">"), [], 0.0, None
    for i, part in enumerate(parts):
        text, change = part, None
        if i < len(parts) - 1:
            text, at, t = part.rpartition("@")
            if not at:
                raise UserError(f"--speeds {spec!r}: write SPEC@SECONDS>SPEC for a change at a time")
            change = _number(t.strip().removesuffix("s"), "a change time", spec)
        seg = _segment(text, spec)
        if seg.factors is not None:
            if workers is not None and len(seg.factors) != workers:
                raise UserError(f"--speeds {spec!r}: every list must name the same number of workers")
            workers = len(seg.factors)
        segments.append((start, seg))
        if change is not None:
            if change <= start:
                raise UserError(f"--speeds {spec!r}: change times must increase (got {change:g} s after {start:g} s)")
            start = change
    return Profile(spec, tuple(segments), workers)


class Slowdown:
    """One worker's emulated speed under `profile` (see the module doc): `install(model)` puts the wait into the
    model's training steps; `clock` (the loop's training clock, when it sets it) times a change of segment, else
    the time since the first training forward does. `waited_s` totals the waits."""

    def __init__(self, profile: Profile, rank: int, workers: int, seed: int = 0, tracer=None):
        self.profile, self.rank, self.workers = profile, rank, workers
        self.tracer = tracer or NULL
        self.rng = random.Random(f"thinwire-speeds/{seed}/{rank}")   # the straggler draws: a seed repeats them
        self.episode = 0                # steps left in a straggler episode
        self.clock: float | None = None
        self.waited_s, self.steps = 0.0, 0
        self._t0 = self._fwd = self._bwd_start = None
        self._bwd = 0.0                 # the last backward's duration
        self._handles: list = []

    def factor(self) -> float:
        """This step's speed: the segment's factor, times a straggler episode's (one draw per step)."""
        now = self.clock if self.clock is not None else (0.0 if self._t0 is None else time.perf_counter() - self._t0)
        seg = self.profile.segment(now)
        f = seg.factor(self.rank, self.workers)
        if seg.stragglers is not None:
            p, slow, steps = seg.stragglers
            if self.episode > 0:
                self.episode -= 1
                f *= slow
            elif self.rng.random() < p:
                self.episode = steps - 1
                f *= slow
        return f

    # -- the three points of a step --------------------------------------------------------------------
    def forward_started(self) -> None:
        self._fwd = time.perf_counter()
        if self._t0 is None:
            self._t0 = self._fwd

    def backward_starting(self) -> None:
        """Wait out (1/s - 1) x (this forward + the last backward), before any gradient exists."""
        if self._fwd is None:
            return
        f = self.factor()
        now = time.perf_counter()
        wait = (1.0 / f - 1.0) * ((now - self._fwd) + self._bwd)
        self._fwd = None
        if wait > 0:
            with self.tracer.span("slow", "compute", factor=f):
                time.sleep(wait)
            self.waited_s += wait
        self.steps += 1
        self._bwd_start = time.perf_counter()

    def backward_ended(self) -> None:
        if self._bwd_start is not None:
            if self.steps > 1:          # (the first backward's one-time work would over-slow the second step)
                self._bwd = time.perf_counter() - self._bwd_start
            self._bwd_start = None

    # -- hooks -----------------------------------------------------------------------------------------
    def install(self, model: torch.nn.Module) -> "Slowdown":
        """Hook the three points into `model`: a forward pre-hook (a training forward, grad enabled), a hook on the
        gradient of its first output that requires one (the start of the backward) and a hook that fires once
        every parameter's gradient of a backward is computed (its end)."""
        params = [p for p in model.parameters() if p.requires_grad]

        def pre(module, args):
            if torch.is_grad_enabled():
                self.forward_started()

        def post(module, args, out):
            t = _first_grad_tensor(out)
            if t is not None and self._fwd is not None:
                t.register_hook(lambda g: self.backward_starting())

        self._handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
        if params:
            self._handles.append(torch.autograd.graph.register_multi_grad_hook(
                params, lambda grads: self.backward_ended(), mode="all"))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _first_grad_tensor(out):
    """The first tensor requiring grad in a model's output (a tensor, a tuple or list, a dict or a Hugging Face
    `ModelOutput`)."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    items = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        t = _first_grad_tensor(item)
        if t is not None:
            return t
    return None


# -- a launcher's workers: the profile of the run, for every model a Trainer builds in this process ----------
_process: tuple | None = None     # (profile, rank, workers, seed)


def set_process(profile: "Profile | None", rank: int = 0, workers: int = 1, seed: int = 0) -> None:
    """(a launcher, in the worker it started) The speed profile of this process's run (`tw.launch(speeds=)`)."""
    global _process
    _process = None if profile is None else (profile, rank, workers, seed)


def for_process(model: torch.nn.Module, tracer=None) -> Slowdown | None:
    """The process's slowdown installed into `model` (a Trainer's), or None where the run sets no speeds."""
    if _process is None:
        return None
    profile, rank, workers, seed = _process
    return Slowdown(profile, rank, workers, seed, tracer).install(model)
