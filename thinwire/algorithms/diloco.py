"""`diloco`: DiLoCo and Streaming DiLoCo — inner steps with the user's optimizer, an outer optimizer on the
averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105, Algorithm 1), on worker i, outer step t:
    θ_i ← θ^(t-1);  H times: θ_i ← InnerOpt(θ_i, ∇L(x ~ D_i))          (lines 3-8: the user's optimizer, AdamW
                                                                     typically; its state stays on the worker)
    Δ^(t) = (1/k) Σ_i (θ^(t-1) − θ_i)                                  (line 12: the averaged outer gradient)
    θ^(t) = OuterOpt(θ^(t-1), Δ^(t))                                   (line 14: default SGD, lr 0.7, Nesterov
                                                                     momentum 0.9, as in the paper)
θ^(t) (the "anchor") is kept identically on every worker, with the outer optimizer's state. The average of the
pseudo-gradients travels through the trainer's `Exchange`, so any compressor and error-feedback memory applies
to it (fp8 / fp4 as Streaming DiLoCo and INTELLECT-1 send it, DeMo, SparseLoCo: `--memory sparseloco` is an
error-feedback buffer in place of outer momentum, so pair it with `outer_momentum=0`).

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed
Free Lunch", arXiv 2501.18512, Algorithm 1 and §2.2–2.4) are three options of the same algorithm:
- `fragments` F: the parameters cut into F fragments of equal element counts (`diloco_fragments`); fragment p is
  synced every H steps, the fragments staggered: one sync every K = H/F steps, fragments 0, 1, ..., F−1, 0, ...
  (§2.2). The peak bytes per sync fall by F, the average stays that of DiLoCo.
- `overlap` τ: the fragment's pseudo-gradient is taken (and its average starts) τ inner steps before the step
  that ends its period; the worker goes on training meanwhile and waits for the average only at that step
  (§2.3). 0 ≤ τ < K, so at most one fragment is in flight.
- `alpha` α: when the average arrives the fragment's outer step gives θ̃_p, and the worker's fragment becomes
  θ_p ← α θ_p,local + (1 − α) θ̃_p (§2.3; α = 0: the global parameters, as DiLoCo). The next pseudo-gradient of
  the fragment is again taken against θ̃_p.
- outer gradients in low precision with fp32 accumulation (§2.4): `compressor="fp8"` or `"fp4"` (all-gathered,
  each contribution decoded and summed in fp32 by the compressor).
With F = 1, τ = 0, α = 0 this is DiLoCo. The schedule (the step that takes fragment p's pseudo-gradient, the step
that merges it) is torchft's `DiLoCo(..., sync_every=H, fragment_sync_delay=τ, fragment_update_alpha=α)`.
Three variants are helpers the class holds (None where off): `eager=True`, eager updates (`EagerRounds`,
`diloco_eager`); `replicas="island"`, one replica per island of a two-tier network (`IslandReplica`,
`diloco_islands`); and `dynamic=True` (or fixed relative `rates`), each worker's inner steps per round following
its speed, merged weighted by samples (`DynamicRounds`, `diloco_dynamic`): workers of different speeds then wait
for no one.

Like `localsgd`, on a step that takes a pseudo-gradient each bucket's inner step is taken as soon as backward
hands the bucket over, and the pseudo-gradient of its piece (its elements in the syncing fragment) starts
averaging at once, overlapped with the rest of backward. θ is kept per segment, exchange state per piece,
following a re-plan of the buckets (MG-WFBP). The outer optimizer steps the segments, so any element-wise
torch.optim optimizer works (a shape-aware one sees a cut parameter as 1-D slices).

`close()` first merges a sync in flight, then takes one last outer step of every fragment whose parameters moved
since its last merge into θ (as at the end of a period) and leaves every worker with θ: the same model everywhere.
Outer optimizer: SGD(outer_lr, outer_momentum, nesterov) with `torch.optim.SGD` semantics (nesterov is plain
momentum when outer_momentum = 0), or `outer_optimizer=` a callable building any torch.optim optimizer from the
list of θ tensors, or the name of a torch.optim class (CLI: `--outer-optimizer adam`, built with lr=outer_lr).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Callable

import torch

from ..comm.engine import Ready
from ..errors import UserError
from ..optim import step_subset
from ..tensors import copy_each, views
from ._registry import register
from .base import Algorithm, int_at_least
from .bsp import wait_buckets
from .cost import CostFamily
from .diloco_dynamic import DynamicRounds
from .diloco_eager import EagerRounds
from .diloco_fragments import Fragments
from .diloco_islands import IslandReplica, island_groups
from .diloco_members import Membership
from .diloco_outer import PAPER as DEFAULT_OUTER, outer_settings


def _check_options(period, outer_lr, outer_momentum, alpha, fragments, overlap, eager, replicas) -> None:
    """A UserError naming the first of `DiLoCo`'s parameters that is out of range or conflicts with another."""
    for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("overlap", overlap, 0)):
        int_at_least(f"diloco {name}", value, low)
    if period % fragments:
        raise UserError(f"diloco period H={period} must be a multiple of fragments F={fragments} (one fragment "
                        f"is synced every H/F steps); e.g. period={fragments * max(1, period // fragments)}")
    if overlap >= period // fragments:
        raise UserError(f"diloco overlap τ={overlap} must be below H/F={period // fragments} (a fragment's "
                        f"average arrives before the next fragment's sync starts); "
                        f"valid: 0..{period // fragments - 1}")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise UserError(f"diloco outer_lr must be a finite number > 0, got {outer_lr!r}")
    if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
        raise UserError(f"diloco outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise UserError(f"diloco alpha must be in [0, 1] (θ ← α θ_local + (1 − α) θ_global), got {alpha!r}")
    if replicas not in ("worker", "island"):
        raise UserError(f"diloco replicas must be worker (every worker a DiLoCo replica) or island (every island "
                        f"of a two-tier network one, data parallel inside), got {replicas!r}")
    if not isinstance(eager, bool):
        raise UserError(f"diloco eager must be true or false, got {eager!r}")
    if eager and (overlap or alpha):
        raise UserError(f"diloco eager hides a fragment's sync behind a whole period (its average is applied "
                        f"one round later): give overlap=0 and alpha=0 with it, got overlap={overlap}, "
                        f"alpha={alpha}")


def _outer_factory(outer_optimizer, outer_lr: float, outer_momentum: float, nesterov: bool) -> Callable:
    """params -> the outer optimizer (validated at construction; called at setup)."""
    if outer_optimizer is None or (isinstance(outer_optimizer, str) and outer_optimizer.lower() == "sgd"):
        # torch.optim.SGD: b ← μ b + Δ; θ ← θ − lr (Δ + μ b) with Nesterov, θ ← θ − lr b without
        return lambda params: torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum,
                                              nesterov=bool(nesterov) and outer_momentum > 0)
    if isinstance(outer_optimizer, str):
        classes = {name.lower(): cls for name, cls in vars(torch.optim).items()
                   if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                   and cls is not torch.optim.Optimizer and name != "LBFGS"}
        cls = classes.get(outer_optimizer.lower())
        if cls is None:
            raise UserError(f"unknown outer optimizer {outer_optimizer!r}; valid: {', '.join(sorted(classes))} "
                            f"(or a callable building one from the parameters)")
        return lambda params: cls(params, lr=outer_lr)
    if not callable(outer_optimizer):
        raise UserError(f"outer_optimizer must be a torch.optim class name or a callable params -> optimizer, "
                        f"got {type(outer_optimizer).__name__}")
    return outer_optimizer


