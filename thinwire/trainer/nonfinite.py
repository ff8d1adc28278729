"""The NaN/Inf policy of the Trainer (and of the race's peers): what a non-finite gradient does to a run.

- `stop` (default): this rank raises `nonfinite_stop`'s error and the launcher stops every rank. The gradients are
  checked on their device each step (`FiniteGuard`, a few device ops, nothing read) and the verdict is read by the
  host once, with the next exchange's own finiteness read, at a checkpoint and at close.
- `skip`: every rank's verdict before anything is sent (`nonfinite_flag` then one small all-reduce per step), and
  all skip the step; it runs schedule "none" (`nonfinite_params`).
"""
from __future__ import annotations

import threading

import torch

from ..compress.finite import NonFiniteError
from ..errors import UserError


def nonfinite_stop(rank: int, step: int, seen: str = "") -> NonFiniteError:
    """The error of the NaN/Inf policy `stop` (the Trainer's and the peers'): this rank raises, and the launcher
    stops every rank. Without `seen`: nothing of the step was applied; with it (the Trainer's check, read where
    `seen` says): nothing computed from the gradient was sent, though this worker's own steps since applied it."""
    what = "nothing was applied" if not seen else (f"seen {seen}: nothing computed from it was sent (this "
                                                   f"worker's own steps since applied it)")
    return NonFiniteError(f"rank {rank}: NaN or Inf in the gradient at step {step}; {what} (policy nonfinite=stop)")


def nonfinite_flag(grads: list[torch.Tensor], found: torch.Tensor) -> None:
    """Set `found` (a float tensor of one element, on the gradients' device) to 1 if any of `grads` (on that
    device) holds NaN or Inf, on the device, nothing read by the host. Only reads the gradients: one of them may
    be in flight (a bucket all-reduced in place during backward, whose gradients are views of it), and a check
    that wrote them back (as GradScaler's unscale does, at a scale of 1) would put this rank's own values over
    the collective's result. Per dtype, the extremes of each tensor (NaN and ±Inf show there, and no finite
    value overflows), then one check of those: on a GPU one fused max-abs norm of every tensor
    (`torch._foreach_norm`, ord ∞), on the CPU each tensor's `aminmax` (a vectorised read; the CPU's ∞-norm is
    eight times slower); sparse gradients by their values."""
    with torch.no_grad():
        by_dtype: dict = {}
        for g in grads:
            g = g.detach().coalesce().values() if g.is_sparse else g.detach()
            if g.numel():
                by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            extremes = ([m for g in same for m in torch.aminmax(g)] if same[0].device.type == "cpu"
                        else torch._foreach_norm(same, float("inf")))
            bad = ~torch.stack(extremes).isfinite().all()
            found.copy_(torch.maximum(found, bad.to(found.dtype)))


class FiniteGuard:
    """The NaN/Inf policy `stop` without a host read per step (see the module's doc; the exchange reads the verdict
    through `Exchange.guard`, before anything is sent). An error names the first step whose gradient was not finite."""

    def __init__(self, params: list[torch.Tensor], rank: int):
        self.rank = rank
        devices = sorted({p.device for p in params}, key=str)
        self.device = devices[0]
        self.groups = None if len(devices) == 1 else {d: [i for i, p in enumerate(params) if p.device == d]
                                                      for d in devices}
        self.flags = torch.zeros(2, device=self.device)      # [found, steps checked before the first bad one]
        self._found, self._clean = self.flags[:1], self.flags[1:]
        self.steps: list[int] = []                           # the steps checked since the last verdict
        self._lock = threading.Lock()

    def check(self, params: list[torch.Tensor], step: int) -> None:
        """Check the gradients of step `step` (on the device; nothing read)."""
        with self._lock:
            found = self._found
            if self.groups is None:
                grads = [g for p in params if (g := p.grad) is not None]
                if grads:
                    nonfinite_flag(grads, found)
            else:
                for d, idx in self.groups.items():
                    grads = [params[i].grad for i in idx if params[i].grad is not None]
                    if grads:
                        f = found if d == self.device else torch.zeros(1, device=d)
                        nonfinite_flag(grads, f)
                        if f is not found:
                            found.copy_(torch.maximum(found, f.to(self.device)))
            self._clean.add_(found == 0)
            self.steps.append(step)

    def read_with(self, extra: torch.Tensor | None = None, seen: str = "with an exchange") -> list[float]:
        """One host read of `extra` (a small device tensor; may be None) and of the verdict on the gradients
        checked since the last read; raises `NonFiniteError` if one was not finite, else returns extra's
        values."""
        with self._lock:
            if not self.steps:
                return [] if extra is None else extra.tolist()   # host: the one read of this exchange
            parts = [self.flags] if extra is None else [extra.reshape(-1).to(self.device, torch.float32), self.flags]
            values = torch.cat(parts).tolist()             # host: the one read of this exchange
            found, clean = values[-2:]
            if found:
                raise nonfinite_stop(self.rank, self.steps[int(clean)], seen)
            self.flags.zero_()
            self.steps.clear()
            return values[:-2]


def nonfinite_params(nonfinite: str, params: dict) -> dict:
    """`params` with the schedule the NaN/Inf policy `nonfinite` needs: "skip" agrees on every rank before any
    gradient is sent, so it runs schedule "none" (another schedule is refused); "stop" changes nothing."""
    if nonfinite not in ("stop", "skip"):
        raise UserError(f"nonfinite must be 'stop' or 'skip', got {nonfinite!r}")
    if nonfinite == "stop":
        return params
    if params.get("schedule", "none") != "none":
        raise UserError("nonfinite='skip' needs schedule='none' (gradients are checked on every rank "
                        "before any is sent); use nonfinite='stop' with overlapping schedules")
    return {**params, "schedule": "none"}
