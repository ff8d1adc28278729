"""Priority scheduling (P3: Jayarajan et al. 2019, "Priority-based Parameter Propagation for
Distributed DNN Training", arXiv 1905.03960; ByteScheduler: Peng et al. 2019, "A Generic Communication Scheduler
for Distributed DNN Training Acceleration", SOSP 2019).

- The flat gradient, in forward order, is cut into chunks of `chunk_mb` (large tensors split, small ones fused),
  so a big late layer cannot block a small early one for long; chunks nearer the input go first.
- A credit window bounds the bytes in flight (`credit_mb`): a higher-priority chunk ready later can still go
  before queued lower ones.
- `step()` returns before the update; a forward pre-hook on each module waits only for the chunks holding its
  parameters and applies their update, so layer l's next forward starts as soon as layer l is synchronised.

An all-reduce must be issued in the same order on every rank, so the order is not decided per rank at run time:
after `profile_steps` steps (first-in first-out in backward order meanwhile), rank 0's measured ready times and
the link's cost are broadcast and every rank simulates the credit-window priority queue on them (TicTac-style
static order); a background thread launches the chunks in that order, each once it is ready and the window has
room. A second gradient buffer lets the next backward (and the user's zero_grad) proceed meanwhile.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time

import torch

from ..errors import UserError
from ..optim import own_step
from .buckets import adopt_view
from .mgwfbp import Profiled
from .wfbp import MB

_now = time.perf_counter


def priority_order(ready: list[float], sizes: list[float], cost, credit: float) -> list[int]:
    """Launch order of chunks (index = priority, 0 highest) by simulating the credit-window priority queue:
    at each moment the highest-priority ready chunk is launched if the bytes in flight leave room."""
    left = set(range(len(ready)))
    order: list[int] = []
    inflight: collections.deque = collections.deque()   # (end time, bytes)
    t, link_free = 0.0, 0.0
    while left:
        while inflight and inflight[0][0] <= t:
            inflight.popleft()
        busy = sum(b for _, b in inflight)
        cands = [j for j in left if ready[j] <= t]
        if cands:
            j = min(cands)
            if not inflight or busy + sizes[j] <= credit:
                start = max(t, link_free)
                link_free = start + cost(sizes[j])
                inflight.append((link_free, sizes[j]))
                order.append(j)
                left.discard(j)
                continue
        nxt = [ready[j] for j in left if ready[j] > t] + [e for e, _ in inflight]
        t = min(nxt)
    return order


class Priority(Profiled):
    name = "priority"
    defers_update = True

    def __init__(self, chunk_mb: float = 0.0, credit_mb: float = 0.0, profile_steps: int = 3):
        # its own launcher thread orders and bounds the transfers
        super().__init__(profile_steps=profile_steps, pipeline=False, serial=False)
        if chunk_mb < 0 or credit_mb < 0:
            raise UserError("chunk_mb and credit_mb must be >= 0 (0: chosen from the link)")
        self.chunk_mb, self.credit_mb = chunk_mb, credit_mb

    # -- layout: one flat gradient in forward order, two buffers, chunks --------------------------------
    def attach(self, model, params, algorithm, transport, tracer=None, optimizer=None):
        self.optimizer = optimizer
        self.exchange = algorithm.exchange       # priority decides the update too: bsp's exchange, per chunk
        super().attach(model, params, algorithm, transport, tracer)
        self._module_hooks = []
        for m in model.modules():
            own = [self.index[id(p)] for p in m.parameters(recurse=False) if id(p) in self.index]
            if own:
                self._module_hooks.append(m.register_forward_pre_hook(self._make_pre_hook(own)))
        return self

    def _build(self, groups) -> None:  # the flat layout is fixed; `groups` (per-layer) only feed profiling
        p0 = self.params[0]
        *self.offsets, self.numel = itertools.accumulate((p.numel() for p in self.params), initial=0)
        esize = p0.element_size()
        link, n = self.transport.link, self.transport.world_size
        chunk = self.chunk_mb * MB
        if not chunk:   # ~4 start-ups' worth of transfer on an emulated link (ring: n α / β per byte), else 4 MiB
            chunk = max(4 * MB, 4 * n * link.alpha / link.beta) if link.emulated and link.beta else 4 * MB
        self.chunk_elems = max(1, int(chunk // esize))
        self.credit = self.credit_mb * MB or 2 * self.chunk_elems * esize
        self.units = [(lo, min(lo + self.chunk_elems, self.numel)) for lo in range(0, self.numel, self.chunk_elems)]
        self.unit_bytes = [(hi - lo) * esize for lo, hi in self.units]
        self.param_units = [list(range(o // self.chunk_elems, (o + max(1, p.numel()) - 1) // self.chunk_elems + 1))
                            for o, p in zip(self.offsets, self.params)]
        per_unit = collections.Counter(u for us in self.param_units for u in us)
        self.unit_params = [per_unit[u] for u in range(len(self.units))]
        self.flat = [torch.zeros(self.numel, dtype=p0.dtype, device=p0.device) for _ in range(2)]
        self.result = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)   # the averages the update applies
        self.cur = 0
        self.order = list(reversed(range(len(self.units))))   # FIFO in backward order until planned
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: set[int] = set()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                adopt_view(p, self._view(self.flat[0], i))
        self.sizes = [0]
        self._reset()

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def _reset(self) -> None:
        super()._reset()
        self._left = list(self.unit_params)
        self._unit_ready = [threading.Event() for _ in self.units]
        self._unit_done = [threading.Event() for _ in self.units]

    # -- backward: mark chunks ready; the launcher thread sends them ------------------------------------
    def before_first_grad(self) -> None:
        self.flush()     # (the previous step's averages are all applied: `result` is free)
        if self.exchange.identity:   # in place: the averages land in the buffer that was sent
            self.result = self.flat[self.cur]
        self._thread = threading.Thread(target=self._launcher, args=(self.flat[self.cur], self.result,
                                        list(self.order), self._unit_ready, self._unit_done),
                                        name="thinwire-priority", daemon=True)
        self._thread.start()

    def take(self, i: int) -> None:
        adopt_view(self.params[i], self._view(self.flat[self.cur], i))
        self._ready[i] = True
        for u in self.param_units[i]:
            self._left[u] -= 1
            if self._left[u] == 0:
                self._unit_ready[u].set()

    def _launcher(self, flat, result, order, ready, done) -> None:
        inflight: collections.deque = collections.deque()   # (unit, handle)
        busy = 0
        try:
            for u in order:
                ready[u].wait()
                while inflight and busy + self.unit_bytes[u] > self.credit:
                    busy -= self._complete(*inflight.popleft(), result, done)
                lo, hi = self.units[u]
                with self.tracer.span(f"start chunk {u}", "compress", bytes=self.unit_bytes[u]):
                    h = self.exchange.start(flat[lo:hi], f"chunk:{lo}-{hi}", inplace=True)
                inflight.append((u, h))
                busy += self.unit_bytes[u]
            while inflight:
                self._complete(*inflight.popleft(), result, done)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self._error = e
            for ev in done:
                ev.set()

    def _complete(self, u: int, h, result, done) -> int:
        """Wait for chunk u's exchange, its average into `result`: the bytes it frees in the window."""
        while not h.is_completed():    # poll: waiting here is not exposed time, the training thread goes on
            time.sleep(2e-4)
        res = h.wait()
        lo, hi = self.units[u]
        if res.data_ptr() != result[lo:hi].data_ptr():
            result[lo:hi].copy_(res.reshape(-1))
        done[u].set()
        return self.unit_bytes[u]

    # -- the step: hand the buffer over, update lazily -------------------------------------------------
    def finish_step(self) -> None:
        super().flush()      # the gradients backward did not produce into their chunks (Scheduler's hand-over)
        self._pending = set(range(len(self.params)))
        self._done_events = self._unit_done
        self.cur ^= 1                            # the next backward accumulates into the other buffer
        self.flat[self.cur].zero_()
        self._point(self.flat[self.cur], range(len(self.params)))
        self.end_step()

    def _make_pre_hook(self, own: list[int]):
        """Before the module's forward: its parameters still pending wait for their chunks and are updated."""
        return lambda module, args: self._apply([i for i in own if i in self._pending])

    def _apply(self, idx: list[int]) -> None:
        if not idx:
            return
        t0 = _now()
        for i in idx:
            for u in self.param_units[i]:
                self._done_events[u].wait()
        dt = _now() - t0
        if dt > 1e-4:
            self.transport.meter.add_wait(dt)
            self.tracer.complete("wait chunks", t0, t0 + dt, "wait")
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        self._point(self.result, idx)   # the averaged gradients, for the update only
        try:
            with self.tracer.span("optimizer", "optimizer"):
                own_step(self.optimizer, [self.params[i] for i in idx])
        finally:
            self._point(self.flat[self.cur], idx)
        self._pending.difference_update(idx)

    def _point(self, flat: torch.Tensor, idx) -> None:
        """The gradients of parameters `idx` become their views of `flat`."""
        for i in idx:
            self.params[i].grad = self._view(flat, i)

    def flush(self) -> None:
        """Finish the previous step: every chunk received, every parameter updated."""
        self._apply(sorted(self._pending))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def plan(self) -> None:
        ready = [max(self.ready_times[i] for i in range(len(self.params)) if u in self.param_units[i])
                 for u in range(len(self.units))]
        self.order = priority_order(ready, [float(b) for b in self.unit_bytes], self.cost, self.credit)

    def _finish_profile(self) -> None:
        self.flush()     # planning runs collectives of its own: nothing else may be on the wire
        super()._finish_profile()

    def close(self) -> None:
        if self._began:
            self.finish_step()
        self.flush()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        super().close()

    def describe(self) -> dict:
        return {"schedule": self.name, "chunks": len(self.units), "chunk_bytes": self.unit_bytes[:1],
                "credit_bytes": self.credit, "order": self.order, "alpha_beta": self.cost_ab}
