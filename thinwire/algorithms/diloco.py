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
- `fragments` F: the model's parameters in F fragments of consecutive parameters (model order, about equal element
  counts, at least one parameter each; fragment 0 is the input side). Fragment p is synced every H steps, the
  fragments staggered: one sync every K = H/F steps, fragments 0, 1, ..., F−1, 0, ... (§2.2). Each sync sends
  1/F of the model, so the peak bytes per sync fall by about F while the average stays that of DiLoCo.
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

Like `localsgd`, on a step that takes a pseudo-gradient each bucket's inner step is taken as soon as backward
hands the bucket over, and the pseudo-gradient of its parameters in the syncing fragment starts averaging at
once, overlapped with the rest of backward. Exchange state (error-feedback residuals) is kept per piece of a
bucket in one fragment, and follows a re-plan of the buckets (MG-WFBP).

`close()` first merges a sync in flight, then takes one last outer step of every fragment whose parameters moved
since its last merge into θ (as at the end of a period) and leaves every worker with θ: the same model everywhere.
Outer optimizer: SGD(outer_lr, outer_momentum, nesterov) with `torch.optim.SGD` semantics (nesterov is plain
momentum when outer_momentum = 0), or `outer_optimizer=` a callable building any torch.optim optimizer from the
list of θ tensors, or the name of a torch.optim class (CLI: `--outer-optimizer adam`, built with lr=outer_lr).
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch

from ..comm.engine import Ready
from ..errors import UserError
from ..sched import step_subset
from . import register
from .base import Algorithm

DEFAULT_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Parameter indices of `fragments` groups of consecutive parameters with about equal element counts (each
    non-empty): parameter j joins the current group while its midpoint stays within the group's share."""
    if fragments > len(sizes):
        raise UserError(f"diloco fragments must be at most the number of parameter tensors ({len(sizes)}), got "
                        f"{fragments}")
    total = sum(sizes)
    groups, start, acc = [], 0, 0
    for f in range(fragments - 1):
        share = total * (f + 1) / fragments
        end = start + 1
        acc += sizes[start]
        while end < len(sizes) - (fragments - 1 - f) and acc + sizes[end] / 2 <= share:
            acc += sizes[end]
            end += 1
        groups.append(list(range(start, end)))
        start = end
    groups.append(list(range(start, len(sizes))))
    return groups


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


