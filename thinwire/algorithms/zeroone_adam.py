"""`zeroone-adam`: 0/1 Adam (Lu, Li, Zhang, De Sa, He 2022, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", arXiv 2202.06009, Algorithm 1), on the user's own Adam/AdamW (`adam_state`).

Two policies replace 1-bit Adam's full-precision warm-up. Adaptive variance freezing (T_v): the variance is updated
from the full-precision mean gradient ḡ on steps whose gaps double after every κ updates (`var_update_scaler`: steps
1..κ, then every 2nd step κ times, every 4th, ...) up to `var_freeze_step`, and frozen after it. 1-bit sync (T_u):
every other step exchanges the momentum compressed; after the freeze the workers take local steps and sync every H
steps, H doubling every `local_step_scaler` steps up to `local_step_clipper` (the paper's learning-rate-based policy,
as its authors' DeepSpeed implementation counts it). On worker i, with t' the last sync and γ̃_t = γ_t/(1 − β1^t):

    step t ∈ T_v:   ḡ = mean_i g_i (full precision); m ← β1 m + (1 − β1) ḡ; v ← β2 v + (1 − β2) ḡ²; an Adam step of x
                    (so the steps 1..κ are the user's Adam on the mean gradient);
    otherwise:      m_i ← β1 m + (1 − β1) g_i;  x_i ← x_i − γ̃_t m_i / (√v + ε);  u_i ← u_i + γ̃_t m_i
    and if t ∈ T_u: ū = TwoSided(u_i) (the compressed all-reduce with two-sided error feedback, `TwoSidedExchange`);
                    x ← x_t' − ū / (√v + ε);  m ← ū / Σ_{h=t'+1..t} γ̃_h;  u ← 0.

On a step of T_v the full-precision mean feeds both moments and no 1-bit round is needed, as in the authors'
implementation (DeepSpeed's `ZeroOneAdam`). With AdamW's decoupled weight decay each local step also shrinks x by
1 − γ_tλ: u and Σγ̃ carry the shrink of the later steps (u ← (1 − γ_tλ)u + γ̃_t m_i) and x_t' its product S, so
x ← S x_t' − ū/(√v + ε) is still each local trajectory with the mean of the momenta, the same on every worker. v's bias
correction counts its own updates. Defaults: DeepSpeed's (its tutorial sets `var_freeze_step` at the end of the
learning-rate warm-up, or past the run's end: the variance steps then thin out on their own); `local_step_scaler`
32678 keeps H = 1 for that many steps after the freeze. `close()` syncs once more if local steps were taken since
the last sync: every worker ends with the same model.
"""
from __future__ import annotations

import torch

from ..tensors import copy_each
from ._registry import register
from .base import Algorithm, int_at_least
from .cost import CostFamily
from .onebit_adam import OneBitAdam


