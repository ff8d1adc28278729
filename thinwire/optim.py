"""Helpers over `torch.optim` optimizers, for every layer that applies an update: a step of some parameters only
(a bucket during backward, a layer before its forward, a server's slice, DiLoCo's outer step of one fragment), the
algorithm's own step of the user's optimizer (`own_step`: hooks standing for the training loop's step, those of
`tw.attach`, let it through) and the momentum of a plain heavy-ball SGD, which the Trainer and the DDP hook hand to the
error-feedback memory that applies it before compression (`hand_over_momentum`)."""
from __future__ import annotations

import torch

from .errors import UserError

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


def momentum_taker(algorithm, compressor, memory):
    """The component that applies the training's momentum itself where `algorithm` exchanges the gradients its
    optimizer applies (`Memory` in compress/base.py, "Momentum"): the compressor (signum) before the memory;
    None where nothing takes it."""
    if not algorithm.exchanges_gradients:
        return None
    return next((c for c in (compressor, memory) if c.takes_momentum), None)


def check_momentum(algorithm, compressor, memory, momentum: float, explicit: bool = True) -> None:
    """Refuse momentum applied twice: a component given its own momentum while the optimizer has one too, or
    (`explicit`: the user's `--momentum`) an optimizer momentum beside a memory that replaces it (demo, sparseloco)."""
    taker = momentum_taker(algorithm, compressor, memory)
    if taker is not None and taker.momentum and momentum:
        kind = "memory" if taker is memory else "compressor"
        raise UserError(f"{kind} {taker.name!r} applies momentum {taker.momentum:g} itself (before compression) and "
                        f"the optimizer has momentum {momentum:g}: run the optimizer with momentum 0 (--momentum 0), "
                        f"or leave the {kind}'s momentum unset so it takes the optimizer's")
    if explicit and momentum and replaces_momentum(algorithm, memory):
        raise UserError(f"memory {memory.name!r} keeps its own momentum (its beta) and the optimizer would add "
                        f"momentum {momentum:g} on top: leave --momentum unset or 0 (or use memory residual)")


def replaces_momentum(algorithm, memory) -> bool:
    return bool(algorithm.exchanges_gradients and memory.replaces_momentum)


def hand_over_momentum(optimizer, algorithm, compressor, memory) -> float:
    """Move the optimizer's heavy-ball momentum into the component that applies it before compression (where
    the algorithm exchanges gradients and the component's momentum is unset) and run the optimizer without it:
    error feedback with momentum after compression loses (EF-SGDM, Zheng et al. 2019; DGC's momentum correction,
    Lin et al. 2018 §3.2). Returns the momentum handed over (0: none)."""
    if replaces_momentum(algorithm, memory):     # DeMo's / SparseLoCo's accumulator is the momentum
        for g in optimizer.param_groups:
            if "momentum" in g:
                g["momentum"] = 0.0
        return 0.0
    taker = momentum_taker(algorithm, compressor, memory)
    mu = heavy_ball(optimizer)
    if taker is None or mu is None:
        return 0.0
    check_momentum(algorithm, compressor, memory, mu)
    if taker.momentum is not None:
        return 0.0
    taker.momentum = mu
    for other in (compressor, memory):      # a second component able to take it applies none
        if other is not taker and other.takes_momentum and other.momentum is None:
            other.momentum = 0.0
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
    return mu


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the hidden weight matrices, AdamW on every other parameter: how MuLoCo trains DiLoCo's workers
    (Thérien, Huang, Defazio, Rish, Belilovsky 2025, "MuLoCo: Muon is a practical inner optimizer for DiLoCo",
    arXiv 2505.23725), and how Muon is meant to be used (Jordan et al. 2024, "Muon: An optimizer for hidden layers
    in neural networks": the embeddings, the classifier head, biases and gains stay with AdamW).

    Muon is `torch.optim.Muon` (Nesterov momentum, the update orthogonalized by five Newton–Schulz iterations), its
    learning rate scaled so that its update's RMS matches AdamW's (`adjust_lr_fn="match_rms_adamw"`, Liu et al.
    2025, "Muon is Scalable for LLM Training", arXiv 2502.16982): both parts take the same learning rate and weight
    decay. Its param groups and state are the two inner optimizers' own (Muon's first), so `step_subset` and
    `state_dict()` work as for any torch.optim optimizer."""

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float, momentum: float = 0.95,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        bad = [tuple(p.shape) for p in muon_params if p.dim() != 2]
        if bad:
            raise ValueError(f"Muon takes 2-D weight matrices only, got shapes {bad}")
        if not muon_params:
            raise UserError(NO_HIDDEN_MATRIX)
        self.inner = []
        if muon_params:
            self.inner.append(torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                               nesterov=True, adjust_lr_fn="match_rms_adamw"))
        if adamw_params:
            self.inner.append(torch.optim.AdamW(adamw_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        super().__init__(muon_params + adamw_params, {"lr": lr, "weight_decay": weight_decay})
        self._link()

    def _link(self, groups: list | None = None) -> None:
        """The inner optimizers' groups and state are this optimizer's (the same objects)."""
        if groups is None:
            groups = [g for opt in self.inner for g in opt.param_groups]
        self.param_groups, at = groups, 0
        for opt in self.inner:
            n = len(opt.param_groups)
            opt.param_groups, at = groups[at:at + n], at + n
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner:
            opt.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link(self.param_groups)


NO_HIDDEN_MATRIX = ("the muon optimizer trains a model's hidden weight matrices (the weights of its nn.Linear "
                    "layers before the output layer) with Muon and the rest with AdamW; this model has none, so "
                    "Muon would train nothing: use --optimizer adamw (optimizer=\"adamw\")")


def muon_split(model: torch.nn.Module) -> tuple[list, list]:
    """(hidden weight matrices, the rest) of `model`'s trainable parameters: the weights of its `nn.Linear` layers
    but the last one (the output head); embeddings, biases, norms and everything else in the rest. A model with no
    hidden weight matrix (a linear model, convolutions and a head) is refused: it would train with AdamW alone."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hidden = {id(m.weight) for m in linears[:-1] if m.weight.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    if not any(id(p) in hidden for p in params):
        raise UserError(NO_HIDDEN_MATRIX)
    return [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]
