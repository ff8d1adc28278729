"""Adam's update on the user's own `torch.optim.Adam`/`AdamW`, its moments fed by an algorithm: 1-bit Adam's and 0/1
Adam's steps (`onebit_adam`, `zeroone_adam`) read the learning rate, betas, eps and weight decay from the optimizer's
param groups at every step and keep its per-parameter state (`step`, `exp_avg` = m, `exp_avg_sq` = v) in torch's
layout, so `optimizer.state_dict()` stays the optimizer's and a later `optimizer.step()` goes on from it.

The operations are torch's single-tensor Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization",
Algorithm 1, with its bias corrections; Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", arXiv
1711.05101, for AdamW): with λ the weight decay, coupled (Adam) g ← g + λx before the moments, decoupled (AdamW)
x ← (1 − γλ)x before the update; m ← m + (1 − β1)(g − m), v ← β2 v + (1 − β2) g², and
x ← x − γ/(1 − β1^t) · m / (√v / √(1 − β2^k) + ε), with t the optimizer's step count and k the number of updates v
received (t, unless the variance was frozen or updated on some steps only).
"""
from __future__ import annotations

import torch

from ..errors import UserError

ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def check_adam(optimizer, name: str) -> None:
    """A UserError (one line) where `optimizer` (None: not known yet) is not an Adam these algorithms can drive."""
    if optimizer is None:
        return
    if type(optimizer) not in ADAMS:
        raise UserError(f"{name} runs Adam's update on the optimizer's own moments: give it torch.optim.AdamW or "
                        f"torch.optim.Adam (--optimizer adamw), got {type(optimizer).__name__}")
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise UserError(f"{name} keeps Adam's moments but not AMSGrad's maximum nor maximize: build the "
                            f"optimizer with amsgrad=False, maximize=False")


class AdamState:
    """The per-parameter state and settings of the user's Adam/AdamW for `params` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list):
        self.optimizer, self.params = optimizer, params
        index = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.group_of = [index[id(p)] for p in params]    # (an index: load_state_dict makes new group dicts)

    def group(self, i: int) -> dict:
        return self.optimizer.param_groups[self.group_of[i]]

    def state(self, i: int) -> dict:
        """Parameter i's state, created as torch's Adam creates it (step 0, zero moments) where it has none."""
        p = self.params[i]
        st = self.optimizer.state[p]
        if not st:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32   # torch's
            st["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")     # torch keeps it on the host
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def decay(self, i: int) -> float:
        """1 − γλ, the factor AdamW's decoupled weight decay shrinks x by this step (1: none, or Adam's coupled)."""
        g = self.group(i)
        return 1.0 - float(g["lr"]) * float(g["weight_decay"]) if g["decoupled_weight_decay"] else 1.0

    def gradient(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """g, or g + λx under Adam's coupled weight decay."""
        g = self.group(i)
        if g["weight_decay"] and not g["decoupled_weight_decay"]:
            return grad.add(self.params[i].detach(), alpha=float(g["weight_decay"]))
        return grad

    def moment(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """m ← m + (1 − β1)(g − m) with this worker's gradient; m (the state's tensor)."""
        m = self.state(i)["exp_avg"]
        return m.lerp_(self.gradient(i, grad.reshape(m.shape)), 1 - float(self.group(i)["betas"][0]))

    def variance(self, i: int, grad: torch.Tensor) -> None:
        """v ← β2 v + (1 − β2) g²."""
        v, b2 = self.state(i)["exp_avg_sq"], float(self.group(i)["betas"][1])
        g = self.gradient(i, grad.reshape(v.shape))
        v.mul_(b2).addcmul_(g, g, value=1 - b2)

    def step_rate(self, i: int) -> float:
        """γ/(1 − β1^t) of the step parameter i is about to take (its t-th): its rate with m's bias correction."""
        g = self.group(i)
        return float(g["lr"]) / (1 - float(g["betas"][0]) ** (float(self.state(i)["step"]) + 1))

    def tick(self, i: int) -> None:
        """Parameter i took one more step (the state's `step`)."""
        self.state(i)["step"] += 1

    def mask(self, i: int, m: torch.Tensor) -> torch.Tensor:
        """`m` with zeros where v is exactly zero: DeepSpeed's momentum mask (`exp_avg_mask`), derived. Such an element
        had a zero gradient on every step that fed v; an exchanged momentum there is the compressor's (a sign
        cannot be zero), and divided by ε it would throw the element away."""
        return m.masked_fill(self.state(i)["exp_avg_sq"] == 0, 0)

    def denominator(self, i: int, k: int) -> torch.Tensor:
        """√v / √(1 − β2^k) + ε, v's bias correction after its k updates."""
        g = self.group(i)
        return (self.state(i)["exp_avg_sq"].sqrt() / (1 - float(g["betas"][1]) ** k) ** 0.5).add_(float(g["eps"]))

    def update(self, i: int, k: int) -> None:
        """One Adam step of parameter i from its m, v's bias correction after k updates: AdamW's decoupled decay,
        then x ← x − γ/(1 − β1^t) · m / (√v/√(1 − β2^k) + ε)."""
        rate = self.step_rate(i)
        self.tick(i)
        p, shrink = self.params[i].detach(), self.decay(i)
        if shrink != 1.0:
            p.mul_(shrink)
        p.addcdiv_(self.state(i)["exp_avg"], self.denominator(i, k), value=-rate)
