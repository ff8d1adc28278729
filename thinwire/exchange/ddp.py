"""Every thinwire compressor as a PyTorch DDP communication hook, in one line:

    model = DistributedDataParallel(net)
    model.register_comm_hook(*tw.ddp_hook("topk", memory="residual", ratio=0.01))

`ddp_hook` returns `(state, hook)`, the two arguments `register_comm_hook` takes. The hook runs one `Exchange` per
DDP bucket (key: the bucket's index and size; its parameter shapes passed on, so PowerSGD compresses each weight
matrix) through a thinwire `Transport` on DDP's process group: bytes are metered (`state.meter`), the emulated
network applies, and the returned future completes when the exchange does, so backward goes on while the bucket
is on the wire (the identity compressor all-reduces DDP's bucket in place, as DDP does).

NaN/Inf: with `check_finite` unset a bucket is checked before it is sent (`NonFiniteError`, raised by DDP when it
waits for the bucket) wherever thinwire keeps state it would poison (a compressor, a memory); the identity exchange
keeps none and, like DDP's all-reduce, does not check (the check costs 1.7 ms of a 55 ms step for the 5.8
M-parameter MLP of `thinwire bench overlap`). `check_finite=True` checks there too.

DDP rebuilds its buckets after the first iteration. Per-bucket error feedback follows each parameter: the first
time a bucket is seen, the memory's and compressor's flat per-bucket state is assembled from the slices its
parameters held in their old buckets (`thinwire.compress.base.assemble`), and per-matrix state (PowerSGD's
warm-start Q, drawn per matrix shape) follows its matrix (`regroup`): the result does not depend on DDP's bucketing.

Momentum. A memory (or compressor) that applies the training's momentum before compression (`residual`,
`efsignsgd`, `dgc`, `signum`) cannot see an optimizer that applies it after, and error feedback does not survive
momentum after compression (EF-SGDM, Zheng et al. 2019: onebit + residual beside SGD momentum 0.9 does not train).
The hook learns the optimizer at its first step (a global optimizer step pre-hook, matched by the hooked
parameters) and moves a plain heavy-ball SGD's momentum into that component, as `tw.Trainer` does: from then on the
optimizer runs without it (its first step had no momentum to apply yet; the component's starts from the second
gradient). `ddp_hook(..., optimizer=opt)` does the same at construction; an optimizer whose momentum cannot move
(Nesterov, dampening, weight decay) gets one warning.
"""
from __future__ import annotations

import types
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm import Transport
from ..errors import UserError
from ..compress import compressors, memories
from ..compress.base import assemble
from ..optim import hand_over_momentum, heavy_ball, momentum_taker
from ..registry import route
from .exchange import Exchange, check_collectives


