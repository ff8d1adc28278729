"""The Handle: one real operation on the wire, complete once the real op is done and the emulated link delivered it.

A `Transport` operation issues the real op (gloo or NCCL) and wraps its works in a Handle, whose result is ready
once the real op completed **and** the emulated link (`thinwire.comm.emulation`) would have delivered it: compute
done before `Handle.wait()` overlaps the emulated transfer. Its done-callbacks run on the thread that saw the real
op complete (gloo's), or on a timer's at the emulated delivery: no polling thread in between.

From its transport it takes `clock` (its link's queue, unless it crosses another), `meter`, `tracer`, `generation`
(the membership its waits watch) and `delivery` (the `DeliveryQueue` that puts a group's collectives on an
emulated link in issue order), which calls back `arrived()`, `schedule()` (take the delivery time from the link)
and `fire()` (run the callbacks waiting for that time).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from ..net import Cost
from . import progress
from .emulation import LinkClock
from .engine import Future
from .membership import MEMBERSHIP, PeerLost

MOVING_S = 1.0     # how often a transfer the emulated link is delivering tells the watchdog it moves

_now = time.perf_counter


class Handle(Future):
    """An operation in flight: its result once the real op is done and the link delivered it."""

    def __init__(self, transport: "Transport", kind: str, works: Sequence, cost: Cost, result,
                 post: Callable | None = None, issued: float | None = None, tx: bool = True, rx: bool = True,
                 reserved: float | None = None, not_before: Callable | None = None, clock: LinkClock | None = None,
                 across: float = 0.0, land: Callable | None = None, keep=None):
        self.transport, self.kind, self.cost = transport, kind, cost
        self.clock = transport.clock if clock is None else clock   # the queue of the link this op crosses
        self.across = across             # of the bytes sent, those over a two-tier network's thin link
        self._land = land                # a receive through a buffer of its own: copies it into the caller's tensor
        self._keep = keep                # what must outlive the real op (a send's staging buffer)
        self._reserved = reserved        # a send: its slot on the link, taken when it was issued
        self._not_before = not_before    # a receive: when its last byte left the sender (read off the message)
        self.accounting = (transport.meter, transport.tracer, kind)
        self._works = list(works)
        self._result, self._post = result, post
        self._issued = _now() if issued is None else issued
        self._flags = (tx, rx)
        self.deadline: float | None = None
        self._done = False
        self._lock = threading.Lock()
        self._once = threading.Lock()
        self._error: BaseException | None = None
        self._real: threading.Event | None = None  # set by the waiter thread (gloo point-to-point)
        self._real_at: float | None = None          # when the real op completed
        self._scheduled = threading.Event()
        self._callbacks: list = []
        self._arrival: list = []                    # on_arrival callbacks
        self._real_event = threading.Event()          # the real op completed (or failed)
        # the membership of its group (`Transport.generation`: a loss announced before this op was issued is a loss
        # to it), else the newest announced
        own = getattr(transport, "generation", None)
        self.generation = MEMBERSHIP.generation if own is None else own
        # a collective on an emulated link is delivered in issue order (`emulation.DeliveryQueue`)
        self._ordered = tx and rx and self.clock.link.emulated
        if self._ordered:
            transport.delivery.enqueue(self)
        if not self._works:
            self._on_real_done()
        else:  # timestamp the real completion as it happens (gloo's thread), so compute overlaps emulation
            try:
                self._works[-1].get_future().add_done_callback(self._on_future)
            except (RuntimeError, AttributeError):  # gloo point-to-point ops have no future: a waiter thread
                # (the only one to wait on the work: a second wait() on a finished gloo p2p work never returns)
                self._real = threading.Event()
                threading.Thread(target=self._wait_real, daemon=True).start()

    def _wait_real(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except RuntimeError as e:
            self._error = e  # the caller's own wait() raises it
        else:
            self._on_real_done()
        self._real.set()

    def _on_future(self, fut) -> None:
        """gloo's future completed: keep its error (the waiter must see it), then as any real completion."""
        try:
            fut.value()
        except BaseException as e:  # noqa: BLE001 - raised by result()
            self._error = e
        self._on_real_done()

    def _on_real_done(self) -> None:
        with self._lock:
            first = self._real_at is None
            if first:
                if self._land is not None:   # before anyone can see it arrived: the caller's tensor holds the data
                    self._land()
                self._real_at = _now()
                arrivals, self._arrival = self._arrival, []
        self._real_event.set()
        if self._ordered:
            self.transport.delivery.drain()
        else:
            with self._lock:
                scheduled = not self._scheduled.is_set()
                if scheduled:
                    self.schedule()
            if scheduled:
                self.fire()
        if first:
            for fn in arrivals:
                fn(self)

    def arrived(self) -> bool:
        """Whether the real operation finished (a receive's buffer holds the data), whatever its emulated delivery
        time: a receiver may post the receive that follows (a message's body after its header) without paying
        the link's latency twice."""
        return self._real_at is not None

    def on_arrival(self, fn) -> None:
        """`fn(self)` once the real operation finished (see `arrived`): on the thread that saw it, or now."""
        with self._lock:
            if self._real_at is None:
                self._arrival.append(fn)
                return
        fn(self)

    def schedule(self) -> None:
        """Take the delivery time from the link (the real op is done: `arrived`), then meter and trace the op.
        Called once: by the handle itself, or (a collective on an emulated link) by its transport's
        `DeliveryQueue` once every collective issued before it is on the link."""
        t_done = self._real_at
        if self._reserved is not None:
            self.deadline = max(self._reserved, t_done)
        else:
            tx, rx = self._flags
            after = self._not_before() if self._not_before is not None else 0.0
            self.deadline = self.clock.schedule(t_done, self.cost, tx=tx, rx=rx, not_before=after)
        self.transport.meter.record(self.kind, self.cost.sent, self.cost.received,
                                    real_s=t_done - self._issued, emulated_s=self.deadline - t_done,
                                    across=self.across)
        tr = self.transport.tracer
        tr.complete(self.kind, self._issued, t_done, "communicate", bytes=self.cost.sent)
        if self.deadline > t_done:
            tr.complete(self.kind + " (emulated)", t_done, self.deadline, "emulated")
        self._scheduled.set()

    def fire(self) -> None:
        """Run the callbacks registered before the delivery time was known (after `schedule`; no lock held)."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._deliver(fn)

    def add_done_callback(self, fn) -> None:
        """`fn(self)` once delivered: on the thread that saw the real op complete (gloo's), or a timer's at the
        emulated delivery; no polling thread in between (a DDP hook's future completes as DDP's own would)."""
        with self._lock:
            if not self._scheduled.is_set():
                self._callbacks.append(fn)
                return
        self._deliver(fn)

    def _deliver(self, fn) -> None:
        delay = self.deadline - _now()
        if delay > 0:
            timer = threading.Timer(delay, fn, args=(self,))
            timer.daemon = True
            timer.start()
        else:
            fn(self)

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._real is not None:
            if not self._real.is_set():
                return False
            if self._error is not None:     # failed: complete, and result() raises the error
                return True
        elif not all(w.is_completed() for w in self._works):
            return False
        self._on_real_done()
        return self._scheduled.is_set() and _now() >= self.deadline

    def result(self):
        if not self._done and MEMBERSHIP.watching:   # a lost peer must not leave this wait blocked
            try:
                self._watch(self._real if self._real is not None else self._real_event)   # the real op
                return self._result_once()
            except RuntimeError as e:
                lost = MEMBERSHIP.explain(e, self.generation)
                if lost is not None:
                    raise lost from (None if lost is e else e)
                raise
        return self._result_once()

    def _watch(self, event: threading.Event) -> None:
        """Wait for `event`, checking every 0.1 s whether the launcher announced a lost worker (`PeerLost`)."""
        while not event.wait(0.1):
            lost = MEMBERSHIP.lost(self.generation) if MEMBERSHIP.watching else None
            if lost is not None:
                raise lost

    def _result_once(self):
        if not self._done:
            with self._once:        # one thread waits on the works (a gloo p2p work cannot be waited twice)
                if not self._done:
                    if self._real is not None:
                        self._real.wait()
                    elif self._real_at is None:   # (a work's own done-callback must not wait on it)
                        for w in self._works:
                            w.wait()
                    if self._error is not None:   # seen by the waiter thread or the future's callback
                        raise self._error
                    self._on_real_done()
                    self._watch(self._scheduled)      # an earlier collective still running: after it
                    while (delay := self.deadline - _now()) > 0:    # the link still delivering it: busy
                        progress.moving()
                        time.sleep(min(delay, MOVING_S))
                    if self._post is not None:
                        self._result = self._post(self._result)
                    self._done = True
        return self._result
