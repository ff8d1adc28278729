"""`Exchange`: the averaged value of one tensor across ranks, through a compressor and its memory.

The flow of one `start(tensor, key)` (GRACE's compensate → compress → update → communicate → decompress):

1. `memory.compensate(tensor, key)` adds the error-feedback state;
2. `compressor.compress(...)` makes the payload (after the ranks `agree` on a shared scale, if it needs one);
3. `memory.update(compensated, key, sent)` with `sent` = this rank's own decompressed contribution;
4. the collective the compressor's algebra allows:
   - "allreduce": payload tensors summed element-wise (widened or pre-scaled by `sum_payload` so the sum
     cannot overflow; tensors of one dtype are fused into one all-reduce);
   - "allgather": each rank's payload packed into ONE uint8 buffer with a small header (`wire.pack`), one
     variable-size all-gather, then `compressor.aggregate` (e.g. `index_add_` of the sparse parts);
   - "majority": as all-gather, then the element-wise sign of the sum of the ranks' signs (a vote, not a mean);
   - "custom": the compressor communicates itself (PowerSGD: all-reduce P, orthogonalise, all-reduce Q);
5. `handle.wait()` decompresses/aggregates and returns the mean over ranks (same shape and dtype).

Steps 1–3 run in `start`; the collective is issued asynchronously and the decompression happens in `wait()`,
so compute between the two overlaps the (emulated) transfer. ("custom" updates the memory in `wait()`, since
PowerSGD's own contribution needs the all-reduced P.)

Granularity is the caller's: a parameter's gradient, a bucket or the whole flattened model, each under its own
`key`; per-key state (residuals, PowerSGD's Q, shared seeds) follows the key. `shapes` (the parameter shapes a
flat tensor is made of) lets structure-aware compressors (PowerSGD) treat each parameter as a matrix.

NaN/Inf policy: with `check_finite=True` (the default) a non-finite value in the tensor raises
`NonFiniteError` (a `FloatingPointError`) naming the key and rank BEFORE anything is compressed, remembered or
sent, so no rank's model or memory is poisoned; the launcher then stops every worker. With `check_finite=False` non-finite values
travel as they are (linear and gathered payloads spread them to every rank: a visible failure, never a silent
one for the dense paths; sparsifiers may drop NaNs into their memory).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm import Transport
from ..compress import Compressor, Memory, Payload, compressors, memories
from ..compress.finite import NonFiniteError
from ..errors import UserError
from . import sparse as _sparse
from . import wire

COLLECTIVES = ("auto", "allreduce", "allgather", "majority", "custom")
_GLOO_WIDEN = {torch.int16: torch.int32, torch.bool: torch.uint8}   # gloo all-reduce has no int16 / bool sum


def allowed_collectives(compressor: Compressor) -> list[str]:
    """The collectives a compressor's algebra allows (the first is its natural one)."""
    agg = compressor.aggregation
    if agg == "custom":
        return ["custom"]
    out = [agg]
    if agg != "allgather":
        out.append("allgather")  # any non-custom payload can be gathered and aggregated one by one
    return out


