"""`async-diloco`: asynchronous DiLoCo on the parameter server — every worker's pseudo-gradient applied by the
servers' outer optimizer as it arrives (Delayed Nesterov), or those of a quorum merged, weighted by samples.

Worker i (Douillard et al. 2023, "DiLoCo", arXiv 2311.08105, Alg. 1, with the average replaced by a server):
    H_i times: θ_i ← InnerOpt(θ_i, ∇L(x ~ D_i))                      (the user's optimizer, AdamW typically)
    push Δ_i = θ_anchor,i − θ_i, bucket by bucket, through the compressor and memory (a `PSExchange`), with the
        inner steps s_i it covers (the samples, at the same batch on every worker) in the push's header
    θ_i ← θ_anchor,i ← the servers' answer (the current global model), and on: no waiting for other workers.
With `overlap` τ > 0 the worker keeps taking inner steps while the push and the answer travel, and the answer
arrives τ steps later: θ_i ← answer + (θ_i − θ_i,push), θ_anchor,i ← answer (Streaming DiLoCo's overlap,
Douillard et al. 2025, arXiv 2501.18512, §2.3, with α = 1 for the steps taken meanwhile).

Server (each of the K servers owns a slice of every bucket, `thinwire.comm.ps.PSLayout`): rule "async" applies
each push when it arrives; `quorum=K` releases a round when K pushes are in or `grace` seconds after its first
(rule "quorum", `thinwire.exchange.ps.PSServer`; Decoupled DiLoCo, Douillard et al. 2026, arXiv 2604.21428) and
merges it weighted by samples, g = Σ s_i Δ_i / Σ s_i, s = Σ s_i. Each update (g, s) of a bucket's slice is
applied with Delayed Nesterov (Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato 2024, "Asynchronous
Local-SGD Training for Language Modeling", arXiv 2401.09135, §4.1): of every N updates j = 1..N of the slice,
    j < N:  θ ← θ − η g_j / N                                     (a plain step; g_j and s_j buffered)
    j = N:  ḡ = Σ_j s_j g_j / Σ_j s_j;  m ← β m + ḡ;  θ ← θ − η (ḡ − Σ_{j<N} g_j / N + β m)
so over the N updates θ moves by −η (ḡ + β m): one Nesterov step on their sample-weighted average, the momentum
touched once per N updates. At equal s_j the last step is η (g_N / N + β m); N = 1 is plain outer Nesterov in
`torch.optim.SGD`'s form (m ← β m + g; θ ← θ − η (g + β m)), DiLoCo's outer optimizer. m starts at ḡ.
A push computed on a model more than `max_staleness` updates of its bucket old is dropped: answered with the
current model, which the worker restarts from (`dropped` in the metrics).

Dynamic local updates (`dynamic=True`; Liu et al. 2024 §4.2): each worker measures its speed v_i (inner steps per
second over its last H steps, waits for answers left out) and sends it with every push; the servers answer with
the fastest speed they know, max_j v_j (in the reply's header), and the worker's next period is
H_i = max(1, round(H v_i / max_j v_j)): a slow worker pushes as often (in time) as the fastest, none much staler.

A worker stops on its own: `close()` pushes its last partial round (the inner steps since its last push, weighted by
their count), takes the answer and tells the servers it is done (`PSWorker.done`); the servers serve until every
worker is done, so workers may run different numbers of steps, and then answer each with the final model, which
every worker ends with (`close()` is where a worker waits for the others: the drain). A worker the launcher
announces lost (`on_failure="continue"`) is done for the servers (`thinwire.comm.ps.ServerLoop`), and the others,
who wait for no other worker, go on. The outer state (m, the buffer and its count, per bucket slice) is the
server's, in its checkpoint; a worker's checkpoint holds its anchor and an answer in flight (waited for), so a run
whose arrival order is fixed (one worker, or `quorum` = every worker) resumes bitwise.
"""
from __future__ import annotations

import math
import time
from collections import deque

import torch

from ..comm.engine import Ready
from ..comm.membership import MEMBERSHIP, PeerLost
from ..errors import UserError
from ..tensors import copy_each
from ._registry import register
from .base import Algorithm, int_at_least
from .cost import CostFamily
from .ps_sync import PSMixin

STEP_BITS = 24    # a push's header aux: the inner steps it covers (low bits), the worker's speed in milli-steps/s


