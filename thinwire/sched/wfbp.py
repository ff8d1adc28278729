"""Wait-free backprop (WFBP: Zhang et al. 2017, "Poseidon: An Efficient Communication Architecture for
Distributed Deep Learning on GPU Clusters", arXiv 1706.03292; Awan et al. 2017, S-Caffe, PPoPP 2017) with tensor
fusion: `Scheduler`.

A post-accumulate-grad hook on every parameter marks its gradient ready during backward; once every gradient of a
bucket is ready the bucket goes to the algorithm (`algorithm.on_bucket(bucket)`: start its exchange, accumulate
it, take a local step...) while backward goes on. Buckets are handed over strictly in bucket order, so every rank
starts the same exchanges in the same order whatever order its gradients arrive in. `flush()` (the algorithm's
`step()` calls it first) hands over what backward did not (a parameter without a gradient counts as zeros);
`end_step()` closes the step (MG-WFBP re-plans there). With `overlap=False` no hook is registered and every
bucket is handed over in `flush()`. Where the algorithm `lands_in_backward` (bsp: the mean gradient in p.grad),
autograd's final callback calls `algorithm.land()` at the end of each backward that handed a bucket over, as
DDP's reducer finishes its all-reduces there: between backward and `trainer.step()` the loop may read or change
the gradients (clip them, unscale them), which an all-reduce still in flight in place would otherwise race with.

A step that sends nothing (DiLoCo's and local SGD's inner steps, DTS's sparse steps: `Algorithm.communicates()`
false) runs no per-parameter Python in its backward: the driver says after each step whether the next
communicates (`next_step`); the hooks are removed before a local step and put back by a forward pre-hook before
the next step that communicates. A local step's `step()` calls `local_step()` (missing gradients become zeros),
not `flush()`. How the exchanges run on the engine (serial, pipelined) is `modes()`'s to say.

An algorithm's public view: `buckets` (and `layout()`), `flush()`, `local_step()`, `end_step()`, `began`,
`discard_step()`, `close()`, `describe()`, `defers_update` and, where set, `finish_step()` (priority). The driver
(the Trainer) calls `next_step()` and `discard_step()`, and sets `before_landing`.
"""
from __future__ import annotations

import time

import torch

from ..errors import UserError
from ..trace import NULL
from .buckets import Buckets, assign

_now = time.perf_counter
MB = 1 << 20