class HookState:
    """What the hook keeps between calls: its Exchange (built on first use, on DDP's process group).

    Args:
        compressor: the compressor (built).
        memory: the error-feedback memory (built).
        process_group: DDP's process group (default: the world).
        network: the network to emulate (default: the launcher's).
        collective: "auto" (the compressor's natural collective) or one it allows: "allreduce",
            "allgather", "majority", "custom".
        check_finite: refuse a bucket holding NaN/Inf before it is sent (None: where state would be poisoned).
        sparse_collective: how a sparse payload is exchanged ("allgather", "gtopk", "shared", "hierarchical").
        start_iter: iterations all-reduced uncompressed before the compressor takes over.
    """

    def __init__(self, compressor, memory, process_group=None, network=None, collective="auto",
                 check_finite: bool | None = None, sparse_collective: str = "allgather", start_iter: int = 0):
        self.compressor, self.memory = compressor, memory
        self.start_iter, self.iter = start_iter, 0     # iterations all-reduced uncompressed; iterations seen
        self.dense: Exchange | None = None             # their exchange: the identity, on the same transport
        self.process_group, self.network = process_group, network
        self.collective, self.sparse_collective, self.check_finite = collective, sparse_collective, check_finite
        self.exchange: Exchange | None = None
        self.slots: dict[int, tuple] = {}    # id(parameter) -> (bucket key, offset, numel) it was last sent under
        self._watched: dict[int, weakref.ref] = {}     # id(parameter) -> the parameter, for `watch_momentum`
        self._watch: tuple | None = None     # (the momentum check's handle, whether it has fired)

    def follow(self, bucket, key) -> None:
        """A bucket seen for the first time under `key` takes over its parameters' flat state."""
        if self._watch is not None and self._watch[1]:
            self._watch[0].remove()
            self._watch = None
        layout, off, moved = [], 0, False
        for p in bucket.parameters():
            if self._watch is not None:
                self._watched[id(p)] = weakref.ref(p)
            old = self.slots.get(id(p))
            layout.append((old[0], old[1], old[1] + p.numel()) if old else (None, 0, p.numel()))
            moved |= old is not None and old[:2] != (key, off)
            self.slots[id(p)] = (key, off)
            off += p.numel()
        if moved:       # a rebuilt bucket: carry its parameters' state over from their old buckets
            ex = self.get_exchange()
            for part in (ex.memory, ex.compressor):
                part.load_state_dict(assemble(part.state_dict(), key, layout))
            regroup = getattr(ex.compressor, "regroup", None)
            if regroup is not None:     # per-matrix state (PowerSGD's warm-start Q) follows its matrix
                regroup(key, layout)

    def watch_momentum(self, taker) -> None:
        """At the first step of an optimizer over the hooked parameters that applies momentum itself while `taker`,
        which would apply it before compression, has none: move a heavy-ball SGD's momentum into `taker`
        (`hand_over_momentum`), else warn once. A global optimizer hook (the optimizer beside DDP is unknown),
        removed at the next bucket (`follow`: torch iterates the global hooks while one runs), holding the state and
        parameters weakly (a finished model's hook keeps nothing alive and matches no new parameter through a
        reused `id()`)."""
        me = weakref.ref(self)

        def check(optimizer, args, kwargs):
            state = me()
            if state is None or state._watch is None or state._watch[1]:
                return
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if not any(state._watched.get(id(p), lambda: None)() is p for p in params):
                return          # another optimizer, or before the first bucket
            state._watch = (state._watch[0], True)      # fired: removed at the next bucket, outside torch's loop
            mu = max((g.get("momentum", 0.0) or 0.0 for g in optimizer.param_groups), default=0.0)
            taker = state._taker
            if not mu or taker.momentum is not None:
                return
            if heavy_ball(optimizer) is not None:       # before this step reads it: it runs without momentum
                hand_over_momentum(optimizer, _GRADIENTS, state.compressor, state.memory)
                return
            warnings.warn(f"tw.ddp_hook: {taker.name!r} applies momentum before compression but "
                          f"{type(optimizer).__name__} applies momentum {mu:g} after it (with Nesterov, dampening or "
                          f"weight decay, which cannot move into {taker.name!r}), and error feedback does not "
                          f"survive that: use plain SGD momentum, or give {taker.name!r} momentum={mu:g} and the "
                          f"optimizer none", UserWarning, stacklevel=2)
        self._taker = taker
        self._watch = (register_optimizer_step_pre_hook(check), False)

    def get_exchange(self, device=None) -> Exchange:
        """The exchange, made on first use (the first bucket's: its buffers live on `device`, the bucket's)."""
        if self.exchange is None:
            transport = Transport(group=self.process_group, network=self.network, device=device)
            ex = Exchange(transport, self.compressor, self.memory, collective=self.collective,
                          sparse_collective=self.sparse_collective)
            ex.check_finite = (not ex.identity) if self.check_finite is None else bool(self.check_finite)
            self.exchange = ex
        return self.exchange

    def get_dense(self, device=None) -> Exchange:
        """The identity exchange of the first `start_iter` iterations, on the same transport (the same meter)."""
        if self.dense is None:
            self.dense = Exchange(self.get_exchange(device).transport, "none", "none", collective=self.collective)
            self.dense.check_finite = bool(self.check_finite)
        return self.dense

    @property
    def meter(self):
        return self.get_exchange().transport.meter

    def state_dict(self) -> dict:
        return self.get_exchange().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.get_exchange().load_state_dict(state)