@register("diloco")
class DiLoCo(Algorithm):
    """DiLoCo (Douillard et al. 2023, Alg. 1): H inner steps, averaged pseudo-gradient, outer Nesterov SGD;
    Streaming DiLoCo (2025) with fragments, overlap τ and mixing α."""

    architectures = ("allreduce",)
    schedules = ("none", "wfbp", "fusion", "mgwfbp")
    checks_finite = False

    def __init__(self, period: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 outer_optimizer=None, fragments: int = 1, overlap: int = 0, alpha: float = 0.0,
                 architecture: str | None = None):
        super().__init__(architecture)
        for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("overlap", overlap, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"diloco {name} must be an integer >= {low}, got {value!r}")
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
        self.overlaps_steps = overlap > 0       # a fragment's average is waited τ steps after it starts

    # -- wiring ----------------------------------------------------------------------------------------
    def setup(self):
        self.exchange = self.make_exchange()
        self.groups = split_fragments([p.numel() for p in self.params], self.fragments)
        self.fragment_of = [0] * len(self.params)
        for f, members in enumerate(self.groups):
            for i in members:
                self.fragment_of[i] = f
        self.anchor = [p.detach().clone() for p in self.params]     # θ: the same on every worker
        self.outer = self._make_outer(self.anchor)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise UserError(f"outer_optimizer must build a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.steps = 0                      # inner steps taken
        self.syncs = 0                      # fragment syncs merged (outer steps of one fragment)
        self._pending: list = []            # (members, future of the mean pseudo-gradient) of the fragment in flight
        self._pending_fragment: int | None = None
        self._dirty = [False] * self.fragments   # the fragment's parameters differ from θ

    def attach(self, trainer) -> None:
        super().attach(trainer)
        self._layout = self._piece_layout()

    # -- the schedule (Streaming DiLoCo Alg. 1; F = 1, τ = 0 is DiLoCo's every H steps) -------------------
    def starting(self, step: int) -> int | None:
        """The fragment whose pseudo-gradient step `step` (1-based) takes, or None."""
        k = self.period // self.fragments
        if (step + self.overlap) % k:
            return None
        return ((step + self.overlap) // k - 1) % self.fragments

    def merging(self, step: int) -> int | None:
        """The fragment whose average step `step` waits for and merges, or None."""
        k = self.period // self.fragments
        return None if step % k else (step // k - 1) % self.fragments

    # -- the step --------------------------------------------------------------------------------------
    def on_bucket(self, bucket):
        f = self.starting(self.steps + 1)
        if f is None:
            return
        # the bucket's inner step now (its gradients are final), then its pseudo-gradient starts averaging
        self.optimizer_step(bucket.params)
        self._start(bucket, f)

    def _key(self, bucket, f: int) -> str:
        return bucket.key if self.fragments == 1 else f"{bucket.key}@{f}"

    def _start(self, bucket, f: int) -> None:
        members = [i for i in bucket.members if self.fragment_of[i] == f]
        if not members:
            return
        with torch.no_grad():      # Δ_i = θ − θ_i (DiLoCo Alg. 1 line 12), in the bucket's order
            delta = torch.cat([(self.anchor[i] - self.params[i].detach()).reshape(-1) for i in members])
        fut = self.exchange.start(delta, key=self._key(bucket, f), shapes=[tuple(self.params[i].shape)
                                                                           for i in members])
        self._pending.append((members, fut))
        self._pending_fragment = f

    def step(self):
        n = self.steps + 1
        starting = self.starting(n)
        self.scheduler.flush()      # on a starting step: every bucket's inner step taken and its Δ started
        if starting is None:
            self.optimizer_step()
        self.steps = n
        self._dirty = [True] * self.fragments
        f = self.merging(n)
        if f is not None:
            self._merge([f], self.alpha)
        self.scheduler.end_step()

    @torch.no_grad()
    def _merge(self, fragments: list[int], alpha: float) -> None:
        """Wait for the fragments' averaged pseudo-gradients, step θ with the outer optimizer, then
        θ_local ← α θ_local + (1 − α) θ (Streaming DiLoCo §2.3; α = 0: θ, DiLoCo Alg. 1 line 3)."""
        with self.tracer.span("outer step", "communicate"):
            for members, fut in self._pending:
                mean = fut.wait()
                off = 0
                for i in members:
                    a = self.anchor[i]
                    a.grad = mean[off:off + a.numel()].view_as(a)
                    off += a.numel()
            self._pending, self._pending_fragment = [], None
            members = [i for f in fragments for i in self.groups[f]]
            step_subset(self.outer, [self.anchor[i] for i in members])     # θ ← OuterOpt(θ, Δ) (Alg. 1 line 14)
            for i in members:
                a, p = self.anchor[i], self.params[i]
                a.grad = None
                if alpha == 0.0:
                    p.copy_(a)
                else:
                    p.copy_(torch.lerp(a, p.detach(), alpha))     # θ + α (θ_local − θ), as torch's lerp
            for f in fragments:
                self._dirty[f] = alpha != 0.0
            self.syncs += len(fragments)

    def close(self):
        if self._pending:           # the sync in flight (overlap τ > 0) merges as scheduled
            self._merge([self._pending_fragment], self.alpha)
        due = [f for f in range(self.fragments) if self._dirty[f]]
        if due:                     # one last outer step of what moved; every worker ends with θ
            for bucket in self.scheduler.buckets:
                for f in due:
                    self._start(bucket, f)
            self._merge(due, 0.0)
        super().close()

    # -- buckets re-planned (MG-WFBP): per-piece exchange state follows ------------------------------------
    def _piece_layout(self) -> list[list[tuple[str, int]]]:
        """Per fragment: (key, numel) of its pieces, bucket by bucket (its elements in backward order)."""
        out: list[list[tuple[str, int]]] = [[] for _ in range(self.fragments)]
        for bucket in self.scheduler.buckets:
            for f in range(self.fragments):
                n = sum(self.params[i].numel() for i in bucket.members if self.fragment_of[i] == f)
                if n:
                    out[f].append((self._key(bucket, f), n))
        return out

    def rekey(self, old, new):
        for _, fut in self._pending:    # the exchange's programs have run (their state is settled)
            fut.result()
        layout = self._piece_layout()
        for f in range(self.fragments):
            self.exchange.rekey(self._layout[f], layout[f])
        self._layout = layout

    # -- bookkeeping -----------------------------------------------------------------------------------
    def metrics(self):
        return {**super().metrics(), "period": self.period, "fragments": self.fragments, "overlap": self.overlap,
                "alpha": self.alpha, "outer_optimizer": self.outer_spec or
                f"sgd(lr={self.outer_lr}, momentum={self.outer_momentum}, nesterov={self.nesterov})",
                "syncs": self.syncs, "fragment_params": [sum(self.params[i].numel() for i in g)
                                                         for g in self.groups]}

    def _config(self) -> dict:
        return {"period": self.period, "fragments": self.fragments, "overlap": self.overlap}

    def state_dict(self):
        """Waits for a sync in flight and stores its average: a resumed run continues exactly."""
        pending = [(list(m), fut.wait().clone()) for m, fut in self._pending]
        self._pending = [(m, Ready(v)) for m, v in pending]
        return {**self._config(), "steps": self.steps, "syncs": self.syncs, "dirty": list(self._dirty),
                "anchor": [a.clone() for a in self.anchor], "outer": copy.deepcopy(self.outer.state_dict()),
                "pending": [(m, v.clone()) for m, v in pending], "pending_fragment": self._pending_fragment,
                "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        if {k: state.get(k) for k in self._config()} != self._config():
            raise UserError(f"checkpoint of diloco with {({k: state.get(k) for k in self._config()})}; this "
                            f"run has {self._config()}")
        self.steps, self.syncs, self._dirty = state["steps"], state["syncs"], list(state["dirty"])
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer.load_state_dict(copy.deepcopy(state["outer"]))
        self._pending = [(list(m), Ready(v.clone())) for m, v in state["pending"]]
        self._pending_fragment = state["pending_fragment"]
        self.exchange.load_state_dict(state["exchange"])
