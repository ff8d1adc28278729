"""`dts`, `delayed`, `tsparse`: delayed and temporally sparse updates with error compensation
(Zhu, Lu, Lin, Han 2019, "Distributed Training Across the World" (DTS), §3). The schedule and the update are
`DTS`'s docstring; the derivation of the momentum-SGD compensation (weights and momentum buffer) is in docs/dts.md:

Momentum SGD (b <- μ b + g, w <- w - γ_s b) and any learning-rate schedule (γ_s: the rate step s used): with
E = kp, Δ = s - E, B_{k,j} = Σ_{i in window} μ^{E-i} g_{i,j}, C_{k,j} = Σ_{r in window} γ_r B_{r,j} (B_r: B after
step r) and F_k = Σ_{r=E+1}^{s} γ_r μ^{r-E} (a scalar per parameter group),
  b <- b + μ^Δ (B̄_k - B_{k,j}),    w <- w - (C̄_k - C_{k,j}) - F_k (B̄_k - B_{k,j})
which is exactly the state synchronous momentum SGD reaches with the averaged gradients of window k. With μ = 0
only C (= Σ γ_r g_r) is sent, for p = 1 only g (C = γ_s g, B = g); otherwise C and B together. C travels in units of
the window's first rate (gradient units at a constant rate).

Weight decay λ (per group) couples w into b: B <- μ B + g - λ C inside the window, and the difference a window
makes is carried from E to s by the product M of the per-step 2×2 matrices [[1 - γ_r λ, -γ_r μ], [λ, μ]] acting
on (Δw, Δb): (Δw, Δb) = M (-(C̄ - C), B̄ - B) (with λ = 0, M = [[1, -F], [0, μ^Δ]], the form above).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ..comm.engine import Ready
from ..errors import UserError
from ..tensors import copy_each, copy_flat, views
from ._registry import register
from .base import Algorithm, int_at_least
from .cost import CostFamily


_IDENTITY = ((1.0, 0.0), (0.0, 1.0))


def _carry(m, rate: float, decay: float, mu: float):
    """S M for one more step at `rate`: S = [[1 - γλ, -γμ], [λ, μ]] maps a difference (Δw, Δb) of the state
    before the step to the one after it (b' = μ b + g + λ w, w' = w - γ b'; docs/dts.md)."""
    (a, b), (c, d) = m
    s00, s01, s10, s11 = 1.0 - rate * decay, -rate * mu, decay, mu
    return ((s00 * a + s01 * c, s00 * b + s01 * d), (s10 * a + s11 * c, s10 * b + s11 * d))


@register("dts")
class DTS(Algorithm):
    """Delayed (delay t) + temporally sparse (period p) SGD with error compensation (eqs. 2-4).

    Steps s = 1, 2, ...; window k holds steps (k-1)p+1 .. kp. Worker j, vanilla SGD, rate γ_s at step s:
      every step       w <- w - γ_s g_{s,j}                                      (eq. 2, local update)
      at s = kp        launch the average over workers of C_{k,j} = Σ_{i in window k} γ_i g_{i,j}
      at s = (k+t-1)p  wait for it and compensate  w <- w - (C̄_k - C_{k,j})      (eqs. 3 and 4)
    so the average of a window is applied t - 1 windows ((t-1)p steps) after it is launched, with at most
    t - 1 averages in flight, applied in launch order (a late one delays, never reorders, the compensation).
    p = 1 is the delayed update of eq. 3 (average of step s applied at step s + t - 1); t = 1 is the
    temporally sparse update of eq. 4; t = p = 1 is synchronous SGD.

    Momentum SGD and weight decay: the compensation of the module's doc.

    `close()` launches the partial last window, waits for every average in flight and applies them all at
    the last step (Δ counted from each window's last step): every worker then holds the same model up to
    float rounding (the compensations start from each worker's own weights), and rank 0's model and momentum
    buffers are broadcast so that the models are bitwise identical.
    What is averaged can go through any compressor and memory of the Trainer (Zhu et al. §4.3 use DGC).
    """

    overlaps_steps = True
    survives_failures = True   # a lost worker's windows are dropped; the survivors average among themselves
    sgd_only = True
    # The planner's staleness bound, (t − 1)·p, the steps a window's average waits after its launch (docs/dts.md,
    # docs/benchmarks/dts-accuracy.md, 4 workers, 3 seeds). With momentum 0.9 accuracy stays within ~1 pp of bsp for
    # (t − 1)·p ≤ 3 and is lost beyond (dts(2,4) −4…−27 pp, dts(4,4) −7…−27 pp; in paper-dts on mnist1d-resnet
    # dts(4,4) did not learn, and on stdlib-lm over `world` dts(3,8) reached loss 3.74 in 45 s where dts(1,16) reached
    # 2.85). With plain SGD at the same effective rate dts(4,4) and dts(2,8) stay within −1.2…+2.6 pp of bsp and
    # dts(2,20) within 3 pp.
    cost = CostFamily("delayed", {"delay": 4, "period": 4}, tunable={"delay": (1, 2, 3, 4, 6, 8),
                      "period": (1, 2, 4, 8, 16)}, max_staleness=(3, 20))

    # defaults within the accuracy bound under momentum 0.9, (t − 1)·p <= 3 (`cost`; docs/dts.md: t = p = 4,
    # 12 steps of staleness, lost 7–27 pp); `thinwire compare` tunes them to the network
    def __init__(self, delay: int = 2, period: int = 2, architecture: str | None = None):
        super().__init__(architecture)
        self.delay = int_at_least("delay", delay, 1)
        self.period = int_at_least("period", period, 1)

    # -- wiring ----------------------------------------------------------------------------------------
    def check_components(self, compressor, memory):
        super().check_components(compressor, memory)
        if compressor.needs_momentum_first:
            # measured (docs/matrix.md): dts/delayed/tsparse x signsgd, onebit, efsignsgd ended at 0.45-0.91
            raise UserError(f"{self.name} compensates momentum SGD after the exchange, and {compressor.name!r} "
                            "trains only with the momentum applied before the sign (EF-SGDM): use signum, topk, "
                            f"qsgd or terngrad with {self.name}, or {compressor.name} with bsp, bitsgd or cdsgd")

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        if optimizer is None:
            return
        if type(optimizer) is not torch.optim.SGD:
            raise UserError(f"{self.name} compensates plain or momentum SGD; got optimizer "
                            f"{type(optimizer).__name__}; valid: torch.optim.SGD (--optimizer sgd)")
        momenta = {float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
        for g in optimizer.param_groups:
            if g.get("nesterov") or g.get("dampening", 0.0) != 0.0 or g.get("maximize"):
                raise UserError(f"{self.name} supports SGD with dampening=0, nesterov=False, maximize=False")
        if len(momenta) != 1 or not 0.0 <= next(iter(momenta)) < 1.0:
            raise UserError(f"{self.name} needs one momentum in [0, 1) for all parameter groups, got {sorted(momenta)}")

    def setup(self):
        opt = self.optimizer
        self.check_run(self.world_size, opt)
        self.mu = float(opt.param_groups[0].get("momentum", 0.0))
        self._decay = [float(g.get("weight_decay", 0.0)) for g in opt.param_groups]   # λ per group
        self.exchange = self.make_exchange()
        # with p = 1 the discounted sum B equals C; with μ = 0 it is not needed
        self._two = self.mu > 0.0 and self.period > 1
        index = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        self._gi = [index[id(p)] for p in self.params]          # parameter -> its group
        self.steps = 0
        # C_{k,j} and B_{k,j} of this window, per parameter: the rate-weighted sum and the μ-discounted sum
        # (momentum, p > 1) of the local gradients. A bucket's [C|B] (interleaved element by element, so the
        # exchange's per-bucket state follows a re-plan of buckets) is averaged at the window's last step.
        self._every = list(range(len(self.params)))
        self._c = [torch.zeros_like(p) for p in self.params]
        self._b = [torch.zeros_like(p) for p in self.params] if self._two else None
        self._in_window = 0
        self._ref = None      # per group: the rate of the window's first step (C is sent in its units)
        self._launched: list = []          # this step's bucket launches: (members, local [C|B], future)
        self._flight: deque = deque()      # [window's last step, launches, ref rates, post factors]
        self.launched = self.applied = self.max_in_flight = 0

    def _rates(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # -- the step --------------------------------------------------------------------------------------
    def communicates(self):
        """Only the window's last step sends (its buckets' averages start during its backward)."""
        return self._in_window + 1 == self.period

    def on_bucket(self, bucket):
        """This step's gradients of the bucket into the window's sums; at the window's last step, the bucket's
        average starts at once (overlapping the rest of backward)."""
        self._accumulate(bucket.members, bucket.views)
        if self._in_window + 1 == self.period:
            self._launch(bucket.members, bucket.key)

    def _accumulate(self, members: list[int], grads: list[torch.Tensor]) -> None:
        """This step's gradients `grads` of parameters `members` into the window's sums C (and B)."""
        rates = self._rates()                   # the rates this step's optimizer update uses
        if self._ref is None:   # p = 1: C = g exactly (ratio 1), the rate may be 0; else a nonzero unit
            self._ref = list(rates) if self.period == 1 else [r if r != 0.0 else 1.0 for r in rates]
        decayed = ({i for i in members if self._decay[self._gi[i]] != 0.0} if self._in_window > 0 and
                   any(self._decay) else ())
        if self._two:
            bs = [self._b[i] for i in members]
            torch._foreach_mul_(bs, self.mu)                     # B <- μ B + g (- λ C with weight decay)
            torch._foreach_add_(bs, grads)
            source = bs                                          # C += (γ_s / γ_ref) B  (docs/dts.md)
        elif decayed:
            source = [g.clone() for g in grads]                  # B = g - λ C, this step's only
        else:
            source = grads                                       # C += (γ_s / γ_ref) g
        for k, i in enumerate(members if decayed else ()):       # C in units of γ_ref: λ γ_ref C
            gi = self._gi[i]
            if i in decayed:
                source[k].sub_(self._c[i], alpha=self._decay[gi] * self._ref[gi])
        if len(self._decay) == 1:               # one parameter group: one fused add
            ratio = 1.0 if self.period == 1 else rates[0] / self._ref[0]
            torch._foreach_add_([self._c[i] for i in members], source, alpha=ratio)
            return
        for gi in sorted({self._gi[i] for i in members}):
            ks = [k for k, i in enumerate(members) if self._gi[i] == gi]
            ratio = 1.0 if self.period == 1 else rates[gi] / self._ref[gi]
            torch._foreach_add_([self._c[members[k]] for k in ks], [source[k] for k in ks], alpha=ratio)

    def _launch(self, members: list[int], key: str) -> None:
        flat = torch.cat([self._c[i].reshape(-1) for i in members])
        if self._two:
            bflat = torch.cat([self._b[i].reshape(-1) for i in members])
            flat = torch.stack([flat, bflat], dim=1).reshape(-1)      # [c0, b0, c1, b1, ...]
        for i in members:
            self._c[i].zero_()
            if self._two:
                self._b[i].zero_()
        local = flat.clone()                    # kept: the exchange owns `flat` until it completes
        self._launched.append((members, local, self.exchange.start(flat, key=key)))

    def step(self):
        if self.communicates():
            self.scheduler.flush()              # every bucket summed and launched (at the window's end)
        else:                                   # a sparse step: this step's gradients into the sums, here
            self.scheduler.local_step()
            self._accumulate(self._every, [p.grad for p in self.params])
        rates = self._rates()
        self._in_window += 1
        self.steps += 1
        if self._in_window == self.period:
            self._close_window()
        self.optimizer_step()                       # eq. 2: local gradient now
        mu = self.mu                                # this step carries each in-flight window on: M <- S_s M
        for entry in self._flight:
            if entry[0] < self.steps:
                entry[3] = [_carry(m, r, lam, mu) for m, r, lam in zip(entry[3], rates, self._decay)]
        due = (self.delay - 1) * self.period       # the average of the window ending at E is applied at E+(t-1)p
        while self._flight and self._flight[0][0] + due <= self.steps:
            self._apply_oldest()
        self.max_in_flight = max(self.max_in_flight, len(self._flight))   # in flight during compute
        self.scheduler.end_step()

    def _close_window(self) -> None:
        self._flight.append([self.steps, self._launched, list(self._ref), [_IDENTITY] * len(self._ref)])
        self._launched, self._ref, self._in_window = [], None, 0
        self.launched += 1

    def _apply_oldest(self) -> None:
        """Wait for the oldest average in flight and apply its compensation at the current step."""
        _, launches, ref, post = self._flight.popleft()
        for members, local, fut in launches:
            err = fut.wait() - local      # [C|B] interleaved; p = 1: C = g = B (the rate ratio is exactly 1)
            err_c, err_b = err.view(-1, 2).unbind(1) if self._two else (err, err)
            self._compensate(members, err_c, err_b, ref, post)
        self.applied += 1

    @torch.no_grad()
    def _compensate(self, members: list[int], err_c: torch.Tensor, err_b: torch.Tensor, ref: list[float],
                    post: list) -> None:
        """(Δw, Δb) = M (-γ_ref (C̄ - C), B̄ - B): with λ = 0, w -= γ_ref (C̄ - C) + F (B̄ - B) and
        b += μ^Δ (B̄ - B)   (eqs. 3-4; docs/dts.md)."""
        mu = self.mu
        ps = [self.params[i] for i in members]
        for i, p, ec, eb in zip(members, ps, views(err_c, ps), views(err_b, ps)):
            gi = self._gi[i]
            (ww, wb), (bw, bb) = post[gi]
            p.add_(ec, alpha=-ref[gi] * ww)
            buf = self.optimizer.state[p].get("momentum_buffer") if mu > 0.0 else None
            if buf is not None and bw != 0.0:
                buf.add_(ec, alpha=-ref[gi] * bw)
            if mu > 0.0:
                if wb != 0.0:
                    p.add_(eb, alpha=wb)
                if buf is not None:
                    buf.add_(eb, alpha=bb)

    def recover(self):
        """The windows in flight were averaged over the old group: dropped; the survivors restart from the new
        rank 0's model and momentum with empty windows."""
        for t in self._c + (self._b or []):
            t.zero_()
        self._launched, self._flight, self._ref = [], deque(), None
        self._in_window = self.steps % self.period          # the current window goes on (from empty sums)

    # -- elastic jobs: a newcomer joins at a window's end, where the members drain ------------------------
    def join_boundary(self, step):
        return self._in_window == 0 and self.steps > 0

    def join_after(self, step):
        """Members run up to t - 1 windows apart (a rank waits only for the average launched t - 1 windows ago)."""
        return step + self.delay * self.period

    def before_switch(self):
        """Every average in flight is applied now (on the old group): the new group starts with none."""
        while self._flight:
            self._apply_oldest()

    def newcomer_state(self):
        return {"steps": self.steps, "counters": [self.launched, self.applied, self.max_in_flight]}

    def take_newcomer_state(self, state):
        self.steps, self._in_window = int(state["steps"]), 0
        self.launched, self.applied, self.max_in_flight = (int(v) for v in state["counters"])

    def after_join(self):
        """The members drained to the same model up to float rounding: rank 0's makes them (and the newcomer's)
        bitwise equal, momentum buffers included."""
        self._same_everywhere()

    def rekey(self, old, new):
        """Per-bucket exchange state is kept per element of [C|B] (two elements per parameter element when B
        travels too)."""
        f = 2 if self._two else 1
        self.exchange.rekey([(k, f * n) for k, n in old], [(k, f * n) for k, n in new])

    def close(self):
        """Launch the partial last window, then apply every average in flight, in order."""
        if self._in_window > 0:
            for bucket in self.scheduler.buckets:
                self._launch(bucket.members, bucket.key)
            self._close_window()
        while self._flight:
            self._apply_oldest()
        self._same_everywhere()
        super().close()

    @torch.no_grad()
    def _same_everywhere(self) -> None:
        """After the last compensation every worker holds the same model up to float rounding (each corrected
        its own weights): rank 0's parameters and momentum buffers make them bitwise identical (one broadcast,
        at close only, like the Trainer's initial one not counted as training traffic)."""
        if self.world_size == 1:
            return
        tensors = list(self.params)
        if self.mu > 0.0:
            tensors += [b for b in (self.optimizer.state[p].get("momentum_buffer") for p in self.params)
                        if b is not None]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        dist.broadcast(flat, group=self.transport.group, group_src=0)
        copy_flat(tensors, flat)

    # -- bookkeeping -----------------------------------------------------------------------------------
    def metrics(self):
        return {"delay": self.delay, "period": self.period, "averages_launched": self.launched,
                "averages_applied": self.applied, "max_in_flight": self.max_in_flight}

    def state_dict(self):
        """Waits for the averages in flight and stores them as tensors: a resumed run continues exactly."""
        flight = []
        for entry in self._flight:
            launches = [(members, local, Ready(fut.wait())) for members, local, fut in entry[1]]
            entry[1] = launches
            flight.append({"end": entry[0], "launches": [(m, loc.clone(), fut.value.clone())
                                                         for m, loc, fut in launches],
                           "ref": list(entry[2]), "post": list(entry[3])})
        return {"delay": self.delay, "period": self.period, "steps": self.steps, "in_window": self._in_window,
                "c": [t.clone() for t in self._c], "b": None if self._b is None else [t.clone() for t in self._b],
                "ref": None if self._ref is None else list(self._ref), "in_flight": flight,
                "counters": [self.launched, self.applied, self.max_in_flight],
                "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        if (state["delay"], state["period"]) != (self.delay, self.period):
            raise UserError(f"checkpoint has delay={state['delay']}, period={state['period']}; "
                            f"this {self.name} has delay={self.delay}, period={self.period}")
        self.steps, self._in_window = state["steps"], state["in_window"]
        copy_each(self._c + (self._b or []), state["c"] + (state["b"] or []))
        self._ref = None if state["ref"] is None else list(state["ref"])
        self._flight = deque([f["end"], [(list(m), loc.clone(), Ready(avg.clone())) for m, loc, avg in f["launches"]],
                              list(f["ref"]), [tuple(tuple(row) for row in m) for m in f["post"]]]
                             for f in state["in_flight"])
        self.launched, self.applied, self.max_in_flight = state["counters"]
        self.exchange.load_state_dict(state["exchange"])


@register("delayed")
class Delayed(DTS):
    """Delayed update (eqs. 2-3): local step now, average of step s applied at step s + delay - 1."""

    cost = CostFamily("delayed", {"period": 1}, tunable={"delay": (1, 2, 3, 4, 6, 8, 12, 16, 20)},
                      max_staleness=(3, 20))

    def __init__(self, delay: int = 4, architecture: str | None = None):
        super().__init__(delay=delay, period=1, architecture=architecture)

    def check_components(self, compressor, memory):
        super().check_components(compressor, memory)
        if compressor.name == "signum":     # measured (docs/matrix.md): 0.93 (dts: 0.98, tsparse: 0.98)
            raise UserError("delayed applies every step's average delay - 1 steps late, and signum here is a sign "
                            "without its momentum (the algorithm applies the momentum after the exchange), which "
                            "stayed below target: use signum with dts or tsparse, or topk, qsgd or terngrad with "
                            "delayed")


@register("tsparse")
class TemporallySparse(DTS):
    """Temporally sparse update (eq. 4): local steps, compensation every `period` steps."""

    cost = CostFamily("delayed", {"delay": 1}, tunable={"period": (1, 2, 4, 8, 16, 32)})

    def __init__(self, period: int = 4, architecture: str | None = None):
        super().__init__(delay=1, period=period, architecture=architecture)