def thinwire_hook(state, bucket):
    """DDP comm hook: the mean of the bucket over ranks, through the state's compressor and memory; a future
    that completes when the exchange does."""
    buf = bucket.buffer()
    ex, key, shapes = state.get_exchange(buf.device), ("bucket", bucket.index(), buf.numel()), None
    if state.iter < state.start_iter:       # DDP's bucket 0 is the last of an iteration
        state.iter += bucket.is_last()
        ex = state.get_dense(buf.device)
    elif bucket.is_last():
        state.iter += 1
    if not ex.identity:     # the identity exchange keeps no state and uses no structure: nothing to follow
        state.follow(bucket, key)
        params = bucket.parameters()
        shapes = [tuple(p.shape) for p in params] if sum(p.numel() for p in params) == buf.numel() else None
    task = ex.start(buf, key=key, shapes=shapes, inplace=True)
    fut = torch.futures.Future()

    def done(f):
        try:
            fut.set_result(f.result())
        except BaseException as e:  # noqa: BLE001 - DDP raises it when it waits for the bucket
            fut.set_exception(e)
    task.add_done_callback(done)
    return fut


# DDP checks the hook's annotations as objects (this module's are strings under `from __future__`)
thinwire_hook.__annotations__ = {"return": torch.futures.Future[torch.Tensor]}


_GRADIENTS = types.SimpleNamespace(exchanges_gradients=True)   # what DDP all-reduces (for the momentum hand-over)


def ddp_hook(compressor="none", memory="none", process_group=None, network=None, collective: str = "auto",
             check_finite: bool | None = None, optimizer: torch.optim.Optimizer | None = None,
             sparse_collective: str = "allgather", start_iter: int | None = None, **params):
    """`(state, hook)` for `DistributedDataParallel.register_comm_hook`; `params` go to the compressor and the
    memory by name (e.g. `ratio=0.01`, `rank=4`, `momentum=0.9`); an unknown one is a UserError. `optimizer`: the
    optimizer that steps the DDP model, whose heavy-ball momentum moves into a memory (or compressor) that applies
    it before compression, as `tw.Trainer` does; without it the hook finds the optimizer at its first step and
    does the same (see the module's docstring).

    Args:
        compressor: a registered compressor's name ("none": DDP's all-reduce, in place).
        memory: a registered error-feedback memory's name ("residual", "powersgd", ...; "none": none).
        process_group: the process group DDP runs on (default: the world).
        network: the network to emulate (a profile name, "custom:...", or a `Link`; default: the launcher's).
        collective: "auto" (the compressor's natural collective) or one it allows: "allreduce",
            "allgather", "majority", "custom".
        check_finite: refuse a bucket holding NaN/Inf before it is sent (None: wherever a compressor or memory
            keeps state it would poison; True: always).
        optimizer: the optimizer that steps the DDP model, whose momentum moves into a memory (or compressor)
            that applies it before compression (None: found at the first step).
        sparse_collective: how a sparse payload is exchanged ("allgather", "gtopk", "shared", "hierarchical").
        start_iter: iterations all-reduced uncompressed first (metered like the rest); None: 2 for
            `powersgd`, as PyTorch's `powerSGD_hook` at its smallest `start_powerSGD_iter` (default 1000), else 0.
        **params: the compressor's and the memory's parameters, by name (`ratio=0.01`, `rank=4`).

    Returns:
        `(state, hook)`, the two arguments of `DistributedDataParallel.register_comm_hook`.
    """
    comp_params, mem_params = route({"compressor": (compressors, compressor), "memory": (memories, memory)}, params)
    comp, mem = compressors.get(compressor, **comp_params), memories.get(memory, **mem_params)
    check_collectives(comp, collective, sparse_collective)   # fail at construction, not at the first backward
    if start_iter is None:
        start_iter = 2 if comp.name == "powersgd" else 0
    if not isinstance(start_iter, int) or start_iter < 0:
        raise UserError(f"tw.ddp_hook: start_iter must be an integer >= 0, got {start_iter!r}")
    state = HookState(comp, mem, process_group, network, collective, check_finite, sparse_collective, start_iter)
    if optimizer is not None:
        hand_over_momentum(optimizer, _GRADIENTS, comp, mem)
    else:
        taker = momentum_taker(_GRADIENTS, comp, mem)
        if taker is not None and taker.momentum is None:
            state.watch_momentum(taker)
    return state, thinwire_hook