@register("zeroone-adam")
class ZeroOneAdam(OneBitAdam):
    """0/1 Adam (Lu et al. 2022, Alg. 1): adaptive variance freezing and 1-bit syncs of the accumulated momentum,
    local steps after the freeze."""

    cost = CostFamily("compressed_momentum")
    # (see OneBitAdam._MISSES) u = Σ γ̃ m is the learning rate times the momentum: an absolute threshold sends next to
    # nothing of it (threshold, threshold2bit: 0.68); DeMo's and SparseLoCo's payloads without their own memories
    # (their momentum, refused here) have no error feedback (0.84, 0.71)
    _MISSES = {**OneBitAdam._MISSES,
               **dict.fromkeys(("threshold", "threshold2bit"), ("its threshold is absolute and 0/1 Adam exchanges the "
                               "learning rate times the momentum: it sends next to nothing (digits-mlp: 0.68)", False)),
               **dict.fromkeys(("demo", "sparseloco"), ("its sparse payload has no error feedback without memory "
                               "residual (digits-mlp: 0.84 and 0.71)", True))}

    def __init__(self, var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, architecture: str | None = None):
        Algorithm.__init__(self, architecture)
        self.var_freeze_step = int_at_least("zeroone-adam var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = int_at_least("zeroone-adam var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = int_at_least("zeroone-adam local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = int_at_least("zeroone-adam local_step_clipper", local_step_clipper, 1)

    @staticmethod
    def full_precision_steps(params, steps):
        """The variance steps T_v among the first `steps`: κ (var_update_scaler) at the multiples of each gap 1, 2,
        4, ... after the last one at the gap before, none after var_freeze_step."""
        kappa, limit = int(params["var_update_scaler"]), min(steps, int(params["var_freeze_step"]))
        last, gap, count = 0, 1, 0
        while True:
            before = last // gap                    # the multiples of the gap up to the last variance step
            n = min(kappa, max(0, limit // gap - before))
            count += n
            if n < kappa:
                return count
            last, gap = (before + kappa) * gap, gap * 2

    def setup(self):
        super().setup()
        self.var_interval, self.var_counter = 1, 0          # T_v: the gap between variance steps, updates at it
        self.local_interval, self.local_counter = 1, 0      # T_u after the freeze: H, steps at it
        self.u = [torch.zeros_like(p) for p in self.params]
        n = len(self.params)
        self.rates, self.shrinks = [0.0] * n, [1.0] * n     # Σ γ̃ since the last sync and S, per parameter
        self.anchor: list | None = None                     # x_t' once local steps are taken
        self.unsynced = 0                                   # local steps since the last sync

    # -- the policies ----------------------------------------------------------------------------------------
    def frozen(self) -> bool:
        return self.steps + 1 > self.var_freeze_step

    def variance_step(self) -> bool:
        return not self.frozen() and (self.steps + 1) % self.var_interval == 0

    def communicates(self):
        return not self.frozen() or (self.steps + 1) % self.local_interval == 0

    def _advance(self, variance: bool) -> None:
        if variance:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        if self.frozen():
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)
        self.steps += 1

    # -- the step --------------------------------------------------------------------------------------
    def _accumulate(self, i: int, grad: torch.Tensor) -> None:
        """m_i ← β1 m + (1 − β1) g_i; u_i ← (1 − γλ) u_i + γ̃ m_i, and Σγ̃ and S alike."""
        m, rate, shrink = self.adam.moment(i, grad), self.adam.step_rate(i), self.adam.decay(i)
        self.u[i].mul_(shrink).add_(m, alpha=rate)
        self.rates[i] = shrink * self.rates[i] + rate
        self.shrinks[i] *= shrink

    def on_bucket(self, bucket):
        if self.variance_step():
            self.pending[bucket.index] = self.plain.start(bucket.buffer, bucket.key, inplace=True)
            return
        for i, g in zip(bucket.members, bucket.views):
            self._accumulate(i, g)
        self.pending[bucket.index] = self.exchange.start(bucket.flat([self.u[i] for i in bucket.members]),
                                                         bucket.key, bucket.shapes)

    def _sync(self, members: list[int], means: list[torch.Tensor]) -> None:
        """x ← S x_t' − ū/(√v + ε), m ← ū/Σγ̃, u ← 0 for `members` given their ū."""
        for i, mean in zip(members, means):
            x = self.params[i].detach()
            base = x if self.anchor is None else self.anchor[i]
            st, mean = self.adam.state(i), self.adam.mask(i, mean)
            step = mean / self.adam.denominator(i, self.variance_steps)
            x.copy_(base * self.shrinks[i] - step if self.shrinks[i] != 1.0 else base - step)
            st["exp_avg"].copy_(mean / self.rates[i] if self.rates[i] > 0 else torch.zeros_like(mean))
            self.u[i].zero_()
            self.rates[i], self.shrinks[i] = 0.0, 1.0
        if self.anchor is not None:
            copy_each([self.anchor[i] for i in members], [self.params[i] for i in members])

    def step(self):
        variance = self.variance_step()
        if variance:                        # the user's Adam on the mean gradient, v's bias correction its own
            self.scheduler.flush()
            for bucket, mean in self.arrived():
                if mean.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(mean.reshape(-1))
            self.variance_steps += 1
            for i, p in enumerate(self.params):
                self.adam.moment(i, p.grad)
                self.adam.variance(i, p.grad)
                self.adam.update(i, self.variance_steps)
        elif self.communicates():           # a 1-bit sync of the momentum accumulated since the last one
            self.scheduler.flush()
            for bucket, mean in self.arrived():
                self._sync(bucket.members, bucket.split(mean))
                for i in bucket.members:
                    self.adam.tick(i)
            self.unsynced = 0
        else:                               # a local step
            self.scheduler.local_step()
            if self.anchor is None:
                self.anchor = [p.detach().clone() for p in self.params]
            for i, p in enumerate(self.params):
                self._accumulate(i, p.grad)
                self.adam.update(i, self.variance_steps)
            self.unsynced += 1
        self._advance(variance)
        self.scheduler.end_step()

    def close(self):
        self.finish_began()
        if self.unsynced:                   # local steps since the last sync: one more sync, no step
            for bucket in self.scheduler.buckets:
                self.pending[bucket.index] = self.exchange.start(
                    bucket.flat([self.u[i] for i in bucket.members]), bucket.key, bucket.shapes)
            for bucket, mean in self.arrived():
                self._sync(bucket.members, bucket.split(mean))
            self.unsynced = 0
        Algorithm.close(self)

    # -- state -----------------------------------------------------------------------------------------
    def metrics(self):
        return {**Algorithm.metrics(self), "variance_steps": self.variance_steps, "local_interval": self.local_interval,
                "frozen": self.steps > self.var_freeze_step}

    def state_dict(self):
        return {**super().state_dict(), "var": [self.var_interval, self.var_counter],
                "local": [self.local_interval, self.local_counter], "u": [u.clone() for u in self.u],
                "rates": list(self.rates), "shrinks": list(self.shrinks), "unsynced": self.unsynced,
                "anchor": None if self.anchor is None else [a.clone() for a in self.anchor]}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.var_interval, self.var_counter = (int(v) for v in state["var"])
        self.local_interval, self.local_counter = (int(v) for v in state["local"])
        copy_each(self.u, state["u"])
        self.rates, self.shrinks = [float(r) for r in state["rates"]], [float(s) for s in state["shrinks"]]
        self.unsynced = int(state["unsynced"])
        self.anchor = None if state["anchor"] is None else [a.clone() for a in state["anchor"]]
