"""`Exchange`: the averaged value of one tensor across ranks, through a compressor and its memory.

The flow of one `start(tensor, key)` (GRACE's compensate → compress → update → communicate → decompress):

1. `memory.compensate(tensor, key)` adds the error-feedback state;
2. `compressor.compress(...)` makes the payload (after the ranks `agree` on a shared scale, if it needs one);
3. `memory.update(compensated, key, sent)` with `sent` = this rank's own decompressed contribution;
4. the collective the compressor's algebra allows (`thinwire.compress.base` declares it, `choose` picks it):
   "allreduce" sums the payload tensors (widened or pre-scaled by `sum_payload`; tensors of one dtype fused into
   one all-reduce), or all-gathers the packed codes where that sends fewer bytes (`pick_by_bytes`: `choose.pick`);
   "allgather" packs each rank's payload into ONE uint8 buffer (`wire.pack`) for one variable-size all-gather,
   then `compressor.aggregate`, unless the ranks' sizes make an all-reduce of the decoded tensors cheaper on the
   transport's link (`choose.dense_is_cheaper`; not where the all-gather was named); "majority" gathers, then
   votes; "custom" runs the compressor's rounds (`rounds.run_rounds`: PowerSGD sums P, orthogonalises, sums Q);
5. the future's `wait()` decompresses/aggregates and returns the mean over ranks (same shape and dtype).

`start` submits all of this as one program to the engine (`thinwire.comm.engine`) and returns its future at
once: rounds that need an earlier round's result (an agreed scale, PowerSGD's second all-reduce, a sparse
collective's rounds) run on the engine's thread while the caller computes; decompression runs in `wait()`. The
program reads `tensor` when it runs, maybe after `start` returned: the caller leaves it untouched until the future
completes, or passes a copy (`inplace=True` lets the identity exchange all-reduce it in place, as DDP does a
bucket). Every change of state (memory, compressor, step counters) happens in the program, so in submission order
on every rank whatever the timing.

Granularity is the caller's: a parameter's gradient, a bucket or the whole flattened model, each under its own
`key`, which per-key state (residuals, PowerSGD's Q, shared seeds) follows; `shapes` (the parameter shapes a flat
tensor is made of) lets PowerSGD treat each parameter as a matrix. The exchange alone names the collective:
`collective` and, replacing a top-k family's all-gather, `sparse_collective` (`sparse.py`), checked at
construction (`check_collectives`).

Robust aggregation (`aggregate="median" | "trimmed" | "clip"`, with `trim` β or `clip` τ: `robust.py`): every rank's
contribution is gathered (never summed: the all-gather, whatever the compressor would pick), each is decoded, and
the rule reduces them in place of the mean. `faulty="RANK:KIND"` emulates a faulty rank (`faulty.py`): its
contribution is corrupted as it enters the program, after its own check.

NaN/Inf: with `check_finite=True` (the default) a non-finite value raises `NonFiniteError` naming the key and rank
BEFORE anything is compressed, remembered or sent, so no rank's model or memory is poisoned; with `False` such
values travel as they are (dense paths spread them to every rank: visible, never silent; sparsifiers may drop NaNs
into their memory). A `guard` (given at construction) shares that check's one host read: `guard.read_with(extra)`
reads `extra` (1.0 where this tensor's sum is finite) with its own verdict on earlier tensors, raises where that
one is not finite, and returns extra's values.
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import Transport
from ..comm.transport import backend_of
from ..comm.engine import Ready
from ..compress import Compressor, Memory, Payload, compressors, memories
from ..compress.finite import NonFiniteError
from ..errors import UserError
from . import faulty as _faulty
from . import robust as _robust
from . import sparse as _sparse
from . import wire
from .choose import (COLLECTIVES, GLOO_SUM_WIDEN as _GLOO_WIDEN, allowed_collectives, dense_is_cheaper, densifies,
                     pick, resolve_collective)
from .rounds import run_rounds

__all__ = ["COLLECTIVES", "Exchange", "allowed_collectives", "check_collectives", "resolve_collective"]


def check_collectives(compressor: Compressor, collective: str = "auto", sparse_collective: str = "allgather",
                      aggregate: str = "mean", trim=None, clip=None, faulty=None) -> str:
    """The collective an exchange through `compressor` runs with these choices; a UserError where one is invalid.
    A robust `aggregate` (`robust.make`) needs every rank's contribution: the all-gather."""
    _faulty.parse(faulty)
    robust = _robust.make(aggregate, trim, clip)
    if robust is not None and (collective not in ("auto", "allgather") or sparse_collective != "allgather"
                               or "allgather" not in allowed_collectives(compressor)):
        named = sparse_collective if sparse_collective != "allgather" else collective
        raise UserError(f"aggregate={aggregate} gathers every rank's contribution; it cannot run with "
                        f"{'compressor ' + repr(compressor.name) if named == 'auto' else 'collective ' + repr(named)}"
                        f" (valid: collective auto or allgather, a compressor whose payloads can be gathered)")
    resolved = resolve_collective(compressor, "allgather" if robust is not None else collective)
    _sparse.check(sparse_collective, compressor)
    return resolved


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:
        return False


