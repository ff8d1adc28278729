"""Helpers over `torch.optim` optimizers, for every layer that applies an update: a step of some parameters only
(a bucket during backward, a layer before its forward, a server's slice, DiLoCo's outer step of one fragment), the
algorithm's own step of the user's optimizer (`own_step`: hooks standing for the training loop's step, those of
`tw.attach`, let it through) and the momentum of a plain heavy-ball SGD (which the Trainer may hand to an
error-feedback memory)."""
from __future__ import annotations

import torch

_stepping: set[int] = set()     # the optimizers an algorithm is stepping now (`own_step`)


def own_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """The algorithm's own step of `optimizer` (of `params` only, if given): `in_own_step(optimizer)` is true
    meanwhile, so that step hooks standing for the loop's own call (`tw.attach`) let it through."""
    key = id(optimizer)
    outer = key not in _stepping
    _stepping.add(key)
    try:
        if params is None:
            optimizer.step()
        else:
            step_subset(optimizer, params)
    finally:
        if outer:
            _stepping.discard(key)


def in_own_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` is being called by an algorithm (`own_step`), not by the training loop."""
    return id(optimizer) in _stepping


def step_subset(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """`optimizer.step()` restricted to `params` (their state, lr and momentum as in a full step)."""
    ids = {id(p) for p in params}
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in ids]
        optimizer.step()
    finally:
        for g, s in zip(optimizer.param_groups, saved):
            g["params"] = s


def heavy_ball(optimizer: torch.optim.Optimizer) -> float | None:
    """The momentum of a plain heavy-ball SGD (every group the same; no dampening, Nesterov or weight decay, so
    that momentum applied before the exchange is the same update), else None."""
    if not isinstance(optimizer, torch.optim.SGD):
        return None
    groups = optimizer.param_groups
    mus = {g.get("momentum", 0.0) for g in groups}
    if len(mus) != 1 or any(g.get("nesterov") or g.get("dampening", 0.0) or g.get("weight_decay", 0.0)
                            for g in groups):
        return None
    return float(mus.pop())
