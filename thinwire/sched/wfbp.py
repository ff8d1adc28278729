"""Wait-free backprop (WFBP, catalog §2.5.2; Poseidon, S-Caffe) with tensor fusion: `Scheduler`.

A post-accumulate-grad hook on every parameter marks its gradient ready during backward; as soon as every
gradient of a bucket is ready the bucket's exchange starts, asynchronously (`Exchange.start(bucket, key)`),
while backward goes on with the earlier layers. Buckets are launched strictly in bucket order (0, 1, ...) so
every rank issues the same collectives in the same order even if its gradients become ready in another order.
`wait_all()` launches what backward did not (parameters without a gradient this step count as zeros) and
writes the averaged gradients in place into `p.grad`.

With `overlap=False` no hook is registered and everything is exchanged in `wait_all()` (no overlap).
"""
from __future__ import annotations

import time

import torch

from ..errors import UserError
from ..trace import NULL
from .buckets import Buckets, assign
from .pipeline import Pipeline, wait_quietly

_now = time.perf_counter
MB = 1 << 20


class Scheduler:
    """Buckets + hooks + in-order launch. Subclasses change the bucket plan (MG-WFBP) or the update (priority)."""

    name = "fusion"
    defers_update = False     # True: step() returns before the update; the next forward applies it

    def __init__(self, bucket_mb: float = 25.0, first_bucket_mb: float | None = None, overlap: bool = True,
                 pipeline: bool | None = None, serial: bool | None = None):
        if bucket_mb < 0 or (first_bucket_mb is not None and first_bucket_mb < 0):
            raise UserError(f"bucket_mb must be >= 0 (0: one bucket per parameter), got {bucket_mb}")
        self.bucket_bytes = bucket_mb * MB
        self.first_bucket_mb = first_bucket_mb   # None: DDP's 1 MB on links with α <= 1 ms, else no special one
        self.overlap = overlap
        self.pipelined = pipeline                # None: on when the exchange compresses
        # one collective in flight at a time, in bucket order (a NCCL stream, Horovod's background thread): the
        # α-β model of WFBP/MG-WFBP (catalog §2.5.2). None: on emulated links, where the link clock would
        # otherwise let concurrent collectives overlap their start-up latencies; loopback gloo keeps its own.
        self.serial = serial
        self._hooks: list = []
        self.pipe: Pipeline | None = None
        self.steps = 0

    # -- wiring ----------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, params, exchange, tracer=None, transport=None,
               optimizer=None) -> "Scheduler":
        """Register the hooks. `optimizer` is used only by schedules that defer the update (priority)."""
        self.model = model
        self.params = list(params)
        self.exchange = exchange
        self.transport = transport or exchange.transport
        self.tracer = tracer or NULL
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._stamps: list[float] | None = None
        self._build(self.initial_groups())
        if self.overlap:
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        # the identity exchange of a bucket is an in-place all-reduce (mean), as DDP's: no copy, no allocation
        comp, mem = getattr(exchange, "compressor", None), getattr(exchange, "memory", None)
        self._inplace = (getattr(comp, "name", "") == "none" and getattr(mem, "name", "") == "none"
                         and getattr(exchange, "collective", "allreduce") in ("allreduce", "auto"))
        if self.pipelined is None:
            self.pipelined = self.overlap and getattr(exchange.compressor, "name", "none") != "none"
        if self.serial is None:
            self.serial = self.overlap and self.transport.link.emulated
        if self.pipelined or self.serial:
            self.pipe = Pipeline()
        return self

    def initial_groups(self) -> list[list[int]]:
        if not self.overlap:
            return [list(reversed(range(len(self.params))))]
        first = self.first_bucket_mb
        if first is None:
            first = 1.0 if self.transport.link.alpha <= 1e-3 else None
        return assign(self.params, self.bucket_bytes, None if first is None else first * MB)

    def _build(self, groups: list[list[int]]) -> None:
        old = self.layout() if hasattr(self, "buckets") else None
        self.buckets = Buckets(self.params, groups)
        self.sizes = [len(b.members) for b in self.buckets]
        self.keys = [f"bucket:{b.members[0]}-{b.members[-1]}" for b in self.buckets]
        if old is not None and old != self.layout() and hasattr(self.exchange, "rekey"):
            self.exchange.rekey(old, self.layout())   # a re-plan (MG-WFBP) keeps error-feedback residuals
        self._reset()

    def layout(self) -> list[tuple[str, int]]:
        """(key, numel) of every bucket, in bucket order."""
        return [(k, b.buffer.numel()) for k, b in zip(self.keys, self.buckets)]

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._count = [0] * len(self.sizes)
        self._next = 0
        self._handles: dict[int, object] = {}
        self._last = None
        self._began = False

    # -- backward --------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        if self._stamps is not None:
            self._stamps[i] = _now()
        if self._ready[i]:
            raise UserError("a gradient was produced twice before trainer.step(): call trainer.step() after "
                            "each backward (or use schedule='none' to accumulate gradients)")
        if not self._began:
            self._began = True
            self.before_first_grad()
        self.take(i)

    def take(self, i: int) -> None:
        """Gradient i is final: into its bucket, and launch the buckets now complete (in bucket order)."""
        self.buckets.adopt(i)
        self._ready[i] = True
        b = self.buckets.slot[i][0]
        self._count[b] += 1
        if self._count[b] == self.sizes[b] and b == self._next:
            self._launch_ready()

    def before_first_grad(self) -> None:
        """Called once per step, before the first gradient is handed on (priority finishes its updates)."""

    def _launch_ready(self) -> None:
        while self._next < len(self.sizes) and self._count[self._next] == self.sizes[self._next]:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        buf, key = self.buckets.buckets[b].buffer, self.keys[b]
        if self.pipe is not None:
            self.pipe.submit(b, lambda: self._start(b, buf, key))
        else:
            self._handles[b] = self._start(b, buf, key)

    def _start(self, b: int, buf: torch.Tensor, key: str):
        if self.serial and self._last is not None:
            wait_quietly(self._last)     # the previous bucket's collective is delivered first
        self._last = self._issue(b, buf, key)
        return self._last

    def _issue(self, b: int, buf: torch.Tensor, key: str):
        with self.tracer.span(f"start bucket {b}", "compress", bytes=buf.numel() * buf.element_size()):
            shapes = [tuple(self.params[i].shape) for i in self.buckets.buckets[b].members]
            return self.start_exchange(buf, key, shapes=shapes)   # PowerSGD compresses each matrix

    def start_exchange(self, buf: torch.Tensor, key: str, shapes=None):
        """`Exchange.start(buf, key)`; for the identity compressor, the same all-reduce issued in place."""
        if self._inplace:
            if getattr(self.exchange, "check_finite", False) and hasattr(self.exchange, "_check_finite"):
                self.exchange._check_finite(buf, key)    # the exchange's NaN/Inf policy, kept
            return self.transport.all_reduce(buf, op="mean", async_op=True)
        if shapes is None:
            return self.exchange.start(buf, key)
        return self.exchange.start(buf, key, shapes=shapes)

    # -- the step --------------------------------------------------------------------------------------
    def start_all(self) -> None:
        """Launch every bucket backward has not: missing gradients count as zeros (or as p.grad if set)."""
        for b in range(self._next, len(self.sizes)):
            for i in self.buckets.buckets[b].members:
                if not self._ready[i]:
                    self.buckets.adopt(i)
                    self._ready[i] = True
            self._count[b] = self.sizes[b]
        self._launch_ready()

    def wait_all(self) -> None:
        """Averaged gradients, in place in every `p.grad`."""
        self.start_all()
        if self.pipe is not None:
            t0 = _now()
            self._handles.update(self.pipe.drain())   # blocked on earlier buckets' transfers: exposed time
            t1 = _now()
            if t1 - t0 > 1e-4:
                self.transport.meter.add_wait(t1 - t0)
                self.tracer.complete("wait (queued buckets)", t0, t1, "wait")
        for b, bucket in enumerate(self.buckets.buckets):
            res = self._handles[b].wait()
            if res.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(res.reshape(-1))
        self._end_step()

    def _end_step(self) -> None:
        self.steps += 1
        self._reset()
        self.after_step()

    def after_step(self) -> None:
        """Called after each step's exchange completed (MG-WFBP re-plans its buckets here)."""

    def close(self) -> None:
        if self._began or self._handles:
            self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None

    def describe(self) -> dict:
        return {"schedule": self.name, "buckets": len(self.sizes),
                "bucket_bytes": [b.nbytes for b in self.buckets]}