class Exchange:
    """Average tensors across the ranks of `transport`, compressed (see the module docstring): `start(tensor, key,
    shapes=None)` returns a future of the mean over ranks (for "majority": the vote), same shape and dtype;
    `aggregate(...)` is the synchronous form. A collective the compressor's algebra does not allow is a `UserError`
    here. `background` and `serial`: how its programs run on the engine (`thinwire.sched.Scheduler.modes`)."""

    def __init__(self, transport: Transport, compressor: "str | Compressor" = "none",
                 memory: "str | Memory" = "none", collective: str = "auto", check_finite: bool = True,
                 sparse_collective: str = "allgather", background: bool = False, serial: bool = False,
                 guard=None, aggregate: str = "mean", trim=None, clip=None, faulty=None, **params):
        if params:
            raise UserError(f"unexpected exchange parameters: {sorted(params)}; valid: collective, check_finite, "
                            f"sparse_collective, background, serial, guard, aggregate, trim, clip, faulty")
        self.transport = transport
        self.background, self.serial = bool(background), bool(serial)
        self.compressor, self.memory = compressors.get(compressor), memories.get(memory)   # an object: as it is
        self.collective = check_collectives(self.compressor, collective, sparse_collective, aggregate, trim, clip,
                                            faulty)
        # a robust rule (robust.py) reduces every rank's contribution: always gathered
        self.robust = _robust.make(aggregate, trim, clip)
        self.faulty = None if faulty is None else _faulty.Faulty(faulty)   # an emulated faulty rank (faulty.py)
        self.auto = collective == "auto" and self.compressor.pick_by_bytes and self.robust is None
        self.densify = collective == "auto" and densifies(self.compressor) and self.robust is None
        self.check_finite, self.guard = check_finite, guard
        self._gloo = backend_of(getattr(transport, "group", None)) == "gloo"
        self.memory.setup(transport.world_size)
        self._memory_updates = type(self.memory).update is not Memory.update
        # top-k family: "gtopk" | "shared" | "hierarchical" replace the all-gather (exchange/sparse.py)
        self.sparse = (None if sparse_collective == "allgather"
                       else _sparse.SparseCollective(sparse_collective, transport, self.compressor))
        self.steps: dict[Any, int] = {}

    # -- the exchange ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The ranks the mean is over: the transport's, which changes when the group does (a lost worker, a
        newcomer)."""
        return self.transport.world_size

    @property
    def identity(self) -> bool:
        """Nothing compressed, nothing remembered: a plain all-reduce of the tensor."""
        return (self.compressor.name == "none" and type(self.memory).compensate is Memory.compensate
                and self.collective == "allreduce" and self.sparse is None)

    def start(self, tensor: torch.Tensor, key: Any = None, shapes=None, inplace: bool = False):
        """The mean over ranks of `tensor` (a future; see the module docstring)."""
        return self.transport.run(self.program(tensor, key, shapes, inplace), background=self.background,
                                  serial=self.serial)

    def program(self, tensor: torch.Tensor, key: Any = None, shapes=None, inplace: bool = False):
        """(program) What `start` submits; `yield from` it inside another program."""
        x = tensor.detach()
        if x.numel() == 0:
            return Ready(x.clone())
        step = self._begin(x, key)
        tr, comp, n = self.transport, self.compressor, self.world_size
        if self.faulty is not None:     # where this rank's contribution enters: after its own check (faulty.py)
            x = self.faulty.corrupt(x, key, step, tr.rank)
        if self.identity:   # as DDP: the bucket itself, divided by n, is summed (no copy when allowed)
            # dividing first, as DDP's own hook does, puts the division before the transfer, overlapped with
            # the rest of backward, and not after the last bucket's transfer (1.5 ms of a 57 ms step here)
            if inplace and x.is_contiguous():
                buf = x.div_(n) if n > 1 else x
            else:
                buf = x.div(n) if n > 1 else x.clone()
            return (yield from tr.all_reduce_program(buf, op="sum"))
        with tr.tracer.span("compress", "compress"):
            c = self.memory.compensate(x, key)
        if self.collective == "custom" or self.sparse is not None:
            # the compressor's own rounds, or a sparse collective: (sum over ranks, this rank's own contribution)
            rounds = self.sparse.program(c, key, step) if self.sparse else run_rounds(tr, comp, c, key, step, shapes)
            total, local = yield from rounds
            if self._memory_updates:        # state changes in the program, in the same order on every rank
                self.memory.update(c, key, local)
            return Ready((total / n).to(x.dtype).reshape(x.shape))
        collective = self.collective_for(x.numel())
        agreed = None
        if collective == "allreduce":
            agreed = comp.agree(c, key, step)
            if agreed is not None:      # the ranks agree on a scale first (a max all-reduce), then quantize
                yield (yield from tr.all_reduce_program(agreed, op="max"))
        payload, sent = self._compress(c, key, step, agreed)
        if collective == "allreduce":
            return (yield from self._allreduce(payload, x, c))
        return (yield from self._gather(payload, x, c, sent, key))

    def collective_for(self, numel: int) -> str:
        """The collective an exchange of `numel` elements runs: the one named at construction, or with "auto" for a
        quantizer that may go either way the one sending fewer bytes at this world size (`choose.pick`), the same on
        every rank. (A gathered payload may still go dense once the ranks know its real sizes: `_gather`.)"""
        if not self.auto:
            return self.collective
        return pick(self.compressor, numel, self.world_size, getattr(self.transport, "allreduce", "gloo"))

    def aggregate(self, tensor: torch.Tensor, key: Any = None, shapes=None) -> torch.Tensor:
        return self.start(tensor, key, shapes).wait()

    def encode(self, tensor: torch.Tensor, key: Any, step: int) -> Payload:
        """This rank's contribution alone, with no agreement among ranks (a push to a parameter server):
        compensate -> compress -> update the memory; the payload."""
        with self.transport.tracer.span("compress", "compress"):
            c = self.memory.compensate(tensor, key)
        return self._compress(c, key, step)[0]

    def _compress(self, c: torch.Tensor, key: Any, step: int, agreed=None) -> tuple[Payload, torch.Tensor | None]:
        """(payload, this rank's decompressed contribution where the memory needed it, else None)."""
        sent = None
        with self.transport.tracer.span("compress", "compress"):
            payload = self.compressor.compress(c, key, step, agreed=agreed)
            if self._memory_updates:
                sent = self.compressor.decompress(payload)
                self.memory.update(c, key, sent)
        return payload, sent

    # -- the collectives -------------------------------------------------------------------------------
    def _allreduce(self, payload: Payload, x: torch.Tensor, c: torch.Tensor):
        comp, n, tr = self.compressor, self.world_size, self.transport
        p = comp.sum_payload(payload, n)
        ts = []
        for t in p.tensors:  # all-reduce works in place: never on the caller's tensor or the memory's
            if t.dtype in _GLOO_WIDEN and self._gloo:
                t = t.to(_GLOO_WIDEN[t.dtype])   # gloo cannot sum these: the wider type is what really travels
            elif not t.is_contiguous() or _shares_storage(t, x) or _shares_storage(t, c):
                t = t.contiguous().clone()
            ts.append(t)
        if len(ts) > 1 and len({t.dtype for t in ts}) == 1:   # one all-reduce for tensors of one dtype
            flat = torch.cat([t.reshape(-1) for t in ts])
            fut = yield from tr.all_reduce_program(flat, op="sum")
            summed = fut.then(lambda f: [v.view(t.shape) for v, t in zip(f.split([t.numel() for t in ts]), ts)])
        else:
            futs = []
            for t in ts:
                futs.append((yield from tr.all_reduce_program(t, op="sum")))
            summed = futs[0].then(lambda _: [f.result() for f in futs]) if futs else Ready([])

        def finish(results):
            with tr.tracer.span("decompress", "compress"):
                total = comp.decompress(Payload(results, p.ctx))
                return (total / n).to(x.dtype).reshape(x.shape)
        return summed.then(finish)

    def _gather(self, payload: Payload, x: torch.Tensor, c: torch.Tensor, sent: torch.Tensor | None, key=None):
        comp, n, tr = self.compressor, self.world_size, self.transport
        buf = wire.pack(payload.tensors)
        sizes = [buf.numel()] * n if comp.fixed_size else None
        if self.densify and n > 1:
            if sizes is None:           # the size round the gather would run anyway, ahead of it
                mine = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
                got = yield from tr.all_gather_program(mine, sizes=[1] * n)
                yield got
                sizes = torch.cat(got.result()).tolist()   # host: once per gather, as the gather itself reads them
            if dense_is_cheaper(max(sizes), x.numel() * x.element_size(), n, getattr(tr, "allreduce", "gloo"),
                                getattr(tr, "collective_link", None)):   # every rank decides alike from the sizes
                if sent is None:        # (decoded already where the memory needed it: summed in place)
                    with tr.tracer.span("decompress", "compress"):
                        sent = comp.decompress(payload)
                decoded = sent.to(x.dtype).reshape(-1)
                if _shares_storage(decoded, x) or _shares_storage(decoded, c):
                    decoded = decoded.clone()
                fut = yield from tr.all_reduce_program(decoded, op="sum")
                return fut.then(lambda total: (total / n).reshape(x.shape))
        fut = yield from tr.all_gather_program(buf, sizes=sizes)
        majority, robust = self.collective == "majority", self.robust

        def finish(blocks):
            with tr.tracer.span("decompress", "compress"):
                payloads = [Payload(ts, payload.ctx) for ts in wire.unpack_all(blocks)]
                out = (comp.vote(payloads) if majority else comp.aggregate(payloads) / n if robust is None
                       else robust.reduce([comp.decompress(p) for p in payloads], key))
                return out.to(x.dtype).reshape(x.shape)
        return fut.then(finish)

    def _begin(self, x: torch.Tensor, key: Any) -> int:
        """Count one more exchange of `key` (its compression step, returned) after checking `x` is finite."""
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        if self.check_finite:
            self._check_finite(x, key)
        return step

    def _check_finite(self, x: torch.Tensor, key: Any) -> None:
        if not x.is_floating_point():
            return
        s = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        # one host read: this tensor's sum and, with a guard, the verdict on the gradients checked since the last
        finite = (bool(torch.isfinite(s)) if self.guard is None
                  else self.guard.read_with(torch.isfinite(s).reshape(1))[0] > 0)
        if not finite and not bool(torch.isfinite(x).all()):
            raise NonFiniteError(f"rank {self.transport.rank}: non-finite value (NaN/Inf) in the tensor "
                                     f"exchanged under key {key!r}; nothing was sent (lower the learning rate, "
                                     f"clip gradients, or use loss scaling)")

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"steps": dict(self.steps), "compressor": self.compressor.state_dict(),
                "memory": self.memory.state_dict(), **({"robust": self.robust.state_dict()} if self.robust else {})}

    def rekey(self, old: list, new: list) -> None:
        """The scheduler re-planned its buckets ((key, numel) lists, same elements in the same order): the
        compressor's and memory's per-bucket state moves to the new keys, and the step counters go on."""
        self.compressor.rekey(old, new)
        self.memory.rekey(old, new)
        if self.robust is not None:
            self.robust.rekey()
        step = max((self.steps.get(k, 0) for k, _ in old), default=0)
        self.steps.update({k: step for k, _ in new})

    def load_state_dict(self, state: dict) -> None:
        self.steps = dict(state.get("steps", {}))
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        if self.robust is not None:
            self.robust.load_state_dict(state.get("robust", {}))