class _Done:
    """A finished exchange (a result computed without waiting on the wire)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value

    def is_completed(self):
        return True


class ExchangeHandle:
    """An exchange in flight: `wait()` finishes the transport ops, then decompresses (once)."""

    def __init__(self, handles: list, finish: Callable[[list], torch.Tensor], tracer=None):
        self._handles, self._finish, self._tracer = handles, finish, tracer
        self._value, self._done = None, False

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h in self._handles)

    def wait(self) -> torch.Tensor:
        if not self._done:
            results = [h.wait() for h in self._handles]
            if self._tracer is not None:
                with self._tracer.span("decompress", "compress"):
                    self._value = self._finish(results)
            else:
                self._value = self._finish(results)
            self._done = True
            self._handles, self._finish = [], None
        return self._value


def _backend(transport) -> str:
    try:
        import torch.distributed as dist
        return str(dist.get_backend(transport.group))
    except (RuntimeError, ValueError, AttributeError):
        return "gloo"


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:
        return False


class Exchange:
    """Average tensors across the ranks of `transport`, compressed.

    `start(tensor, key, shapes=None)` launches the exchange and returns a handle whose `wait()` gives the mean
    over ranks of the (decompressed) contributions, same shape and dtype as `tensor` (for "majority": the
    vote, sign of the sum of signs). `aggregate(...)` is the synchronous form. `collective="auto"` takes the
    compressor's natural collective; naming one its algebra does not allow is a `UserError` here, not a wrong
    answer later.
    """

    def __init__(self, transport: Transport, compressor: "str | Compressor" = "none",
                 memory: "str | Memory" = "none", collective: str = "auto", check_finite: bool = True,
                 sparse_collective: str | None = None, **params):
        if params:
            raise UserError(f"unexpected exchange parameters: {sorted(params)}; valid: collective, check_finite, "
                            f"sparse_collective")
        self.transport = transport
        self.compressor = compressors.get(compressor) if isinstance(compressor, str) else compressor
        self.memory = memories.get(memory) if isinstance(memory, str) else memory
        if collective not in COLLECTIVES:
            raise UserError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
        allowed = allowed_collectives(self.compressor)
        if collective == "auto":
            collective = allowed[0]
        if collective not in allowed:
            raise UserError(f"compressor {self.compressor.name!r} (aggregation {self.compressor.aggregation!r}, "
                            f"linear={self.compressor.linear}) cannot use collective {collective!r}; "
                            f"valid: {', '.join(allowed)}")
        if collective == "allreduce" and not self.compressor.linear:
            raise UserError(f"compressor {self.compressor.name!r} is not linear: its payloads cannot be summed by "
                            f"all-reduce; valid: allgather")
        if collective == "custom" and not hasattr(self.compressor, "exchange"):
            raise UserError(f"compressor {self.compressor.name!r} declares custom aggregation without an exchange")
        self.collective = collective
        self.check_finite = check_finite
        self.world_size = transport.world_size
        self._gloo = _backend(transport) == "gloo"
        self.memory.setup(self.world_size)
        self._memory_updates = type(self.memory).update is not Memory.update
        # top-k family: "gtopk" | "shared" | "hierarchical" replace the all-gather (exchange/sparse.py)
        sparse_collective = sparse_collective or getattr(self.compressor, "sparse_collective", "allgather")
        self.sparse = None
        if _sparse.check(sparse_collective) != "allgather":
            self.sparse = _sparse.SparseCollective(sparse_collective, transport, self.compressor)
            if collective != "allgather":
                raise UserError(f"sparse collective {sparse_collective!r} replaces the all-gather; it cannot run "
                                f"with collective {collective!r}; valid: auto, allgather")
        self.steps: dict[Any, int] = {}

    @property
    def step(self) -> int:
        return sum(self.steps.values())

    # -- the exchange ----------------------------------------------------------------------------------
    def start(self, tensor: torch.Tensor, key: Any = None, shapes=None):
        x = tensor.detach()
        if x.numel() == 0:
            return _Done(x.clone())
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        if self.check_finite:
            self._check_finite(x, key)
        tracer = self.transport.tracer
        comp, n = self.compressor, self.world_size
        if self.collective == "custom":
            with tracer.span("compress", "compress"):
                c = self.memory.compensate(x, key)
            inner = comp.exchange(self.transport, c, key, step, shapes)

            def finish_custom(results):
                total, local = results[0]
                if self._memory_updates:
                    self.memory.update(c, key, local)
                return (total / n).to(x.dtype).reshape(x.shape)
            return ExchangeHandle([inner], finish_custom, tracer)

        if self.sparse is not None:   # a sparse collective: synchronous, returns (sum, this rank's share)
            with tracer.span("compress", "compress"):
                c = self.memory.compensate(x, key)
            total, sent = self.sparse.run(c, key, step)
            if self._memory_updates:
                self.memory.update(c, key, sent)
            return _Done((total / n).to(x.dtype).reshape(x.shape))

        with tracer.span("compress", "compress"):
            c = self.memory.compensate(x, key)
            agreed = None
            if self.collective == "allreduce":
                agreed = comp.agree(c, key, step)
                if agreed is not None:
                    self.transport.all_reduce(agreed, op="max")
            payload = comp.compress(c, key, step, agreed=agreed)
            if self._memory_updates:
                self.memory.update(c, key, comp.decompress(payload))
        if self.collective == "allreduce":
            return self._allreduce(payload, x, c)
        return self._gather(payload, x)

    def aggregate(self, tensor: torch.Tensor, key: Any = None, shapes=None) -> torch.Tensor:
        return self.start(tensor, key, shapes).wait()

    # -- the collectives -------------------------------------------------------------------------------
    def _allreduce(self, payload: Payload, x: torch.Tensor, c: torch.Tensor) -> ExchangeHandle:
        comp, n, tr = self.compressor, self.world_size, self.transport
        p = comp.sum_payload(payload, n)
        ts = []
        for t in p.tensors:  # all-reduce works in place: never on the caller's tensor or the memory's
            if t.dtype in _GLOO_WIDEN and self._gloo:
                t = t.to(_GLOO_WIDEN[t.dtype])   # gloo cannot sum these: the wider type is what really travels
            elif not t.is_contiguous() or _shares_storage(t, x) or _shares_storage(t, c):
                t = t.contiguous().clone()
            ts.append(t)
        if len(ts) > 1 and len({t.dtype for t in ts}) == 1:
            flat = torch.cat([t.reshape(-1) for t in ts])
            handles = [tr.all_reduce(flat, op="sum", async_op=True)]

            def split(results):
                out, off = [], 0
                for t in ts:
                    out.append(results[0][off:off + t.numel()].view(t.shape))
                    off += t.numel()
                return out
        else:
            handles = [tr.all_reduce(t, op="sum", async_op=True) for t in ts]
            split = list

        def finish(results):
            total = comp.decompress(Payload(split(results), p.ctx, p.extra))
            return (total / n).to(x.dtype).reshape(x.shape)
        return ExchangeHandle(handles, finish, tr.tracer)

    def _gather(self, payload: Payload, x: torch.Tensor) -> ExchangeHandle:
        comp, n, tr = self.compressor, self.world_size, self.transport
        buf = wire.pack(payload.tensors)
        sizes = [buf.numel()] * n if comp.fixed_size else None
        handle = tr.all_gather(buf, sizes=sizes, async_op=True)
        majority = self.collective == "majority"

        def finish(results):
            payloads = [Payload(wire.unpack(b), payload.ctx, payload.extra) for b in results[0]]
            total = comp.aggregate(payloads)
            out = torch.sign(total) if majority else total / n
            return out.to(x.dtype).reshape(x.shape)
        return ExchangeHandle([handle], finish, tr.tracer)

    def _check_finite(self, x: torch.Tensor, key: Any) -> None:
        if not x.is_floating_point():
            return
        s = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        if not torch.isfinite(s) and not bool(torch.isfinite(x).all()):
            raise NonFiniteError(f"rank {self.transport.rank}: non-finite value (NaN/Inf) in the tensor "
                                     f"exchanged under key {key!r}; nothing was sent (lower the learning rate, "
                                     f"clip gradients, or use loss scaling)")

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"steps": dict(self.steps), "compressor": self.compressor.state_dict(),
                "memory": self.memory.state_dict()}

    def rekey(self, old: list, new: list) -> None:
        """The scheduler re-planned its buckets ((key, numel) lists, same elements in the same order): the
        compressor's and memory's per-bucket state moves to the new keys, and the step counters go on."""
        self.compressor.rekey(old, new)
        self.memory.rekey(old, new)
        step = max((self.steps.get(k, 0) for k, _ in old), default=0)
        self.steps.update({k: step for k, _ in new})

    def load_state_dict(self, state: dict) -> None:
        self.steps = dict(state.get("steps", {}))
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