class Scheduler:
    """Buckets + hooks + in-order hand-over. Subclasses change the bucket plan (MG-WFBP) or the update (priority)."""

    name = "fusion"
    defers_update = False     # True: step() returns before the update; the next forward applies it

    def __init__(self, bucket_mb: float = 25.0, first_bucket_mb: float | None = None, overlap: bool = True,
                 pipeline: bool | None = None, serial: bool | None = None):
        if bucket_mb < 0 or (first_bucket_mb is not None and first_bucket_mb < 0):
            raise UserError(f"bucket_mb must be >= 0 (0: one bucket per parameter), got {bucket_mb}")
        self.bucket_bytes = bucket_mb * MB
        self.first_bucket_mb = first_bucket_mb   # None: DDP's 1 MB on links with α <= 1 ms, else no special one
        self.overlap = overlap
        self.pipelined = pipeline                # None: on when the exchange compresses (`modes`)
        self.serial = serial                     # None: on emulated links (`modes`)
        self._hooks: list = []        # the gradient hooks, while they are on (`_arm`)
        self._forward = None          # the model's forward pre-hook that puts them back
        self._handing = True          # the current step hands its buckets to the algorithm (`next_step`)
        self._landing = False         # this backward's landing is queued (`_backward_end`)
        self._landing_error: BaseException | None = None    # raised at the end of backward (`_backward_end`)
        self.before_landing = None    # the driver's, called before the landing waits (the Trainer reports progress)
        # when the step's first training forward (grad enabled) began; None before it, or without the hook (no overlap)
        self.forward_at: float | None = None
        self.steps = 0

    # -- wiring ----------------------------------------------------------------------------------------
    def modes(self, transport, compressor, overlaps_steps: bool) -> dict:
        """How the exchanges of this schedule run on the engine, as keyword options of an `Exchange`
        (`Transport.run`): `background` compresses bucket b on the engine's thread while bucket b-1 is on the
        wire (default: when the exchange compresses); `serial` keeps one collective in flight at a time, in
        bucket order, as a NCCL stream or Horovod's background thread does: the α-β model of WFBP/MG-WFBP (Shi,
        Chu, Li 2019, arXiv 1811.11141), each bucket paying its own start-up α (default: on emulated links, where
        the link clock would otherwise let concurrent collectives overlap their start-ups; not for exchanges that
        outlive their step, DTS's windows, which run side by side as on gloo)."""
        background = self.pipelined
        if background is None:
            background = self.overlap and compressor.name != "none"
        serial = self.serial
        if serial is None:
            serial = self.overlap and transport.link.emulated and not overlaps_steps
        return {"background": bool(background), "serial": bool(serial)}

    def attach(self, model: torch.nn.Module, params, algorithm, transport, tracer=None,
               optimizer=None) -> "Scheduler":
        """Register the hooks; `algorithm.on_bucket(bucket)` receives each full bucket. `optimizer` is used
        only by schedules that apply the update themselves (priority)."""
        self.model = model
        self.params = list(params)
        self.algorithm = algorithm
        self.transport = transport
        self.tracer = tracer or NULL
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._stamps: list[float] | None = None
        self._build(self.initial_groups())
        if self.overlap:
            self._arm()
            self._forward = model.register_forward_pre_hook(self._before_forward)
        return self

    def _arm(self) -> None:
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _wants_hooks(self) -> bool:
        """Whether the current step's backward runs the gradient hooks: it hands buckets over, or it is profiled
        (MG-WFBP and priority measure ready times during their first steps, local or not)."""
        return self.overlap and (self._handing or self._stamps is not None)

    def _before_forward(self, module, args) -> None:
        if self.forward_at is None and torch.is_grad_enabled():   # (an evaluation between steps runs no_grad)
            self.forward_at = _now()
        if not self._hooks and self._wants_hooks():
            self._arm()

    def next_step(self, communicates: bool) -> None:
        """(the driver, once a step is over) Whether the next step communicates (`Algorithm.communicates()`):
        if not, its backward runs no gradient hook (removed now; the model's forward puts them back before a step
        that communicates)."""
        self._handing = bool(communicates)
        if self._hooks and not self._wants_hooks():
            self._disarm()

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
        self.keys = [b.key for b in self.buckets]
        if old is not None and old != self.layout():
            self.algorithm.rekey(old, self.layout())   # a re-plan (MG-WFBP) keeps error-feedback residuals
        self._reset()

    def layout(self) -> list[tuple[str, int]]:
        """(key, numel) of every bucket, in bucket order."""
        return [(b.key, b.buffer.numel()) for b in self.buckets]

    @property
    def began(self) -> bool:
        """Whether the current step has begun: backward handed in a gradient (or `flush` ran) since the last
        `end_step` or `discard_step`."""
        return self._began

    def discard_step(self) -> None:
        """Forget the step in progress, handing nothing over (a step skipped for a non-finite gradient, a rank
        catching up with the survivors' step count, a recovery): the next gradient begins a new step."""
        self._landing_error = None
        self._reset()

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._count = [0] * len(self.sizes)
        self._next = 0
        self._began = self._landing = False
        self.forward_at = None

    # -- backward --------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        if self._stamps is not None:
            self._stamps[i] = _now()
        if not self._handing:        # a local step, profiled: its ready times only
            return
        if self._ready[i]:
            raise UserError("a gradient was produced twice before trainer.step(): call trainer.step() after "
                            "each backward (or use schedule='none' to accumulate gradients)")
        if not self._landing and self.algorithm.lands_in_backward and not self.defers_update:
            self._landing = True        # (once per backward pass)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self._begin()
        self.take(i)

    def _backward_end(self) -> None:
        """(autograd's, once a backward that handed gradients over is done) The exchanges of the buckets it handed
        over land in their gradients, as DDP's reducer finishes there: the loop may read or change them (clip,
        unscale) before `trainer.step()`. A bucket still incomplete (a parameter without a gradient yet) goes
        with `flush()`, after the loop's change. An error (a lost peer) is raised by the step's `flush()`, where
        the Trainer handles it."""
        self._landing = False
        try:
            if self.before_landing is not None:
                self.before_landing()
            self.algorithm.land()
        except BaseException as e:  # noqa: BLE001 - raised by flush()
            self._landing_error = e

    def take(self, i: int) -> None:
        """Gradient i is final: into its bucket, and hand over the buckets now complete (in bucket order)."""
        self.buckets.adopt(i)
        self._ready[i] = True
        b = self.buckets.slot[i][0]
        self._count[b] += 1
        if b == self._next:
            self._launch_ready()

    def _begin(self) -> None:
        """The step's first gradient (or its flush) is here: `before_first_grad` runs once per step."""
        if not self._began:
            self._began = True
            self.before_first_grad()

    def before_first_grad(self) -> None:
        """Called once per step, before the first gradient is handed on (priority finishes its updates)."""

    def _launch_ready(self) -> None:
        while self._next < len(self.sizes) and self._count[self._next] == self.sizes[self._next]:
            bucket = self.buckets.buckets[self._next]
            self._next += 1
            with self.tracer.span(f"bucket {bucket.index}", "compress", bytes=bucket.nbytes):
                self.algorithm.on_bucket(bucket)

    # -- the step --------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand over every bucket backward has not: missing gradients count as zeros (or as p.grad if set)."""
        if self._landing_error is not None:
            error, self._landing_error = self._landing_error, None
            raise error
        self._begin()
        for i in range(len(self.params)):   # (take hands the buckets over in bucket order)
            if not self._ready[i]:
                self.take(i)

    def local_step(self) -> None:
        """(a step that sends nothing, instead of `flush`) Parameters without a gradient get zeros, as `flush()`
        gives them, so that the optimizer's update is the same; no bucket is handed over."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                self.buckets.adopt(i)

    def end_step(self) -> None:
        """The step is over (the algorithm applied what it needed)."""
        self.steps += 1
        self._reset()

    def close(self) -> None:
        self._disarm()
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def describe(self) -> dict:
        return {"schedule": self.name, "buckets": len(self.sizes),
                "bucket_bytes": [b.nbytes for b in self.buckets]}