def _rates(rates) -> list[float] | None:
    """`rates` (fixed relative speeds, one per worker: "1,1,1,0.5" or a list) as floats, or None."""
    if rates is None:
        return None
    parts = rates.split(",") if isinstance(rates, str) else list(rates)
    try:
        out = [float(r) for r in parts]
    except (TypeError, ValueError):
        raise UserError(f"diloco rates must be relative speeds per worker, e.g. 1,1,1,0.5; got {rates!r}") from None
    if not out or not all(math.isfinite(r) and r > 0 for r in out):
        raise UserError(f"diloco rates must be positive and finite, got {rates!r}")
    return out


class _SyncClock:
    """When a fragment's sync began, and when each of its pieces was delivered (a done-callback per piece)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.done = [self.t0]       # (list.append: safe from the engine's threads)

    def watch(self, fut) -> None:
        fut.add_done_callback(lambda _fut: self.done.append(time.perf_counter()))

    def elapsed(self) -> float:
        return max(self.done) - self.t0


@register("diloco")
class DiLoCo(Membership, Algorithm):
    """DiLoCo (Douillard et al. 2023, Alg. 1): H inner steps, averaged pseudo-gradient, outer Nesterov SGD;
    Streaming DiLoCo (2025) with fragments, overlap τ and mixing α."""

    survives_failures = True   # θ and the outer optimizer are replicated; the mean over fewer workers stays a mean
    keeps_local_work = True    # a survivor's inner steps go into the next sync
    cost = CostFamily("diloco", pace_with=(("dynamic", "rounds"), ("rates", "rounds")))
    rounds: DynamicRounds | None = None   # dynamic local updates (set at setup)

    def __init__(self, period: int = 50, outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool | None = None, outer_optimizer=None, fragments: int = 1, overlap: int = 0,
                 alpha: float = 0.0, eager: bool = False, replicas: str = "worker", dynamic: bool = False,
                 rates: str | None = None, architecture: str | None = None):
        super().__init__(architecture)
        # the outer SGD's unset settings: the paper's until setup, where they follow the inner optimizer and H
        given = {k: v for k, v in zip(DEFAULT_OUTER, (outer_lr, outer_momentum, nesterov)) if v is not None}
        outer_lr, outer_momentum, nesterov = {**DEFAULT_OUTER, **given}.values()
        self._outer_given = given if outer_optimizer is None or str(outer_optimizer).lower() == "sgd" else None
        _check_options(period, outer_lr, outer_momentum, alpha, fragments, overlap, eager, replicas)
        self.rates = _rates(rates)
        self.dynamic = bool(dynamic) or self.rates is not None
        if self.dynamic and (eager or replicas == "island"):
            raise UserError("diloco dynamic (inner steps per round following each worker's speed) runs with "
                            "replicas=worker and without eager updates")
        if self.dynamic:        # workers take different numbers of steps: they stop together at a merge
            self.pace, self.survives_failures = "round", False
        if outer_optimizer is not None and not isinstance(outer_optimizer, str) and given:
            raise UserError(f"give outer_optimizer or {', '.join(given)}, not both (the callable builds the "
                            f"whole outer optimizer)")
        self.replicas = replicas
        self.period, self.fragments, self.overlap, self.alpha = period, fragments, overlap, float(alpha)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.outer_spec = outer_optimizer if isinstance(outer_optimizer, str) or outer_optimizer is None \
            else getattr(outer_optimizer, "__name__", "callable")
        self._make_outer = _outer_factory(outer_optimizer, self.outer_lr, self.outer_momentum, self.nesterov)
        self.eager = eager
        self.overlaps_steps = overlap > 0 or eager   # a fragment's average is waited τ (eager: H) steps later

    # -- wiring ----------------------------------------------------------------------------------------
    # an outer gradient is averaged once per period (digits-mlp: 6 times in 330 steps), too few rounds for error
    # feedback to deliver what these leave out at their defaults (measured, docs/matrix.md): rank 2 PowerSGD 0.61,
    # rank 4 0.96; qsparse at 1 % 0.93, at 5 % 0.96
    _OUTER_MINIMUM = {"powersgd": ("rank", 4, "PowerSGD's rank"), "qsparse": ("ratio", 0.05, "qsparse's ratio")}

    def check_components(self, compressor, memory):
        super().check_components(compressor, memory)
        attr, least, what = self._OUTER_MINIMUM.get(compressor.name, (None, None, None))
        if attr is not None and getattr(compressor, attr) < least:
            raise UserError(f"diloco averages an outer gradient only once per period, too rarely for error feedback "
                            f"to make up for {what} {getattr(compressor, attr):g}: pass --{attr} {least:g} or more "
                            f"(or fp8/fp4, Streaming DiLoCo's outer-gradient compressors)")

    @property
    def inner_state_own(self) -> bool:
        """Each worker's inner optimizer is its own (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1), a
        newcomer's inner model θ (`take_newcomer_state`); not on islands, whose workers step their inner model
        together."""
        return self.replicas == "worker"

    def setup(self):
        groups = island_groups(self.transport) if self.replicas == "island" else None
        self.island: IslandReplica | None = None
        if groups is None:
            self.exchange = self.make_exchange()
        else:       # the outer sync among the islands' j-th workers; the inner steps' gradients inside the island
            self.island, column = groups
            self.exchange = self.ctx.exchange(self.exchange_class, transport=column)
            self.inner = self.ctx.exchange(self.exchange_class, "none", "none", transport=self.island.inside)
            self._exchanges += [self.exchange, self.inner]
            self.grads: dict = {}       # bucket index -> the future of its mean gradient over the island
            self.lands_in_backward = True     # the island's mean gradient in p.grad when backward returns
        self.frags = Fragments(self.params, self.fragments)
        # θ per segment (a parameter's elements in one fragment): the same on every worker
        self.anchor = [self.frags.local(k).clone() for k in range(len(self.frags.segs))]
        if self._outer_given is not None:      # the outer SGD: the settings left unset follow the run (diloco_outer)
            outer = outer_settings(self.optimizer, self.period, self._outer_given, warn=self.rank == 0)
            self.outer_lr, self.outer_momentum, self.nesterov = (outer[k] for k in DEFAULT_OUTER)
            self._make_outer = _outer_factory(None, self.outer_lr, self.outer_momentum, self.nesterov)
        self.outer = self._make_outer(self.anchor)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise UserError(f"outer_optimizer must build a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.steps = 0                      # inner steps taken
        self.syncs = 0                      # fragment syncs merged (outer steps of one fragment)
        self._pending: list = []            # (segments, future of their mean pseudo-gradient) in flight
        self._pending_fragment: int | None = None
        self._dirty = [False] * self.fragments   # the fragment's parameters differ from θ
        self._sync_clock: _SyncClock | None = None
        self.sync_times: list[float] = []   # each fragment sync, from its first piece's start to its last's delivery
        self.eager_rounds = EagerRounds(self.frags, self.anchor, self.outer, self.exchange, self.sync_times,
                                        self.island and self.island.replicas) if self.eager else None
        if self.rates is not None and len(self.rates) != self.world_size:
            raise UserError(f"diloco rates gives {len(self.rates)} speeds for {self.world_size} workers")
        self.rounds = DynamicRounds(self.transport, self.period, self.fragments, self.overlap, self.rates) \
            if self.dynamic else None

    def attach(self, ctx) -> None:
        super().attach(ctx)
        self._layout = self._piece_layout()

    # -- the schedule (Streaming DiLoCo Alg. 1; F = 1, τ = 0 is DiLoCo's every H steps) -------------------
    def starting(self, step: int) -> int | None:
        """The fragment whose pseudo-gradient step `step` (1-based) takes, or None: the one merged τ steps later."""
        return self.rounds.starting(step) if self.rounds is not None else self.merging(step + self.overlap)

    def merging(self, step: int) -> int | None:
        """The fragment whose average step `step` waits for and merges, or None."""
        if self.rounds is not None:
            return self.rounds.merging(step)
        k = self.period // self.fragments
        return None if step % k else (step // k - 1) % self.fragments

    # -- the step --------------------------------------------------------------------------------------
    def on_bucket(self, bucket):
        if self.island is not None:     # data parallel inside the island: the bucket's mean gradient starts
            self.grads[bucket.index] = self.inner.start(bucket.buffer, bucket.key, shapes=bucket.shapes, inplace=True)
            return
        f = self.starting(self.steps + 1)
        if f is None:
            return
        # the bucket's inner step now (its gradients are final), then its pseudo-gradient starts averaging
        self.optimizer_step(bucket.params)
        self._start(bucket, f)

    def land(self):
        wait_buckets(self.grads, self.scheduler.buckets)

    def _start(self, bucket, f: int) -> None:
        piece = self.frags.pieces(bucket, f)
        if not piece:
            return
        with torch.no_grad():      # Δ_i = θ − θ_i (DiLoCo Alg. 1 line 12), in the bucket's order
            delta = torch.cat([(self.anchor[k] - self.frags.local(k)).reshape(-1) for k in piece])
            if self.rounds is not None:     # weighted by the samples of its round (diloco_dynamic)
                delta.mul_(self.rounds.weight)
        if self.island is None:
            fut = sent = self.exchange.start(delta, key=self.frags.key(bucket, f),
                                             shapes=[tuple(self.anchor[k].shape) for k in piece])
        else:       # this worker's shard of the island's Δ across the thin link, the island gathers the rest
            sent, fut = self.island.start(self.exchange, delta, self.frags.key(bucket, f))
        if self.eager_rounds is not None:     # the own share stands in for the average until it arrives
            self.eager_rounds.keep(piece, delta if self.island is None else delta * self.island.weight)
        if not self._pending:       # a fragment's sync begins: time it until its last piece is delivered
            self._sync_clock = _SyncClock()
        self._sync_clock.watch(sent)       # (over the thin link; never a future that communicates on completion)
        self._pending.append((piece, fut))
        self._pending_fragment = f

    def communicates(self):
        """A step that takes a pseudo-gradient; every step under replicas="island" (data parallel inside it)."""
        return self.island is not None or self.starting(self.steps + 1) is not None

    def step(self):
        n = self.steps + 1
        if self.island is not None:     # the island's mean gradient, the inner step, then (a starting step) the Δs
            self.scheduler.flush()
            wait_buckets(self.grads, self.scheduler.buckets)
            self.optimizer_step()
            f = self.starting(n)
            if f is not None:
                for bucket in self.scheduler.buckets:
                    self._start(bucket, f)
        elif (starts := self.starting(n)) is None:  # an inner step (a merge waits for what a starting step sent)
            self.scheduler.local_step()
            self.optimizer_step()
        else:
            self.scheduler.flush()      # every bucket's inner step taken and its Δ started
            if self.rounds is not None:
                self.rounds.started(starts, n)
        self.steps = n
        self._dirty = [True] * self.fragments
        if self.rounds is None:
            f = self.merging(n)
        else:       # (diloco_dynamic: a merge may wait for its sync to arrive)
            f = self.rounds.merge_now(n, all(fut.is_completed() for _, fut in self._pending))
        t0 = time.perf_counter()
        if f is not None:
            self._merge([f], self.alpha)
        if self.rounds is not None:
            self.rounds.stepped(n, time.perf_counter() - t0, self.scheduler.forward_at)
        self.scheduler.end_step()

    def request_stop(self) -> None:
        if self.rounds is not None:
            self.rounds.stop_wanted = True

    @property
    def finished(self) -> bool:
        return self.rounds is not None and self.rounds.finished

    @property
    def cut(self) -> int | None:
        return None if self.rounds is None else self.rounds.cut

    @torch.no_grad()
    def _merge(self, fragments: list[int], alpha: float) -> None:
        """Wait for the fragments' averaged pseudo-gradients, step θ with the outer optimizer, then
        θ_local ← α θ_local + (1 − α) θ (Streaming DiLoCo §2.3; α = 0: θ, DiLoCo Alg. 1 line 3). Eager: fragment
        f's round, its average left in flight until the next one (`EagerRounds.round`)."""
        with self.tracer.span("outer step", "communicate"):
            if self.eager_rounds is not None:
                self.eager_rounds.round(fragments[0], self._pending, self._sync_clock)
            else:
                for piece, fut in self._pending:
                    for k, g in zip(piece, views(fut.wait(), [self.anchor[k] for k in piece])):
                        self.anchor[k].grad = g
                if self._pending and self._sync_clock is not None:
                    self.sync_times.append(self._sync_clock.elapsed())
                ks = [k for f in fragments for k in self.frags.by_fragment[f]]
                step_subset(self.outer, [self.anchor[k] for k in ks])      # θ ← OuterOpt(θ, Δ) (Alg. 1 line 14)
                for k in ks:
                    a, local = self.anchor[k], self.frags.local(k)
                    a.grad = None
                    local.copy_(a if alpha == 0.0 else torch.lerp(a, local, alpha))   # θ + α (θ_local − θ)
            self._pending, self._pending_fragment = [], None
            for f in fragments:
                self._dirty[f] = alpha != 0.0
            self.syncs += len(fragments)

    def close(self):
        if self.eager_rounds is not None:   # the averages in flight applied, then one average of the models
            self.eager_rounds.close(self.transport)
            self._dirty = [False] * self.fragments
        else:
            if self._pending:           # the sync in flight (overlap τ > 0) merges as scheduled
                self._merge([self._pending_fragment], self.alpha)
            due = [f for f in range(self.fragments) if self._dirty[f]]
            if due:                     # one last outer step of what moved; every worker ends with θ
                for bucket in self.scheduler.buckets:
                    for f in due:
                        self._start(bucket, f)
                self._merge(due, 0.0)
        if self.rounds is not None:
            self.rounds.drain()
        super().close()

    # -- buckets re-planned (MG-WFBP): per-piece exchange state follows ------------------------------------
    def _piece_layout(self) -> list[list[tuple[str, int]]]:
        """Per fragment: (key, numel) of its pieces (`Fragments.layout`); with replicas="island", of this worker's
        shard of each piece."""
        layout = self.frags.layout(self.scheduler.buckets)
        return layout if self.island is None else [[self.island.shard(*x) for x in f] for f in layout]

    def rekey(self, old, new):
        for _, fut in self._pending + (self.eager_rounds.in_flight() if self.eager_rounds else []):
            fut.result()        # the exchange's programs have run (their state is settled)
        layout = self._piece_layout()
        for f in range(self.fragments):
            self.exchange.rekey(self._layout[f], layout[f])
        self._layout = layout

    # -- bookkeeping -----------------------------------------------------------------------------------
    def metrics(self):
        bounds = self.frags.bounds
        more = {} if self.rounds is None else {"dynamic": True, "round_periods": self.rounds.history,
                                               "late_merges": self.rounds.late}
        return {**super().metrics(), **more, "period": self.period, "fragments": self.fragments, "overlap": self.overlap,
                "alpha": self.alpha, "eager": self.eager, "replicas": self.replicas,
                "replicas_averaged": self.exchange.world_size if self.island is None else self.island.replicas,
                "outer_optimizer": self.outer_spec or
                f"sgd(lr={self.outer_lr}, momentum={self.outer_momentum}, nesterov={self.nesterov})",
                "syncs": self.syncs, "fragment_params": [b - a for a, b in zip(bounds, bounds[1:])],
                "sync_s": statistics.median(self.sync_times) if self.sync_times else None}

    def _config(self) -> dict:
        return {"period": self.period, "fragments": self.fragments, "overlap": self.overlap, "eager": self.eager,
                "replicas": self.replicas, **({"dynamic": True} if self.dynamic else {})}

    def state_dict(self):
        """Waits for a sync in flight and stores its average: a resumed run continues exactly."""
        pending = [(list(m), fut.wait().clone()) for m, fut in self._pending]
        self._pending = [(m, Ready(v)) for m, v in pending]
        eager = self.eager_rounds.state_dict() if self.eager_rounds else \
            {"inflight": [[] for _ in range(self.fragments)], "own": [{} for _ in range(self.fragments)]}
        return {**self._config(), "steps": self.steps, "syncs": self.syncs, "dirty": list(self._dirty),
                "anchor": [a.clone() for a in self.anchor], "outer": copy.deepcopy(self.outer.state_dict()),
                "pending": [(m, v.clone()) for m, v in pending], "pending_fragment": self._pending_fragment,
                **eager, "exchange": self.exchange.state_dict(),
                **({"rounds": self.rounds.state_dict()} if self.rounds is not None else {})}

    def load_state_dict(self, state):
        if {k: state.get(k) for k in self._config()} != self._config():
            raise UserError(f"checkpoint of diloco with {({k: state.get(k) for k in self._config()})}; this "
                            f"run has {self._config()}")
        self.steps, self.syncs, self._dirty = state["steps"], state["syncs"], list(state["dirty"])
        copy_each(self.anchor, state["anchor"])
        self.outer.load_state_dict(copy.deepcopy(state["outer"]))
        self._pending = [(list(m), Ready(v.clone())) for m, v in state["pending"]]
        self._pending_fragment = state["pending_fragment"]
        if self.eager_rounds is not None:
            self.eager_rounds.load_state_dict(state)
        if self.rounds is not None:
            self.rounds.load_state_dict(state["rounds"])
        self.exchange.load_state_dict(state["exchange"])
