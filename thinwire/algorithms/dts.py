"""`dts`, `delayed`, `tsparse`: delayed and temporally sparse updates with error compensation (seed 004 §3).

Every step a worker updates its model with its own gradient (seed 004 eq. 2) and keeps what it used; every
`period` steps it launches the average of its window and goes on training; `delay` - 1 windows later it waits
for that average and corrects the model by the difference between the average and what it used (eqs. 3, 4).
The derivation of the momentum-SGD compensation (weights and momentum buffer) is in docs/dts.md.
"""
from __future__ import annotations

from collections import deque

import torch

from ..errors import UserError
from ..exchange import Exchange
from . import register
from .base import Algorithm


class _Ready:
    """An average already received (restored from a checkpoint)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value

    def is_completed(self) -> bool:
        return True


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@register("dts")
class DTS(Algorithm):
    """Delayed (delay t) + temporally sparse (period p) SGD with error compensation (seed 004 eqs. 2-4).

    Steps s = 1, 2, ...; window k holds steps (k-1)p+1 .. kp. Worker j, vanilla SGD, rate γ:
      every step       w <- w - γ g_{s,j}                                        (eq. 2, local update)
      at s = kp        launch the average over workers of A_{k,j} = Σ_{i in window k} g_{i,j}
      at s = (k+t-1)p  wait for it and compensate  w <- w - γ (Ā_k - A_{k,j})    (eqs. 3 and 4)
    so the average of a window is applied t - 1 windows ((t-1)p steps) after it is launched, with at most
    t - 1 averages in flight, applied in launch order (a late one delays, never reorders, the compensation).
    p = 1 is the delayed update of eq. 3 (average of step s applied at step s + t - 1); t = 1 is the
    temporally sparse update of eq. 4; t = p = 1 is synchronous SGD.

    Momentum SGD (b <- μ b + g, w <- w - γ b): with Δ = s - kp and B_{k,j} = Σ_{i in window} μ^{kp-i} g_{i,j},
      b <- b + μ^Δ (B̄_k - B_{k,j}),    w <- w - γ ((Ā_k - A_{k,j}) - μ^{Δ+1} (B̄_k - B_{k,j})) / (1 - μ)
    which is exactly the state synchronous momentum SGD reaches with the averaged gradients of window k
    (docs/dts.md). For p = 1, B = A and one vector is sent; for p > 1 and μ > 0, A and B are sent together.

    `close()` launches the partial last window, waits for every average in flight and applies them all at
    the last step (Δ counted from each window's last step), so every worker ends with the same model.
    What is averaged can go through any compressor and memory of the Trainer (seed 004 §4.3 uses DGC).
    """

    architectures = ("allreduce",)

    def __init__(self, delay: int = 4, period: int = 4, architecture: str | None = None):
        super().__init__(architecture)
        self.delay = _positive_int("delay", delay)
        self.period = _positive_int("period", period)

    # -- wiring ----------------------------------------------------------------------------------------
    def setup(self):
        opt = self.optimizer
        if type(opt) is not torch.optim.SGD:
            raise UserError(f"{self.name} compensates plain or momentum SGD; got optimizer "
                            f"{type(opt).__name__}; valid: torch.optim.SGD")
        momenta = {float(g.get("momentum", 0.0)) for g in opt.param_groups}
        for g in opt.param_groups:
            if g.get("nesterov") or g.get("dampening", 0.0) != 0.0 or g.get("maximize"):
                raise UserError(f"{self.name} supports SGD with dampening=0, nesterov=False, maximize=False")
        if len(momenta) != 1 or not 0.0 <= next(iter(momenta)) < 1.0:
            raise UserError(f"{self.name} needs one momentum in [0, 1) for all parameter groups, got {sorted(momenta)}")
        self.mu = next(iter(momenta))
        self.exchange = Exchange(self.transport, self.trainer.compressor, self.trainer.memory)
        # with p = 1 the discounted sum B equals A; with μ = 0 it is not needed
        self._two = self.mu > 0.0 and self.period > 1
        self._group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        self.steps = 0
        # [A_{k,j} | B_{k,j}]: sum and μ-discounted sum (momentum, p > 1) of this window's local gradients,
        # one flat buffer (what is averaged) with per-parameter views (accumulated without a copy)
        self._numel = sum(p.numel() for p in self.params)
        self._new_accumulator()
        self._flight: deque = deque()             # (window's last step, local [A|B], handle), in order
        self.launched = self.applied = self.max_in_flight = 0

    def _new_accumulator(self) -> None:
        n = self._numel
        self._acc = torch.zeros((2 if self._two else 1) * n, dtype=self.params[0].dtype)
        self._views_a = self._views(self._acc[:n])
        self._views_b = self._views(self._acc[n:]) if self._two else None
        self._in_window = 0

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    # -- the step --------------------------------------------------------------------------------------

    def step(self):
        grads = self.grads()
        torch._foreach_add_(self._views_a, grads)                # A += g
        if self._two:
            torch._foreach_mul_(self._views_b, self.mu)          # B <- μ B + g
            torch._foreach_add_(self._views_b, grads)
        self._in_window += 1
        self.steps += 1
        if self._in_window == self.period:
            self._launch()
        self.optimizer_step()                       # seed 004 eq. 2: local gradient now
        s, p = self.steps, self.period
        if s % p == 0 and s // p >= self.delay:     # the average of window s/p - t + 1 is due
            self._apply_oldest()
        self.max_in_flight = max(self.max_in_flight, len(self._flight))   # in flight during compute

    def _launch(self) -> None:
        local = self._acc.clone()                   # kept: the exchange may use its tensor in place
        handle = self.exchange.start(self._acc, key="dts")
        self._flight.append((self.steps, local, handle))
        self._new_accumulator()
        self.launched += 1

    def _apply_oldest(self) -> None:
        """Wait for the oldest average in flight and apply its compensation at the current step."""
        end, local, handle = self._flight.popleft()
        err = handle.wait() - local
        n = self._numel
        err_a = err[:n]
        err_b = err[n:] if self._two else err_a
        self._compensate(err_a, err_b, self.steps - end)
        self.applied += 1

    @torch.no_grad()
    def _compensate(self, err_a: torch.Tensor, err_b: torch.Tensor, age: int) -> None:
        mu = self.mu
        if mu == 0.0:
            dw = err_a                                              # seed 004 eqs. 3, 4
        elif not self._two:                                         # p = 1: B = A, Σ_{r<=Δ} μ^r
            dw = err_a * ((1.0 - mu ** (age + 1)) / (1.0 - mu))
        else:
            dw = (err_a - mu ** (age + 1) * err_b) / (1.0 - mu)
        offset = 0
        for p in self.params:
            k = p.numel()
            group = self._group_of[id(p)]
            p.add_(dw[offset:offset + k].view_as(p), alpha=-group["lr"])
            if mu > 0.0:
                buf = self.optimizer.state[p].get("momentum_buffer")
                if buf is not None:
                    buf.add_(err_b[offset:offset + k].view_as(p), alpha=mu ** age)
            offset += k

    def close(self):
        """Launch the partial last window, then apply every average in flight, in order."""
        if self._in_window > 0:
            self._launch()
        while self._flight:
            self._apply_oldest()

    # -- bookkeeping -----------------------------------------------------------------------------------
    def metrics(self):
        return {"delay": self.delay, "period": self.period, "averages_launched": self.launched,
                "averages_applied": self.applied, "max_in_flight": self.max_in_flight}

    def state_dict(self):
        """Waits for the averages in flight and stores them as tensors: a resumed run continues exactly."""
        flight = []
        for i, (end, local, handle) in enumerate(self._flight):
            value = handle.wait()
            self._flight[i] = (end, local, _Ready(value))
            flight.append({"end": end, "local": local.clone(), "average": value.clone()})
        return {"delay": self.delay, "period": self.period, "steps": self.steps, "in_window": self._in_window,
                "accumulated": self._acc.clone(), "in_flight": flight,
                "counters": [self.launched, self.applied, self.max_in_flight],
                "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        if (state["delay"], state["period"]) != (self.delay, self.period):
            raise UserError(f"checkpoint has delay={state['delay']}, period={state['period']}; "
                            f"this {self.name} has delay={self.delay}, period={self.period}")
        self.steps, self._in_window = state["steps"], state["in_window"]
        self._acc.copy_(state["accumulated"])
        self._flight = deque((f["end"], f["local"].clone(), _Ready(f["average"].clone())) for f in state["in_flight"])
        self.launched, self.applied, self.max_in_flight = state["counters"]
        self.exchange.load_state_dict(state["exchange"])


@register("delayed")
class Delayed(DTS):
    """Delayed update (seed 004 eqs. 2-3): local step now, average of step s applied at step s + delay - 1."""

    name = "delayed"

    def __init__(self, delay: int = 4, architecture: str | None = None):
        super().__init__(delay=delay, period=1, architecture=architecture)


@register("tsparse")
class TemporallySparse(DTS):
    """Temporally sparse update (seed 004 eq. 4): local steps, compensation every `period` steps."""

    name = "tsparse"

    def __init__(self, period: int = 4, architecture: str | None = None):
        super().__init__(delay=1, period=period, architecture=architecture)
