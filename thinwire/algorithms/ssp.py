"""`ssp`: stale-synchronous parallel SGD on the parameter server (Ho et al. 2013, "More Effective Distributed
ML via a Stale Synchronous Parallel Parameter Server", NeurIPS 2013; Tang, Shi, Chu, Wang, Li 2020,
"Communication-Efficient Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §III-B, eq. 7, whose
guaranteed-visible sum stops at k = t - s - 1, not at t as printed)."""
from __future__ import annotations

from collections import deque

from ..errors import UserError
from ..tensors import copy_flat
from ._registry import register
from .base import int_at_least
from .ps_sync import PSBSP, StalenessAware, net_momentum


@register("ssp")
class SSP(StalenessAware, PSBSP):
    """Workers run up to s clocks ahead. The server applies a bucket's clock-c update, the mean of the n workers'
    clock-c gradients (Tang et al. eq. 6), when the last of them arrives, and answers each with the slice that
    includes it. A worker keeps up to s clocks in flight: after pushing clock c it waits only for the answers to
    clock c - s, so the model it holds has every update of clocks <= c - s (the SSP read rule of Ho et al.
    2013), and computes on Tang et al. eq. 7:
        x_{i,c+1} = x_0 - γ Σ_{k<=c-s} Σ_j G_{j,k} - γ Σ_{k=c-s+1}^{c} G_{i,k} - γ Σ_{(j,k) ∈ S} G_{j,k}
    i.e. the server's model as answered (first and third terms) plus this worker's own updates the server has not
    answered yet (second term), each as the server will apply it: -(γ_τ/n)·G_{i,k}, γ_τ the staleness-aware rate
    of `StalenessAware` (its momentum part is the server's alone). s = 0 is exactly `bsp` on the PS. The
    staleness τ <= s of every applied gradient is recorded.

    `lookahead=True` (default) computes on an estimate of where the server's model is by now, not where it was
    (DANA: Hakimi, Barkai, Gabel, Schuster 2019, "Taming Momentum in a Distributed Asynchronous Environment",
    arXiv 1907.11612, which computes each gradient at the model's estimated future position): the W clocks still in
    flight will each carry the server's momentum on, so the worker adds Σ_{j=1..W} μ_e^j u to eq. 7's model, u the
    last answered clock's update (the change of the model its answers brought) and μ_e the server's momentum
    (`StalenessAware.server_momentum`, from the staleness this worker's answers report). Without momentum, at
    s = 0 (nothing in flight) and before the first answer it adds nothing: s = 0 stays `bsp` on the PS exactly.

    The default bound is s = 1: one clock in flight hides one round trip to the servers per step, and every
    further clock costs steps. Ho et al. 2013 (Theorem 1) bound SSP SGD's regret by O(√((s + 1) P T)), growing
    with s; and with momentum μ a gradient d steps stale is stable only while its effective rate γλ/(1 − μ) stays
    below about 1/d on the stiffest direction λ (the roots of z^{d+2} − (1 + μ) z^{d+1} + μ z^d + γλ z inside the
    unit circle; at d = 0 heavy ball allows 2(1 + μ)/(1 − μ), 38 at μ = 0.9), so each clock of staleness shrinks
    the rate that trains. Where answers come no sooner than the next push the staleness sits at the bound (τ = s
    on every clock): on digits-mlp, 4 workers on `lan`, 8 epochs, s = 2 ended at 0.886 and s = 1 at 0.931 without
    the look-ahead (above), 0.950 with it (`bsp` on the PS, s = 0: 0.956; docs/ps.md)."""

    def __init__(self, architecture: str | None = None, staleness: int = 1, scale: str = "staleness",
                 implicit_momentum: bool = True, lookahead: bool = True, servers: int = 1,
                 downlink_compressor: str = "none", downlink_params: dict | None = None):
        super().__init__(architecture, scale, implicit_momentum, servers, downlink_compressor, downlink_params)
        self.staleness = int_at_least("ssp staleness bound", staleness, 0)
        if not isinstance(lookahead, bool):
            raise UserError(f"ssp lookahead must be true or false, got {lookahead!r}")
        self.lookahead = lookahead
        self._window: deque = deque()    # clocks in flight: ({bucket index: (answer, own gradient)}, τ)

    def on_bucket(self, bucket):
        g = bucket.buffer.clone()        # the push outlives the step; eq. 7's own term needs it
        self.pending[bucket.index] = (self.exchange.start(g, bucket.key), g)

    def step(self):
        self._worker_only()
        self.scheduler.flush()
        self._window.append((self.pending, len(self._window)))
        self.pending = {}
        self._settle(self.staleness)
        self.scheduler.end_step()

    def _settle(self, keep: int = 0) -> None:
        """Take the answers to every clock but the last `keep` (the answers to clock c - s are required) and any
        fresher ones already in, then load Tang et al. eq. 7: those answers plus this worker's own updates not
        answered yet."""
        window, held, before = self._window, self.worker.held, None
        while window and (len(window) > keep or all(f.is_completed() for f, _ in window[0][0].values())):
            before = [h.clone() for h in held] if self.lookahead else None    # the model before this clock's answers
            for fut, _ in window.popleft()[0].values():
                fut.wait()
        lr, n = self.optimizer.param_groups[0]["lr"], self.layout.workers
        mu = self.worker_momentum() if before is not None and window else 0.0
        ahead = sum(mu ** j for j in range(1, len(window) + 1))
        for bucket in self.scheduler.buckets:
            x = held[bucket.index].clone()
            if ahead:       # DANA's estimated position: the momentum the clocks in flight carry on
                x.add_(held[bucket.index] - before[bucket.index], alpha=ahead)
            for clock, tau in window:
                x.add_(clock[bucket.index][1], alpha=-lr * self.lr_factor([tau]) / n)
            copy_flat(bucket.params, x)
        self.worker.commit()

    def worker_momentum(self) -> float:
        """μ_e, the momentum the server runs (`StalenessAware.server_momentum`), from the staleness of this worker's
        answers."""
        mu = self.optimizer.param_groups[0].get("momentum", 0.0)
        hist = self.worker.staleness
        if not (mu and self.implicit_momentum and hist):
            return mu
        return net_momentum(mu, sum(k * v for k, v in hist.items()) / sum(hist.values()))

    def state_dict(self) -> dict:
        if self.worker is not None:     # a quiescent point: every answer in, the model the server's
            self._settle()
        return super().state_dict()

    def close(self) -> None:
        if self.worker is not None:
            self._settle()              # the last answer: the server's model
        super().close()
