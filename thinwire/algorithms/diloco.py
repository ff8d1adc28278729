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
- `fragments` F: the model's parameters, flattened in model order (fragment 0 is the input side), cut into F
  consecutive ranges of equal element counts (⌊T f / F⌋ boundaries; a tensor may straddle two fragments: each
  part is stepped and merged with its fragment). The paper cuts between layers of equal size; cutting elements
  makes every fragment 1/F of the model whatever its layers, so the peak bytes per sync fall by F while the
  average stays that of DiLoCo. Fragment p is synced every H steps, the fragments staggered: one sync every
  K = H/F steps, fragments 0, 1, ..., F−1, 0, ... (§2.2). Where the boundaries fall between tensors (layers of
  equal size) the fragments are torchft's per-module fragments.
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

Eager updates (Kale, Douillard, Donchev 2025, "Eager Updates For Overlapped Communication and Computation in
DiLoCo", arXiv 2502.12996, the eager variant of DiLoCo with delayed outer gradients): `eager=True`. A fragment's
average is not waited for: the worker steps θ at once with its own outer gradient standing in for the current
round's average, and the average arrives one round (H steps) later, when it replaces the own share it stood in
for. On worker m, at the round t of fragment p (every H steps, the fragments staggered as above), with M workers:
    Δ_m^(t) = θ_m − θ_m,local                                  (its own outer gradient; its average starts)
    Δ̃_m^(t) = Δ_m^(t) / M + (Δ^(t−1) − Δ_m^(t−1) / M)         (own current share + the others' previous ones:
                                                                Δ^(t−1) = (1/M) Σ_j Δ_j^(t−1), arrived by now)
    θ_m ← OuterOpt(θ_m, Δ̃_m^(t));  θ_m,local ← θ_m
Every worker's outer gradient is applied exactly once, the others' one round late; θ and the outer optimizer's
state are each worker's own (they differ by the own shares in flight). The sync is hidden behind a whole period:
H inner steps per fragment round instead of τ (so `overlap` and `alpha` stay 0). `close()` applies the averages
still in flight (their others' shares), then averages the workers' models once (one all-reduce of the model)
so that every worker ends with the same model.

Hierarchical DiLoCo on a two-tier network (`thinwire.net.Islands`): `replicas="island"` makes each island one
DiLoCo replica, trained by synchronous data parallelism inside (every inner step all-reduces the gradients over
the island's fast links, as `bsp` does; the island's workers hold the same model), and the outer sync crosses the
thin link once per island: the island's workers hold the same pseudo-gradient, so worker j of each island
averages the j-th of m equal shards of it with worker j of the other islands (over the thin link, through the
training's compressor and error feedback), then the island all-gathers the averaged shards over its fast links
(the DiLoCo paper's setting: "islands" of well-connected devices, Douillard et al. 2023 §1; the data parallelism
inside each replica torchft's DiLoCo leaves to the user). The bytes that cross the thin link per sync are those of
one model per island, spread over its workers' links. M, the number of replicas averaged, is the number of
islands. On a flat network (or islands of one worker) it is the flat algorithm.

Like `localsgd`, on a step that takes a pseudo-gradient each bucket's inner step is taken as soon as backward
hands the bucket over, and the pseudo-gradient of its elements in the syncing fragment starts averaging at
once, overlapped with the rest of backward. Exchange state (error-feedback residuals) is kept per piece (a
bucket's elements in one fragment) and follows a re-plan of the buckets (MG-WFBP).
θ is kept per segment (a parameter's elements in one fragment: the whole parameter, shaped like it, unless a
fragment boundary cuts it, then a 1-D slice); the outer optimizer steps the segments, so any element-wise
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
import threading
import time
from typing import Callable

import torch

from ..comm import subgroup
from ..comm.elastic import broadcast_state
from ..comm.engine import Future, Ready
from ..errors import UserError
from ..optim import step_subset
from ..tensors import copy_each, views
from ._registry import register
from .base import Algorithm, int_at_least

DEFAULT_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


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


class _SyncClock:
    """When a fragment's sync began, and when the last of its pieces was delivered (a done-callback per piece)."""

    def __init__(self):
        self.t0 = self.done = time.perf_counter()
        self._lock = threading.Lock()

    def watch(self, fut) -> None:
        fut.add_done_callback(self._delivered)

    def _delivered(self, _fut) -> None:
        with self._lock:
            self.done = max(self.done, time.perf_counter())

    def elapsed(self) -> float:
        with self._lock:
            return self.done - self.t0


class _Gathered(Future):
    """The mean of a piece's Δ under replicas="island": this worker's shard averaged across the islands (`fut`),
    then the island's shards all-gathered over its fast links (on `result`, when the merge asks for it)."""

    def __init__(self, fut, inside, sizes: list[int]):
        self.fut, self.inside, self.sizes = fut, inside, sizes
        self._value = None

    def is_completed(self) -> bool:
        return self._value is not None or self.fut.is_completed()

    def result(self):
        if self._value is None:
            mine = self.fut.wait()          # (each wait counts its own exposed time)
            self._value = torch.cat(self.inside.all_gather(mine.reshape(-1), sizes=self.sizes))
        return self._value


@register("diloco")
class DiLoCo(Algorithm):
    """DiLoCo (Douillard et al. 2023, Alg. 1): H inner steps, averaged pseudo-gradient, outer Nesterov SGD;
    Streaming DiLoCo (2025) with fragments, overlap τ and mixing α."""

    architectures = ("allreduce",)
    schedules = ("none", "wfbp", "fusion", "mgwfbp")
    checks_finite = False
    survives_failures = True   # θ and the outer optimizer are replicated; the mean over fewer workers stays a mean
    keeps_local_work = True    # a survivor's inner steps go into the next sync

    def __init__(self, period: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 outer_optimizer=None, fragments: int = 1, overlap: int = 0, alpha: float = 0.0,
                 eager: bool = False, replicas: str = "worker", architecture: str | None = None):
        super().__init__(architecture)
        for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("overlap", overlap, 0)):
            int_at_least(f"diloco {name}", value, low)
        if period % fragments:
            raise UserError(f"diloco period H={period} must be a multiple of fragments F={fragments} (one fragment "
                            f"is synced every H/F steps); e.g. period={fragments * max(1, period // fragments)}")
        if overlap >= period // fragments:
            raise UserError(f"diloco overlap τ={overlap} must be below H/F={period // fragments} (a fragment's "
                            f"average arrives before the next fragment's sync starts); valid: 0..{period // fragments - 1}")
        if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
            raise UserError(f"diloco outer_lr must be a finite number > 0, got {outer_lr!r}")
        if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
            raise UserError(f"diloco outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
            raise UserError(f"diloco alpha must be in [0, 1] (θ ← α θ_local + (1 − α) θ_global), got {alpha!r}")
        if replicas not in ("worker", "island"):
            raise UserError(f"diloco replicas must be worker (every worker a DiLoCo replica) or island (every island "
                            f"of a two-tier network one, data parallel inside), got {replicas!r}")
        self.replicas = replicas
        if not isinstance(eager, bool):
            raise UserError(f"diloco eager must be true or false, got {eager!r}")
        if eager and (overlap or alpha):
            raise UserError(f"diloco eager hides a fragment's sync behind a whole period (its average is applied "
                            f"one round later): give overlap=0 and alpha=0 with it, got overlap={overlap}, "
                            f"alpha={alpha}")
        given = {"outer_lr": outer_lr, "outer_momentum": outer_momentum, "nesterov": nesterov}
        if outer_optimizer is not None and not isinstance(outer_optimizer, str):
            changed = [k for k, v in given.items() if v != DEFAULT_OUTER[k]]
            if changed:
                raise UserError(f"give outer_optimizer or {', '.join(changed)}, not both (the callable builds the "
                                f"whole outer optimizer)")
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

    def setup(self):
        self.island = self._island_transports() if self.replicas == "island" else None
        if self.island is None:
            self.exchange = self.make_exchange()
        else:       # the outer sync among the islands' j-th workers; the inner steps' gradients inside the island
            inside, column = self.island
            self.exchange = self.ctx.exchange(self.exchange_class, transport=column)
            self.inner = self.ctx.exchange(self.exchange_class, "none", "none", transport=inside)
            self._exchanges += [self.exchange, self.inner]
            self._grads: dict = {}
        sizes = [p.numel() for p in self.params]
        self.bounds = fragment_bounds(sum(sizes), self.fragments)
        self.segs = segments(sizes, self.bounds)
        self.by_param: list[list[int]] = [[] for _ in self.params]      # parameter -> its segments
        self.by_fragment: list[list[int]] = [[] for _ in range(self.fragments)]
        for k, (i, f, lo, hi) in enumerate(self.segs):
            p = self.params[i]
            if hi - lo < p.numel() and not p.is_contiguous():
                raise UserError(f"diloco: a fragment boundary cuts parameter {i} {tuple(p.shape)}, which is not "
                                f"contiguous; use fewer fragments or a contiguous layout")
            self.by_param[i].append(k)
            self.by_fragment[f].append(k)
        # θ per segment (a parameter's elements in one fragment): the same on every worker
        self.anchor = [self._local(k).clone() for k in range(len(self.segs))]
        self.outer = self._make_outer(self.anchor)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise UserError(f"outer_optimizer must build a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.steps = 0                      # inner steps taken
        self.syncs = 0                      # fragment syncs merged (outer steps of one fragment)
        self._pending: list = []            # (segments, future of their mean pseudo-gradient) in flight
        self._pending_fragment: int | None = None
        self._dirty = [False] * self.fragments   # the fragment's parameters differ from θ
        # eager: per fragment, the averages in flight (started a round ago) and this worker's own shares of them
        self._inflight: list[list] = [[] for _ in range(self.fragments)]
        self._own: list[dict] = [{} for _ in range(self.fragments)]
        self._current: dict = {}            # segment -> own outer gradient taken this step (eager)
        self._sync_clock: _SyncClock | None = None
        self._clocks: list = [None] * self.fragments    # eager: the sync clock of each fragment's round in flight
        self.sync_times: list[float] = []   # each fragment sync, from its first piece's start to its last's delivery

    def _island_transports(self):
        """(this island's transport, the transport of the islands' j-th workers) on a two-tier network with islands
        of several workers; None elsewhere (flat DiLoCo). Every rank makes every group, in the same order."""
        net = self.transport.islands
        if net is None or net.size == 1:
            return None
        if self.transport.members != list(range(net.workers)):
            raise UserError("diloco replicas=island needs the whole job's group (no regrouped survivors)")
        m, me = net.size, self.transport.rank
        islands = [subgroup(range(i * m, (i + 1) * m)) for i in range(net.islands)]
        columns = [subgroup(range(j, net.workers, m)) for j in range(m)]
        return self.transport.sub(islands[me // m]), self.transport.sub(columns[me % m])

    def _local(self, k: int) -> torch.Tensor:
        """Segment k of the worker's own parameters (a view, shaped like its θ)."""
        i, _, lo, hi = self.segs[k]
        p = self.params[i].detach()
        return p if hi - lo == p.numel() else p.view(-1)[lo:hi]

    def pieces(self, bucket, f: int) -> list[int]:
        """The segments of the bucket's parameters in fragment f, in the bucket's order."""
        return [k for i in bucket.members for k in self.by_param[i] if self.segs[k][1] == f]

    def attach(self, ctx) -> None:
        super().attach(ctx)
        self._layout = self._piece_layout()

    # -- the schedule (Streaming DiLoCo Alg. 1; F = 1, τ = 0 is DiLoCo's every H steps) -------------------
    def starting(self, step: int) -> int | None:
        """The fragment whose pseudo-gradient step `step` (1-based) takes, or None: the one merged τ steps later."""
        return self.merging(step + self.overlap)

    def merging(self, step: int) -> int | None:
        """The fragment whose average step `step` waits for and merges, or None."""
        k = self.period // self.fragments
        return None if step % k else (step // k - 1) % self.fragments

    # -- the step --------------------------------------------------------------------------------------
    def on_bucket(self, bucket):
        if self.island is not None:     # data parallel inside the island: the bucket's mean gradient starts
            self._grads[bucket.index] = self.inner.start(bucket.buffer, bucket.key, shapes=bucket.shapes, inplace=True)
            return
        f = self.starting(self.steps + 1)
        if f is None:
            return
        # the bucket's inner step now (its gradients are final), then its pseudo-gradient starts averaging
        self.optimizer_step(bucket.params)
        self._start(bucket, f)

    def _key(self, bucket, f: int) -> str:
        return bucket.key if self.fragments == 1 else f"{bucket.key}@{f}"

    def _start(self, bucket, f: int) -> None:
        piece = self.pieces(bucket, f)
        if not piece:
            return
        with torch.no_grad():      # Δ_i = θ − θ_i (DiLoCo Alg. 1 line 12), in the bucket's order
            delta = torch.cat([(self.anchor[k] - self._local(k)).reshape(-1) for k in piece])
        if self.island is None:
            fut = sent = self.exchange.start(delta, key=self._key(bucket, f),
                                             shapes=[tuple(self.anchor[k].shape) for k in piece])
        else:       # this worker's shard of the island's Δ across the thin link, the island gathers the rest
            inside, _ = self.island
            shards = delta.tensor_split(inside.world_size)
            mine = shards[inside.rank]
            sent = self.exchange.start(mine.clone(), key=f"{self._key(bucket, f)}#{inside.rank}",
                                       shapes=[tuple(mine.shape)])
            fut = _Gathered(sent, inside, [t.numel() for t in shards])
        if self.eager:     # the own share stands in for the average until it arrives
            self._current.update(zip(piece, views(delta.clone(), [self.anchor[k] for k in piece])))
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
        if self.island is not None:
            self.scheduler.flush()
            self._island_inner_step(n)
        elif self.starting(n) is None:  # an inner step (a merge waits for what a starting step sent)
            self.scheduler.local_step()
            self.optimizer_step()
        else:
            self.scheduler.flush()      # every bucket's inner step taken and its Δ started
        self.steps = n
        self._dirty = [True] * self.fragments
        f = self.merging(n)
        if f is not None:
            self._eager_step(f) if self.eager else self._merge([f], self.alpha)
        self.scheduler.end_step()

    def _island_inner_step(self, n: int) -> None:
        """The island's mean gradient in every p.grad, the inner step, then (a starting step) the fragment's Δ."""
        for bucket in self.scheduler.buckets:
            res = self._grads.pop(bucket.index).wait()
            if res.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(res.reshape(-1))
        self.optimizer_step()
        f = self.starting(n)
        if f is not None:
            for bucket in self.scheduler.buckets:
                self._start(bucket, f)

    @torch.no_grad()
    def _eager_step(self, f: int) -> None:
        """Fragment f's round under eager updates: θ ← OuterOpt(θ, Δ_m/M + (Δ_prev − Δ_m,prev/M)) at once; this
        round's average stays in flight until f's next round (Kale et al. 2025, eager updates)."""
        with self.tracer.span("outer step", "communicate"):
            m = self.exchange.world_size          # the replicas averaged
            ks = self.by_fragment[f]
            own = {k: self._current.pop(k) for k in ks if k in self._current}
            grads = {k: d / m for k, d in own.items()}
            self._apply_delayed(f, grads)
            for k in ks:
                self.anchor[k].grad = grads.get(k, torch.zeros_like(self.anchor[k]))
            step_subset(self.outer, [self.anchor[k] for k in ks])
            for k in ks:
                self.anchor[k].grad = None
                self._local(k).copy_(self.anchor[k])
            self._inflight[f], self._own[f], self._clocks[f] = self._pending, own, self._sync_clock
            self._pending, self._pending_fragment = [], None
            self._dirty[f] = False
            self.syncs += 1

    def _apply_delayed(self, f: int, grads: dict) -> None:
        """Add to `grads` the others' shares of fragment f's previous average: Δ_prev − Δ_m,prev / M."""
        m = self.exchange.world_size
        for piece, fut in self._inflight[f]:
            for k, avg in zip(piece, views(fut.wait(), [self.anchor[k] for k in piece])):
                own = self._own[f].get(k)
                delayed = avg if own is None else avg - own / m
                grads[k] = delayed if k not in grads else grads[k] + delayed
        if self._inflight[f] and self._clocks[f] is not None:
            self.sync_times.append(self._clocks[f].elapsed())
        self._inflight[f], self._own[f], self._clocks[f] = [], {}, None

    @torch.no_grad()
    def _merge(self, fragments: list[int], alpha: float) -> None:
        """Wait for the fragments' averaged pseudo-gradients, step θ with the outer optimizer, then
        θ_local ← α θ_local + (1 − α) θ (Streaming DiLoCo §2.3; α = 0: θ, DiLoCo Alg. 1 line 3)."""
        with self.tracer.span("outer step", "communicate"):
            for piece, fut in self._pending:
                for k, g in zip(piece, views(fut.wait(), [self.anchor[k] for k in piece])):
                    self.anchor[k].grad = g
            if self._pending and self._sync_clock is not None:
                self.sync_times.append(self._sync_clock.elapsed())
            self._pending, self._pending_fragment = [], None
            ks = [k for f in fragments for k in self.by_fragment[f]]
            step_subset(self.outer, [self.anchor[k] for k in ks])      # θ ← OuterOpt(θ, Δ) (Alg. 1 line 14)
            for k in ks:
                a, local = self.anchor[k], self._local(k)
                a.grad = None
                local.copy_(a if alpha == 0.0 else torch.lerp(a, local, alpha))   # θ + α (θ_local − θ)
            for f in fragments:
                self._dirty[f] = alpha != 0.0
            self.syncs += len(fragments)

    def close(self):
        if self.eager:
            self._close_eager()
            super().close()
            return
        if self._pending:           # the sync in flight (overlap τ > 0) merges as scheduled
            self._merge([self._pending_fragment], self.alpha)
        due = [f for f in range(self.fragments) if self._dirty[f]]
        if due:                     # one last outer step of what moved; every worker ends with θ
            for bucket in self.scheduler.buckets:
                for f in due:
                    self._start(bucket, f)
            self._merge(due, 0.0)
        super().close()

    @torch.no_grad()
    def _close_eager(self) -> None:
        """The averages in flight applied (their others' shares, moving θ and the worker's model alike), then
        one average of the workers' models: every worker ends with the same model."""
        for f in range(self.fragments):
            if not self._inflight[f]:
                continue
            grads: dict = {}
            self._apply_delayed(f, grads)
            ks = [k for k in self.by_fragment[f] if k in grads]
            before = [self.anchor[k].clone() for k in ks]
            for k in ks:
                self.anchor[k].grad = grads[k]
            step_subset(self.outer, [self.anchor[k] for k in ks])
            for k, b in zip(ks, before):
                self.anchor[k].grad = None
                self._local(k).add_(self.anchor[k] - b)
        flat = self.flat_params()
        self.transport.all_reduce(flat, op="mean")
        copy_each([p.detach() for p in self.params], views(flat, self.params))
        for k in range(len(self.segs)):
            self.anchor[k].copy_(self._local(k))
        self._dirty = [False] * self.fragments

    @torch.no_grad()
    def recover(self):
        """A worker was lost: the sync in flight is dropped; θ and the outer optimizer's state are taken from the
        new rank 0 (a sync that completed on some survivors only cannot leave them apart); each survivor's inner
        model (its own where the Trainer kept the survivors' work, else the new rank 0's) differs from θ and goes
        into the next sync of each fragment; the schedule goes on from the agreed step."""
        if self.island is not None:
            raise UserError("diloco replicas=island does not go on after a lost worker (its island's data parallel "
                            "group lost a member): use on_failure='stop' and resume from a checkpoint")
        self._pending, self._pending_fragment = [], None
        self._inflight, self._own = [[] for _ in range(self.fragments)], [{} for _ in range(self.fragments)]
        self._current = {}
        for a in self.anchor:
            a.grad = None
        # one message (not one per tensor: a round trip each on a slow link), and a newcomer of an elastic job
        # pulled into the loss's generation, whose outer optimizer has no state yet, takes it whole
        got = broadcast_state(self.transport, {"anchor": self.anchor, "outer": self.outer.state_dict()}, 0)
        copy_each(self.anchor, got["anchor"])
        self.outer.load_state_dict(got["outer"])
        self.steps = self.ctx.failures[-1]["step"]
        self._dirty = [True] * self.fragments

    # -- elastic jobs: a newcomer joins at a fragment's merge ---------------------------------------------
    def join_boundary(self, step):
        """A step that merged a fragment (nothing is in flight then: at most one fragment is, until its merge)."""
        return self.merging(self.steps) is not None and not self._pending

    def join_after(self, step):
        return step + self.period // self.fragments

    def join_next(self, step):
        """The next merge whose fragment's pseudo-gradient is taken after this step (τ steps before the merge)."""
        if self.eager or self.island is not None:
            return None
        m = self.steps + 1
        while self.merging(m) is None or m - self.overlap <= self.steps:
            m += 1
        return step + m - self.steps

    def newcomer_state(self):
        return {"anchor": self.anchor, "outer": self.outer.state_dict(), "steps": self.steps, "syncs": self.syncs,
                "dirty": list(self._dirty)}

    @torch.no_grad()
    def take_newcomer_state(self, state):
        """θ and the outer optimizer's state of rank 0; the newcomer's inner model is θ in every fragment (it
        joins each fragment's schedule at that fragment's next merge), the counters and flags rank 0's."""
        copy_each(self.anchor, state["anchor"])
        self.outer.load_state_dict(state["outer"])
        for k, a in enumerate(self.anchor):
            self._local(k).copy_(a)
        self.steps, self.syncs, self._dirty = int(state["steps"]), int(state["syncs"]), list(state["dirty"])

    # -- buckets re-planned (MG-WFBP): per-piece exchange state follows ------------------------------------
    def _piece_layout(self) -> list[list[tuple[str, int]]]:
        """Per fragment: (key, numel) of its pieces, bucket by bucket (its elements in backward order); with
        replicas="island", of this worker's shard of each piece."""
        out: list[list[tuple[str, int]]] = [[] for _ in range(self.fragments)]
        for bucket in self.scheduler.buckets:
            for f in range(self.fragments):
                n = sum(self.anchor[k].numel() for k in self.pieces(bucket, f))
                if n and self.island is None:
                    out[f].append((self._key(bucket, f), n))
                elif n:
                    m, j = self.island[0].world_size, self.island[0].rank
                    out[f].append((f"{self._key(bucket, f)}#{j}", n // m + (1 if j < n % m else 0)))
        return out

    def rekey(self, old, new):
        for _, fut in self._pending + [x for f in self._inflight for x in f]:   # the exchange's programs have
            fut.result()                                                          # run (their state is settled)
        layout = self._piece_layout()
        for f in range(self.fragments):
            self.exchange.rekey(self._layout[f], layout[f])
        self._layout = layout

    # -- bookkeeping -----------------------------------------------------------------------------------
    def metrics(self):
        return {**super().metrics(), "period": self.period, "fragments": self.fragments, "overlap": self.overlap,
                "alpha": self.alpha, "eager": self.eager, "replicas": self.replicas,
                "replicas_averaged": self.exchange.world_size, "outer_optimizer": self.outer_spec or
                f"sgd(lr={self.outer_lr}, momentum={self.outer_momentum}, nesterov={self.nesterov})",
                "syncs": self.syncs, "fragment_params": [b - a for a, b in zip(self.bounds, self.bounds[1:])],
                "sync_s": statistics.median(self.sync_times) if self.sync_times else None}

    def _config(self) -> dict:
        return {"period": self.period, "fragments": self.fragments, "overlap": self.overlap, "eager": self.eager,
                "replicas": self.replicas}

    def state_dict(self):
        """Waits for a sync in flight and stores its average: a resumed run continues exactly."""
        pending = [(list(m), fut.wait().clone()) for m, fut in self._pending]
        self._pending = [(m, Ready(v)) for m, v in pending]
        inflight = [[(list(m), fut.wait().clone()) for m, fut in f] for f in self._inflight]
        self._inflight = [[(m, Ready(v)) for m, v in f] for f in inflight]
        return {**self._config(), "steps": self.steps, "syncs": self.syncs, "dirty": list(self._dirty),
                "anchor": [a.clone() for a in self.anchor], "outer": copy.deepcopy(self.outer.state_dict()),
                "pending": [(m, v.clone()) for m, v in pending], "pending_fragment": self._pending_fragment,
                "inflight": [[(m, v.clone()) for m, v in f] for f in inflight],
                "own": [{k: v.clone() for k, v in f.items()} for f in self._own],
                "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        if {k: state.get(k) for k in self._config()} != self._config():
            raise UserError(f"checkpoint of diloco with {({k: state.get(k) for k in self._config()})}; this "
                            f"run has {self._config()}")
        self.steps, self.syncs, self._dirty = state["steps"], state["syncs"], list(state["dirty"])
        copy_each(self.anchor, state["anchor"])
        self.outer.load_state_dict(copy.deepcopy(state["outer"]))
        self._pending = [(list(m), Ready(v.clone())) for m, v in state["pending"]]
        self._pending_fragment = state["pending_fragment"]
        self._inflight = [[(list(m), Ready(v.clone())) for m, v in f] for f in state.get("inflight", self._inflight)]
        self._own = [{k: v.clone() for k, v in f.items()} for f in state.get("own", self._own)]
        self.exchange.load_state_dict(state["exchange"])
