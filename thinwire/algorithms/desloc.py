"""`desloc`: DES-LOC — local Adam whose parameters, first moment and second moment are averaged across the workers
on periods of their own (Iacob, Sani, Safaryan, Giampouras, Horváth, Jovanović, Kurmanji, Aleksandrov, Shen, Qiu,
Lane 2025, "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation Models",
arXiv 2505.22549, ICLR 2026, Algorithm 1).

Every worker m runs the user's Adam (or AdamW) on its own batches; after the local step of step t (1-based):
    u^m ← E_m[u^m]   if t ≡ 0 (mod K_u)        (the first moment: Adam's `exp_avg`)
    v^m ← E_m[v^m]   if t ≡ 0 (mod K_v)        (the second moment: `exp_avg_sq`)
    x^m ← E_m[x^m]   if t ≡ 0 (mod K_x)        (the parameters)
E_m the mean over the workers. K_x = K_u = K_v is Local Adam; the paper's defaults follow the moments'
half-lives: K_u = 3 K_x, K_v = 6 K_x (`period_u`, `period_v` left unset), with K_x = 256 — the setting of its
headline, 170× fewer bytes than DDP (N (1/256 + 1/768 + 1/1536) per step against N) and 2× fewer than Local Adam at
K = 256 (3N/256). The paper clips the gradient before the step; here the user's loop clips it or not, as without
thinwire. The optimizer is the user's: its hyper-parameters come from its param_groups (learning rate and its
schedule, betas, ε, weight decay), its state is the two moments averaged here, and its step count (Adam's bias
correction) is the same on every worker. An optimizer without those moments (SGD, Muon) or with AMSGrad's running
maximum (a third moment the paper does not average) is refused in one line (`check_run`).

The compressor and memory of the run apply where the algebra allows: to the parameters, which travel as their
deltas since the last average, x = x̄ + E_m[C(x^m − x̄)] with error feedback on the deltas (local SGD's,
`thinwire.algorithms.localsgd`). The two moments are averaged in full precision: Adam divides the first by the root
of the second, so a compression error in u is multiplied by 1/(√v + ε), large where v is near zero
(digits-mlp, K_x = 8, with the first moment's deltas through efsignsgd as well: NaN at step 153), and a sparsified
or quantized v can reach zero, or below.

Like `localsgd`, on a step that averages anything each bucket's local Adam step is taken as soon as backward hands
the bucket over, and the averages of its parameters' deltas and moments start at once, overlapped with the rest of
backward; the other steps cost what a plain `optimizer.step()` costs. `close()` averages the parameters once more
if steps were taken since their last average: every worker ends with the same model.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..tensors import copy_each
from ._registry import register
from .base import Algorithm, int_at_least
from .cost import CostFamily

U_RATIO, V_RATIO = 3, 6      # the paper's K_u = 3 K_x, K_v = 6 K_x


def periods(period: int, period_u: int | None = None, period_v: int | None = None) -> tuple[int, int, int]:
    """(K_x, K_u, K_v): the moments' periods the paper's multiples of K_x where they are left unset."""
    return period, period_u or U_RATIO * period, period_v or V_RATIO * period


@register("desloc")
class DESLOC(Algorithm):
    """DES-LOC (Iacob et al. 2025, Alg. 1): local Adam; parameters, first and second moment averaged every K_x,
    K_u and K_v steps."""

    architectures = ("allreduce",)
    schedules = ("none", "wfbp", "fusion", "mgwfbp")
    adam_only = True
    cost = CostFamily("desynced", tunable={"period": (1, 2, 4, 8, 16, 32, 64, 128, 256)})

    def __init__(self, period: int = 256, period_u: int | None = None, period_v: int | None = None,
                 architecture: str | None = None):
        super().__init__(architecture)
        int_at_least("desloc period K_x", period, 1)
        for name, k in (("period_u", period_u), ("period_v", period_v)):
            if k is not None:
                int_at_least(f"desloc {name}", k, 1)
        self.kx, self.ku, self.kv = periods(period, period_u, period_v)

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        if optimizer is None:
            return
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise UserError(f"desloc averages Adam's two moments; got optimizer {type(optimizer).__name__}; valid: "
                            f"torch.optim.AdamW or Adam (--optimizer adamw)")
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise UserError("desloc averages Adam's two moments, not AMSGrad's running maximum: build the optimizer "
                            "with amsgrad=False")

    def setup(self):
        self.check_run(self.world_size, self.optimizer)
        self.exchange = self.make_exchange()                    # the parameters' deltas
        self.plain = self.make_exchange("none", "none")         # the moments, in full precision
        self.anchor = [p.detach().clone() for p in self.params]          # x̄: the last averaged parameters
        self.steps = 0
        self.syncs = {"x": 0, "u": 0, "v": 0}
        self.pending: dict[int, tuple] = {}

    # -- the schedule -----------------------------------------------------------------------------------------
    def due(self, step: int) -> tuple[bool, bool, bool]:
        """Whether step `step` (1-based) averages the parameters, the first moment, the second moment."""
        return step % self.kx == 0, step % self.ku == 0, step % self.kv == 0

    def communicates(self):
        return any(self.due(self.steps + 1))

    # -- the step ---------------------------------------------------------------------------------------------
    def on_bucket(self, bucket):
        """The bucket's local Adam step (its gradients are final), then the averages due start."""
        self.optimizer_step(bucket.params)
        self._start(bucket, *self.due(self.steps + 1))

    def _moment(self, p: torch.Tensor, name: str) -> torch.Tensor:
        return self.optimizer.state[p][name]

    def _start(self, bucket, x: bool, u: bool, v: bool) -> None:
        with torch.no_grad():
            fx = fu = fv = None
            if x:
                fx = self.exchange.start(bucket.flat([p - self.anchor[i] for p, i in zip(bucket.params,
                                                                                        bucket.members)]),
                                         key=bucket.key, shapes=bucket.shapes)
            if u:
                fu = self.plain.start(bucket.flat([self._moment(p, "exp_avg") for p in bucket.params]),
                                      key=f"{bucket.key}:u")
            if v:
                fv = self.plain.start(bucket.flat([self._moment(p, "exp_avg_sq") for p in bucket.params]),
                                      key=bucket.key)
        self.pending[bucket.index] = (fx, fu, fv)

    @torch.no_grad()
    def _apply(self) -> None:
        """Wait for every bucket's averages; x ← x̄ + mean (the new x̄), u ← mean, v ← mean."""
        with self.tracer.span("average", "communicate"):
            for bucket in self.scheduler.buckets:
                fx, fu, fv = self.pending.pop(bucket.index)
                if fx is not None:
                    for p, i, m in zip(bucket.params, bucket.members, bucket.split(fx.wait())):
                        self.anchor[i].add_(m)
                        p.copy_(self.anchor[i])
                for fut, name in ((fu, "exp_avg"), (fv, "exp_avg_sq")):
                    if fut is not None:
                        for p, m in zip(bucket.params, bucket.split(fut.wait())):
                            self._moment(p, name).copy_(m)

    def step(self):
        n = self.steps + 1
        due = self.due(n)
        if any(due):
            self.scheduler.flush()      # every bucket's local step taken and its averages started
            self._apply()
            for name, d in zip("xuv", due):
                self.syncs[name] += d
            self.scheduler.end_step()
        else:
            self.local_update()
        self.steps = n

    def close(self):
        if self.steps % self.kx:        # steps since the parameters' last average: one more
            for bucket in self.scheduler.buckets:
                self._start(bucket, True, False, False)
            self._apply()
        super().close()

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def metrics(self):
        return {**super().metrics(), "period": self.kx, "period_u": self.ku, "period_v": self.kv,
                "syncs": self.syncs["x"], "syncs_u": self.syncs["u"], "syncs_v": self.syncs["v"]}

    def state_dict(self):
        return {"periods": [self.kx, self.ku, self.kv], "steps": self.steps, "syncs": dict(self.syncs),
                "anchor": [a.clone() for a in self.anchor],
                "exchange": self.exchange.state_dict(), "plain": self.plain.state_dict()}

    def load_state_dict(self, state):
        if list(state["periods"]) != [self.kx, self.ku, self.kv]:
            raise UserError(f"checkpoint of desloc with periods (K_x, K_u, K_v) = {tuple(state['periods'])}; this "
                            f"run has {(self.kx, self.ku, self.kv)}")
        self.steps, self.syncs = int(state["steps"]), dict(state["syncs"])
        copy_each(self.anchor, state["anchor"])
        self.exchange.load_state_dict(state["exchange"])
        self.plain.load_state_dict(state["plain"])
