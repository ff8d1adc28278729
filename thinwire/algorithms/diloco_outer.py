"""DiLoCo's outer optimizer where the user leaves its settings unset: they follow the inner optimizer and the
period H (`outer_settings`, called by `DiLoCo.setup` with the run's optimizer; the planner's `outer_defaults`).

The outer step (Nesterov SGD: b ← μ b + Δ, θ ← θ − lr (Δ + μ b)) moves a pseudo-gradient that points the same way
sync after sync by lr / (1 − μ) times its size: 7 at the paper's lr 0.7, μ 0.9 (Douillard et al. 2023, "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv 2311.08105, §3), tuned there for AdamW inner
steps at H = 500. It overshoots where
- the inner optimizer is SGD: its heavy ball already moves a steady gradient by 1/(1 − μ_in) (10 at momentum 0.9),
  which the outer momentum compounds, and a plain SGD that reaches its shard's optimum within a period hands over
  a pseudo-gradient that is the whole way there (linreg: 0.0008 before the last syncs, 1.53 after them);
- syncs are frequent: the outer momentum builds up over about 1/(1 − μ) = 10 syncs, a few dozen inner steps at
  H = 8, and then multiplies the inner learning rate the user tuned by 7.
So (`outer_defaults`): SGD, with or without momentum, gets model averaging (lr 1, μ 0: local SGD exactly, the
momentum local SGD of Yu, Jin, Yang 2019, arXiv 1905.03817) at every H; any other inner optimizer (AdamW, Adam,
Muon) gets the paper's from H = FULL_PERIOD on, and below it a point on the straight line from model averaging to
the paper's: s = H / FULL_PERIOD, lr = 1 − 0.3 s, μ = 0.9 s (Nesterov). Measurements in docs/diloco.md ("Outer
settings that follow the inner optimizer").

Settings the user gives are kept (over these defaults for the rest); a combination whose amplification, times the
inner SGD's, reaches DIVERGES warns in one line (rank 0): SGD momentum 0.9 under the paper's outer settings (70)
diverged (full-data loss 1.04 → 20.8 from step 80 to 240 on a 4-class MLP, 2 workers, H = 10), under lr 0.5 (50)
rose from 0.51 to 0.99; 35 and 30 stalled near 0.3.
"""
from __future__ import annotations

import warnings

import torch

PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}          # Douillard et al. 2023
MODEL_AVERAGING = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": True}
FULL_PERIOD = 24      # stdlib-lm, AdamW, H = 24: the paper's settings 2.045, model averaging 2.066 (docs/diloco.md)
DIVERGES = 50.0       # the outer step's amplification × the inner SGD's, measured to diverge


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """The inner optimizer as `outer_defaults` names it: "sgd" for torch.optim.SGD, else its class name."""
    return "sgd" if isinstance(optimizer, torch.optim.SGD) else type(optimizer).__name__.lower()


def outer_defaults(period: int, optimizer: str) -> dict:
    """The outer SGD's settings for period H and an inner optimizer named as the workloads name it ("sgd",
    "adamw", "muon", ...): model averaging for SGD; else the paper's from FULL_PERIOD on, and below it the point
    s = H / FULL_PERIOD of the straight line from model averaging to the paper's."""
    s = min(1.0, period / FULL_PERIOD)
    if optimizer.lower() == "sgd":
        return dict(MODEL_AVERAGING)
    if s == 1.0:
        return dict(PAPER)
    return {"outer_lr": 1.0 - (1.0 - PAPER["outer_lr"]) * s, "outer_momentum": PAPER["outer_momentum"] * s,
            "nesterov": True}


def outer_settings(optimizer: torch.optim.Optimizer, period: int, given: dict, warn: bool = True) -> dict:
    """`given` (the outer settings the user set) over `outer_defaults` for this optimizer and period; one warning
    line (`warn`: rank 0's) where they compound the inner SGD's momentum into a measured divergence."""
    out = {**outer_defaults(period, kind_of(optimizer)), **given}
    gain = max(((1.0 - g.get("dampening", 0.0)) / (1.0 - g.get("momentum", 0.0)) for g in optimizer.param_groups),
               default=1.0) if kind_of(optimizer) == "sgd" else 1.0
    total = out["outer_lr"] / (1.0 - out["outer_momentum"]) * gain
    if warn and given and total >= DIVERGES:
        warnings.warn(f"thinwire: diloco outer_lr={out['outer_lr']:g}, outer_momentum={out['outer_momentum']:g} "
                      f"amplify the inner SGD momentum's steps {total:.0f}x, measured to diverge (docs/diloco.md); "
                      f"leave them unset (SGD: outer_lr=1, outer_momentum=0, local SGD)", UserWarning, stacklevel=2)
    return out
