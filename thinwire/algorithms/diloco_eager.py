"""Eager updates for `diloco` (`eager=True`): a fragment's average is not waited for, the worker's own outer gradient
stands in for it until it arrives one round later.

Kale, Douillard, Donchev 2025, "Eager Updates For Overlapped Communication and Computation in DiLoCo", arXiv
2502.12996 (the eager variant of DiLoCo with delayed outer gradients). At the round t of fragment p (every H steps,
the fragments staggered as Streaming DiLoCo's), worker m of M steps θ at once:
    Δ_m^(t) = θ_m − θ_m,local                                  (its own outer gradient; its average starts)
    Δ̃_m^(t) = Δ_m^(t) / M + (Δ^(t−1) − Δ_m^(t−1) / M)         (own current share + the others' previous ones:
                                                                Δ^(t−1) = (1/M) Σ_j Δ_j^(t−1), arrived by now)
    θ_m ← OuterOpt(θ_m, Δ̃_m^(t));  θ_m,local ← θ_m
Every worker's outer gradient is applied exactly once, the others' one round late; θ and the outer optimizer's
state are each worker's own (they differ by the own shares in flight). The sync is hidden behind a whole period:
H inner steps per fragment round instead of τ (so `overlap` and `alpha` stay 0). `close()` applies the averages
still in flight (their others' shares), then averages the workers' models once (one all-reduce of the model)
so that every worker ends with the same model.

Contract: `DiLoCo` holds one `EagerRounds` and calls it where the flat algorithm waits: `keep` as a piece's Δ
starts, `round` in place of a fragment's merge, `close` in place of the last merges, `reset` when a worker is lost.
"""
from __future__ import annotations

import torch

from ..comm.engine import Ready
from ..optim import step_subset
from ..tensors import copy_flat, views
from .diloco_fragments import Fragments


class EagerRounds:
    """Per fragment, the average in flight (started a round ago), this worker's own shares of it and its sync
    clock; the own outer gradients of the pieces started this step (`current`)."""

    def __init__(self, frags: Fragments, anchor: list, outer, exchange, sync_times: list[float],
                 replicas: int | None = None):
        self.frags, self.fragments, self.anchor = frags, frags.count, anchor
        self.outer, self.exchange, self.sync_times = outer, exchange, sync_times
        self.replicas = replicas        # M (None: the exchange's ranks; hierarchical DiLoCo: the islands)
        self.reset()

    def reset(self) -> None:
        """Nothing in flight."""
        self.inflight: list[list] = [[] for _ in range(self.fragments)]   # (segments, future of their mean)
        self.own: list[dict] = [{} for _ in range(self.fragments)]        # segment -> own Δ of the round in flight
        self.clocks: list = [None] * self.fragments
        self.current: dict = {}         # segment -> own Δ taken this step

    def keep(self, piece: list[int], delta: torch.Tensor) -> None:
        """The own Δ of the segments `piece` (flat, in their order): it stands in for their average."""
        self.current.update(zip(piece, views(delta.clone(), [self.anchor[k] for k in piece])))

    @torch.no_grad()
    def round(self, f: int, pending: list, clock) -> None:
        """Fragment f's round: θ ← OuterOpt(θ, Δ_m/M + (Δ_prev − Δ_m,prev/M)) at once, the worker's fragment ← θ;
        this round's average (`pending`, timed by `clock`) stays in flight until f's next round."""
        m = self.replicas or self.exchange.world_size          # the replicas averaged
        ks = self.frags.by_fragment[f]
        own = {k: self.current.pop(k) for k in ks if k in self.current}
        grads = {k: d / m for k, d in own.items()}
        self._apply_delayed(f, grads)
        self._outer_step(ks, {k: grads.get(k, torch.zeros_like(self.anchor[k])) for k in ks})
        for k in ks:
            self.frags.local(k).copy_(self.anchor[k])
        self.inflight[f], self.own[f], self.clocks[f] = pending, own, clock

    def _outer_step(self, ks: list[int], grads: dict) -> None:
        """θ ← OuterOpt(θ, grads) on the segments `ks`."""
        for k in ks:
            self.anchor[k].grad = grads[k]
        step_subset(self.outer, [self.anchor[k] for k in ks])
        for k in ks:
            self.anchor[k].grad = None

    def _apply_delayed(self, f: int, grads: dict) -> None:
        """Add to `grads` the others' shares of fragment f's previous average: Δ_prev − Δ_m,prev / M."""
        m = self.replicas or self.exchange.world_size
        for piece, fut in self.inflight[f]:
            for k, avg in zip(piece, views(fut.wait(), [self.anchor[k] for k in piece])):
                own = self.own[f].get(k)
                delayed = avg if own is None else avg - own / m
                grads[k] = delayed if k not in grads else grads[k] + delayed
        if self.inflight[f] and self.clocks[f] is not None:
            self.sync_times.append(self.clocks[f].elapsed())
        self.inflight[f], self.own[f], self.clocks[f] = [], {}, None

    @torch.no_grad()
    def close(self, transport) -> None:
        """The averages in flight applied (their others' shares, moving θ and the worker's model alike), then one
        average of the workers' models over `transport`: every worker ends with the same model, θ with it."""
        for f in range(self.fragments):
            if not self.inflight[f]:
                continue
            grads: dict = {}
            self._apply_delayed(f, grads)
            ks = [k for k in self.frags.by_fragment[f] if k in grads]
            before = [self.anchor[k].clone() for k in ks]
            self._outer_step(ks, grads)
            for k, b in zip(ks, before):
                self.frags.local(k).add_(self.anchor[k] - b)
        params = [p.detach() for p in self.frags.params]
        flat = torch.cat([p.reshape(-1) for p in params])
        transport.all_reduce(flat, op="mean")
        copy_flat(params, flat)
        for k, a in enumerate(self.anchor):
            a.copy_(self.frags.local(k))

    def in_flight(self) -> list:
        """Every (segments, future) in flight."""
        return [x for f in self.inflight for x in f]

    def state_dict(self) -> dict:
        """Waits for the averages in flight and stores them."""
        inflight = [[(list(m), fut.wait().clone()) for m, fut in f] for f in self.inflight]
        self.inflight = [[(m, Ready(v)) for m, v in f] for f in inflight]
        return {"inflight": [[(m, v.clone()) for m, v in f] for f in inflight],
                "own": [{k: v.clone() for k, v in f.items()} for f in self.own]}

    def load_state_dict(self, state: dict) -> None:
        self.inflight = [[(list(m), Ready(v.clone())) for m, v in f] for f in state.get("inflight", self.inflight)]
        self.own = [{k: v.clone() for k, v in f.items()} for f in state.get("own", self.own)]