def pack_aux(steps: int, speed: float) -> int:
    """A push's header aux: its inner steps and the worker's speed (steps/s, kept to 1/1000)."""
    return int(steps) | (int(round(speed * 1000.0)) << STEP_BITS)


def steps_of(aux: int) -> int:
    """The inner steps (samples, in batches) a push covers: its merge weight."""
    return aux & ((1 << STEP_BITS) - 1)


def speed_of(aux: int) -> int:
    """The pushing worker's speed, in milli-steps per second."""
    return aux >> STEP_BITS


def _check(period, outer_lr, outer_momentum, delay, max_staleness, quorum, grace, dynamic, overlap) -> None:
    int_at_least("async-diloco period H", period, 1)
    int_at_least("async-diloco overlap", overlap, 0)
    int_at_least("async-diloco quorum (0: fully asynchronous)", quorum, 0)
    if delay is not None:
        int_at_least("async-diloco delay N (None: the number of workers)", delay, 1)
    if max_staleness is not None:
        int_at_least("async-diloco max_staleness (None: unbounded)", max_staleness, 0)
    if overlap >= period:
        raise UserError(f"async-diloco overlap τ={overlap} must be below the period H={period} (an answer "
                        f"arrives before the next push); valid: 0..{period - 1}")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise UserError(f"async-diloco outer_lr must be a finite number > 0, got {outer_lr!r}")
    if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
        raise UserError(f"async-diloco outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if grace is not None and not (isinstance(grace, (int, float)) and math.isfinite(grace) and grace > 0):
        raise UserError(f"async-diloco grace must be a number of seconds > 0 (or None: wait for the quorum), "
                        f"got {grace!r}")
    if grace is not None and not quorum:
        raise UserError("async-diloco grace is the window of a quorum round: give quorum=K >= 1 with it")
    if not isinstance(dynamic, bool):
        raise UserError(f"async-diloco dynamic must be true or false, got {dynamic!r}")


@register("async-diloco")
class AsyncDiLoCo(PSMixin, Algorithm):
    """Asynchronous DiLoCo: each worker's pseudo-gradient applied on arrival by the servers' Delayed Nesterov
    (Liu et al. 2024), or K of them merged by samples (quorum, Decoupled DiLoCo 2026); dynamic local updates."""

    checks_finite = False
    exchanges_gradients = False      # pseudo-gradients: the outer momentum is the servers'
    survives_failures = True         # no worker waits for another; the servers stop waiting for a lost one
    pace = "free"                    # workers need not run in lockstep
    rule = "async"
    cost = CostFamily("async", pace="own", pace_with=(("quorum", "quorum"),))

    def __init__(self, period: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 delay: int | None = None, max_staleness: int | None = None, quorum: int = 0,
                 grace: float | None = None, dynamic: bool = False, overlap: int = 0,
                 architecture: str | None = None, servers: int = 1, downlink_compressor: str = "none",
                 downlink_params: dict | None = None):
        _check(period, outer_lr, outer_momentum, delay, max_staleness, quorum, grace, dynamic, overlap)
        Algorithm.__init__(self, architecture)
        self._ps_init(servers, downlink_compressor, downlink_params)
        self.period, self.outer_lr, self.outer_momentum = period, float(outer_lr), float(outer_momentum)
        self.delay, self.max_staleness, self.quorum = delay, max_staleness, quorum
        self.grace, self.dynamic, self.overlap = None if grace is None else float(grace), dynamic, overlap
        self.rule = "quorum" if quorum else "async"
        self.overlaps_steps = overlap > 0     # an answer is waited for τ steps after its push

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        workers = world_size - self.servers
        if workers >= 1 and self.quorum > workers:
            raise UserError(f"async-diloco quorum={self.quorum} exceeds the {workers} workers; valid: 0 (fully "
                            f"asynchronous) .. {workers}")

    # -- the worker ----------------------------------------------------------------------------------------
    def setup(self):
        self.check_run(self.world_size)
        self.exchange = self.make_exchange()
        self.pending: dict[int, object] = {}        # bucket index -> the answer to its push (this step's)
        self.anchor = [p.detach().clone() for p in self.params]    # θ_anchor: the model of the last answer
        self.steps = self.local_steps = self.pushes = 0
        self.period_now = self.period                # H_i of the round under way
        self._inflight = None      # (answers by bucket index, the step that merges them, θ at the push or None)
        self._times: deque[float] = deque(maxlen=self.period)   # recent inner steps' durations (dynamic)
        self._last: float | None = None
        self._waited = 0.0

    def communicates(self):
        return self.worker is not None and self.local_steps + 1 >= self.period_now

    def on_bucket(self, bucket):
        # the round's last inner step of the bucket now (its gradients are final), then its Δ is pushed
        self.optimizer_step(bucket.params)
        self._push(bucket, self.local_steps + 1)

    def _push(self, bucket, steps: int) -> None:
        with torch.no_grad():      # Δ_i = θ_anchor − θ_i (DiLoCo Alg. 1 line 12), in the bucket's order
            delta = bucket.flat([self.anchor[i] - p for p, i in zip(bucket.params, bucket.members)])
        self.pending[bucket.index] = self.exchange.start(delta, key=bucket.key, aux=pack_aux(steps, self.speed()))

    def speed(self) -> float:
        """This worker's inner steps per second over its recent steps (0 before any)."""
        return len(self._times) / sum(self._times) if self._times and sum(self._times) > 0 else 0.0

    def step(self):
        self._worker_only()
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(now - self._last - self._waited)
        self._last, self._waited = now, 0.0
        n = self.local_steps + 1
        if n >= self.period_now:
            self.scheduler.flush()      # every bucket's inner step taken and its Δ pushed (on_bucket)
            self._launch()
        else:
            self.local_steps = n
            self.scheduler.local_step()
            self.optimizer_step()
        self.steps += 1
        if self._inflight is not None and self.steps >= self._inflight[1]:
            self._merge()
        self.scheduler.end_step()

    def _launch(self) -> None:
        """The round's pushes are out: the answers are merged now, or τ inner steps later (overlap)."""
        self.period_now = self._next_period()
        lag = min(self.overlap, self.period_now - 1)
        at = [p.detach().clone() for p in self.params] if lag else None
        self._inflight = (self.pending, self.steps + 1 + lag, at)
        self.pending, self.local_steps = {}, 0
        self.pushes += 1

    def _next_period(self) -> int:
        """H, or with dynamic local updates H_i = max(1, round(H v_i / max_j v_j)) (Liu et al. 2024 §4.2)."""
        fastest, mine = self.worker.note, self.speed() * 1000.0
        if not self.dynamic or fastest <= 0 or mine <= 0:
            return self.period
        return max(1, min(self.period, round(self.period * mine / fastest)))

    @torch.no_grad()
    def _merge(self) -> None:
        """θ_anchor ← answer; θ ← answer (+ the inner steps taken since the push, with overlap)."""
        futures, _, at = self._inflight
        t0 = time.perf_counter()
        with self.tracer.span("outer step", "communicate"):
            answers = self._answers(futures)
            for bucket in self.scheduler.buckets:
                for p, i, a in zip(bucket.params, bucket.members, bucket.split(answers[bucket.index])):
                    if at is None:
                        p.copy_(a)
                    else:
                        p.sub_(at[i]).add_(a)        # answer + (θ − θ_push)
                    self.anchor[i].copy_(a)
        self.worker.commit()
        self._inflight = None
        self._waited += time.perf_counter() - t0

    def _answers(self, futures: dict) -> dict:
        """The answers to a round's pushes. Under `on_failure="continue"` a wait interrupted by the loss of
        another worker (no concern of ours: only the servers answer us) polls on; the loss of a server raises."""
        while True:
            try:
                return {b: f.wait() for b, f in futures.items()}
            except PeerLost as lost:
                servers = {self.layout.server_rank(k) for k in range(self.layout.servers)}
                if servers & set(lost.lost) or all(f.is_completed() for f in futures.values()):
                    raise
                while not all(f.is_completed() for f in futures.values()):
                    now = MEMBERSHIP.lost(0)
                    if now is not None and servers & set(now.lost):
                        raise now from lost
                    time.sleep(1e-3)

    def close(self):
        if self.worker is not None:
            if self._inflight is not None:
                self._merge()
            if self.local_steps:        # the last partial round, weighted by its inner steps
                for bucket in self.scheduler.buckets:
                    self._push(bucket, self.local_steps)
                self._inflight = (self.pending, self.steps, None)
                self.pending, self.local_steps = {}, 0
                self.pushes += 1
                self._merge()
            # done: once every worker is, the servers answer each with the final model, which it ends with
            final = self.worker.done(final=True)
            self._inflight = ({f.b: f for f in final}, self.steps, None)
            self._merge()
        super().close()                 # PSMixin: the scheduler closed (the servers know this worker is done)

    # -- the server ----------------------------------------------------------------------------------------
    def server_options(self) -> dict:
        return {"quorum": self.quorum, "grace": self.grace, "max_staleness": self.max_staleness,
                "weight": steps_of, "note": (lambda w, b: max(self.speeds)) if self.dynamic else None, "final": True}

    def server_setup(self) -> None:
        """(server) Delayed Nesterov's state per bucket slice: m, the buffered Σ s g, Σ s, Σ g and their count."""
        self.n_delay = self.delay or (1 if self.quorum else self.layout.workers)
        B = len(self.server.params)
        self.momentum: list[torch.Tensor | None] = [None] * B
        self.buffered: list[dict | None] = [None] * B
        self.speeds = [0] * self.layout.workers      # the last speed each worker sent (milli-steps/s)

    @torch.no_grad()
    def server_update(self, b, param, g, info) -> None:
        """Delayed Nesterov on update (g, s) of bucket b's slice (module docstring; Liu et al. 2024 §4.1)."""
        for w, aux in zip(info["workers"], info["aux"]):
            self.speeds[w] = speed_of(aux)
        s = float(sum(info["weights"]))
        lr, beta, n = self.outer_lr, self.outer_momentum, self.n_delay
        buf = self.buffered[b] or {"count": 0, "ws": 0.0, "sg": torch.zeros_like(g), "g": torch.zeros_like(g)}
        buf["count"] += 1
        if buf["count"] < n:         # a plain step; the update waits in the buffer for the momentum's turn
            buf["sg"].add_(g, alpha=s)
            buf["ws"] += s
            buf["g"].add_(g)
            param.add_(g, alpha=-lr / n)
            self.buffered[b] = buf
            return
        if n == 1:
            avg, rest = g, g
        else:                        # ḡ = Σ s_j g_j / Σ s_j; what the plain steps left: ḡ − Σ_{j<N} g_j / N
            avg = buf["sg"].add(g, alpha=s).div_(buf["ws"] + s)
            rest = avg - buf["g"] / n
        m = self.momentum[b]
        self.momentum[b] = m = avg.clone() if m is None else m.mul_(beta).add_(avg)
        param.add_(rest.add(m, alpha=beta), alpha=-lr)
        self.buffered[b] = None

    def pushes_at(self, step: int) -> int:
        if self.dynamic:
            raise UserError("async-diloco dynamic=true changes each worker's period with its speed: the servers "
                            "cannot cut a checkpoint at a step; drop --checkpoint-every or dynamic")
        return step // self.period

    # -- state and metrics -----------------------------------------------------------------------------------
    def state_dict(self):
        if self.server is not None:
            return {**super().state_dict(), "momentum": list(self.momentum), "buffered": list(self.buffered),
                    "speeds": list(self.speeds)}
        inflight = None
        if self._inflight is not None:      # waited for and stored: a resumed run merges it as scheduled
            futures, due, at = self._inflight
            answers = self._answers(futures)
            self._inflight = ({b: Ready(v) for b, v in answers.items()}, due, at)
            inflight = {"buckets": sorted(answers), "answers": [answers[b].clone() for b in sorted(answers)],
                        "due": due, "at": at}
        return {**super().state_dict(), "anchor": [a.clone() for a in self.anchor], "steps": self.steps,
                "local_steps": self.local_steps, "pushes": self.pushes, "period_now": self.period_now,
                "inflight": inflight}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.server is not None:
            self.momentum, self.buffered = list(state["momentum"]), list(state["buffered"])
            self.speeds = list(state["speeds"])
            return
        copy_each(self.anchor, state["anchor"])
        self.steps, self.local_steps, self.pushes = state["steps"], state["local_steps"], state["pushes"]
        self.period_now = state["period_now"]
        got = state["inflight"]
        self._inflight = None if got is None else (
            {b: Ready(a.clone()) for b, a in zip(got["buckets"], got["answers"])}, got["due"], got["at"])

    def metrics(self):
        out = {**super().metrics(), "period": self.period, "outer_lr": self.outer_lr,
               "outer_momentum": self.outer_momentum, "quorum": self.quorum, "overlap": self.overlap,
               "dynamic": self.dynamic}
        if self.server is not None:
            out["delay"] = self.n_delay
        elif self.worker is not None:
            out.update(pushes=self.pushes, period_now=self.period_now, speed=self.speed())
        return out
