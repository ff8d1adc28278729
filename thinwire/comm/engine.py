"""Futures that chain, and the engine that issues every operation of a process in one order.

A `Future` is a result that will be there: `wait()` (blocking; the time blocked counts as exposed communication
when the future belongs to a Transport), `is_completed()`, `then(fn)` (a future of `fn(result)`; if `fn` returns a
future, of that future's result) and `add_done_callback(fn)` (run on a background thread once completed).

A *program* is a generator that communicates: it issues operations on a Transport and `yield`s a future whenever
it needs that future's result to go on (`value = yield handle`); it `return`s its result, a value or a future
(typically its last collective with the local post-processing chained by `then`, so the engine need not wait for
the last round). Sub-programs compose with `yield from`.

`ENGINE.submit(program)` returns a `Task` at once. gloo matches a process group's collectives by the order they are
issued, so every operation of this process is issued in submission order, and a program's operations are
contiguous: a program waiting for one round before issuing the next keeps the engine until its last operation is
issued. When the engine is idle a program starts on the caller's thread (a single all-reduce is issued at once)
and moves to the engine's thread at its first `yield` of a future that is not complete; otherwise it is queued.
So a multi-round exchange (PowerSGD's two all-reduces, gTop-k's rounds, a ring all-reduce of point-to-point
messages, an agreed scale) returns at once and completes while the caller computes. Transport operations called
outside a program go through the engine too: nothing a training thread issues overtakes a queued program.

Options of a submission: `background=True` never runs the program on the caller's thread (compression overlaps
backward, the compress/communicate pipeline of Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed
Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §II-D); `serial=True` waits for the program's result to be
delivered before the next program starts (one transfer in flight: a NCCL stream, Horovod's background thread).
"""
from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from typing import Any, Callable, Generator

_now = time.perf_counter
_tls = threading.local()


def in_program() -> bool:
    """Whether this thread is running a program now (its operations are issued directly, in its order)."""
    return getattr(_tls, "depth", 0) > 0


class Future:
    """A result that will be there. Subclasses implement `result()` (block, uncounted) and `is_completed()`."""

    accounting: tuple | None = None       # (meter, tracer, label): wait() counts the blocked time as exposed

    def result(self) -> Any:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def wait(self) -> Any:
        """The result; the time this call blocks is exposed communication (metered and traced)."""
        if self.accounting is None or self.is_completed():
            return self.result()
        t0 = _now()
        try:
            return self.result()
        finally:
            t1 = _now()
            meter, tracer, label = self.accounting
            meter.add_wait(t1 - t0)
            if t1 - t0 > 1e-4:
                tracer.complete("wait " + label, t0, t1, "wait")

    def then(self, fn: Callable[[Any], Any]) -> "Future":
        """A future of `fn(self.result())`, computed once, by the first thread that asks for it. `fn` does local
        work (decompress, divide); a further round of communication belongs in a program."""
        return Then(self, fn)

    def add_done_callback(self, fn: Callable[["Future"], None]) -> None:
        """`fn(self)` once completed, on a background thread (the one that saw the operation complete, or the
        callback thread), or now, here, if already completed. `fn` must not communicate: its moment differs
        between ranks."""
        if self.is_completed():
            fn(self)
        else:
            _callbacks().put(self, fn)


class Ready(Future):
    """A future that is already there."""

    def __init__(self, value: Any = None):
        self.value = value

    def result(self) -> Any:
        return self.value

    def is_completed(self) -> bool:
        return True


class Then(Future):
    def __init__(self, base: Future, fn: Callable[[Any], Any]):
        self.base, self.fn = base, fn
        self.accounting = base.accounting
        self._lock = threading.Lock()
        self._state: tuple | None = None      # ("ok", value) or ("error", exception)

    def add_done_callback(self, fn) -> None:
        base = self.base
        if self._state is None and base is not None:
            base.add_done_callback(lambda _: fn(self))
        else:
            Future.add_done_callback(self, fn)

    def is_completed(self) -> bool:
        base = self.base        # read first: result() on another thread sets _state, then drops base
        if self._state is None:
            return base.is_completed()
        inner = self._state[1]
        return not isinstance(inner, Future) or inner.is_completed()

    def result(self) -> Any:
        with self._lock:
            if self._state is None:
                try:
                    self._state = ("ok", self.fn(self.base.result()))
                except BaseException as e:  # noqa: BLE001 - kept, raised to every caller
                    self._state = ("error", e)
                self.base = self.fn = None
        kind, value = self._state
        if kind == "error":
            raise value
        return value.result() if isinstance(value, Future) else value


class Task(Future):
    """A submitted program: completes when the program returned and the future it returned (if any) completed."""

    def __init__(self, accounting: tuple | None = None):
        self.accounting = accounting
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    @property
    def issued(self) -> bool:
        """Whether the program has issued all its operations (returned)."""
        return self._done.is_set()

    def add_done_callback(self, fn) -> None:
        if self._done.is_set() and self._error is None and isinstance(self._value, Future):
            self._value.add_done_callback(lambda _: fn(self))   # issued: when its last future completes
        else:
            Future.add_done_callback(self, fn)

    def unwrap(self) -> Future:
        """The future the program returned, once it returned (its operations are all issued), else the task
        itself; raises at once if the program already failed."""
        if self._done.is_set():
            if self._error is not None:
                raise self._error
            if isinstance(self._value, Future):
                return self._value
        return self

    def is_completed(self) -> bool:
        if not self._done.is_set():
            return False
        return self._error is not None or not isinstance(self._value, Future) or self._value.is_completed()

    def result(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value.result() if isinstance(self._value, Future) else self._value


def run_nested(program: Generator) -> Any:
    """Drive a program to its end on this thread, blocking at each yield (a program called as a plain function
    from inside another program; prefer `yield from`)."""
    value, error = None, None
    while True:
        try:
            fut = program.throw(error) if error is not None else program.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = _outcome(fut)


def _outcome(fut: Future) -> tuple:
    """Block on `fut`: (its result, None) or (None, its error), what a program waiting on it resumes with."""
    try:
        return fut.result(), None
    except BaseException as e:  # noqa: BLE001
        return None, e


class Engine:
    """Issues the operations of this process in submission order (see the module docstring)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()   # (task, program, serial, resume value)
        self._busy = False                                      # a program is running (on some thread)
        self._barrier: Future | None = None                     # a serial program's result, still in flight
        self._thread: threading.Thread | None = None

    def submit(self, program: Generator, background: bool = False, serial: bool = False,
               accounting: tuple | None = None) -> Task:
        task = Task(accounting)
        if in_program():            # a program submitting another: run it here, in its place in the order
            try:
                task._finish(run_nested(program))
            except BaseException as e:  # noqa: BLE001
                task._finish(error=e)
            return task
        with self._cv:
            inline = (not background and not self._busy and not self._queue
                      and (self._barrier is None or self._barrier.is_completed()))
            if inline:
                self._busy, self._barrier = True, None
            else:
                self._queue.append((task, program, serial, None))
                self._wake()
        if inline:
            self._advance(task, program, serial, None, on_caller=True)
        return task

    def _wake(self) -> None:
        """(lock held) A program was queued: wake the engine's thread, starting it if it is not running."""
        if self._thread is None or not self._thread.is_alive():
            # the engine's thread must get the GIL back soon after each round completes, while the training
            # thread computes: a 5 ms switch interval adds up to ~5 ms per round (a ring all-reduce of 2(n-1)
            # point-to-point rounds loses most of its overlap); 1 ms keeps it
            sys.setswitchinterval(min(sys.getswitchinterval(), 1e-3))
            self._thread = threading.Thread(target=self._loop, name="thinwire-engine", daemon=True)
            self._thread.start()
        self._cv.notify()

    def _advance(self, task: Task, program: Generator, serial: bool, resume: tuple | None,
                 on_caller: bool) -> None:
        """Run `program` from `resume` = (value, error) until it returns (or, on the caller's thread, until it
        yields a future that is not complete: then the engine's thread goes on with it, first in line)."""
        value, error = resume if resume is not None else (None, None)
        _tls.depth = getattr(_tls, "depth", 0) + 1
        try:
            while True:
                try:
                    fut = program.throw(error) if error is not None else program.send(value)
                except StopIteration as stop:
                    self._done(task, stop.value, None, serial)
                    return
                except BaseException as e:  # noqa: BLE001 - the task carries it to whoever waits
                    self._done(task, None, e, serial)
                    return
                if on_caller and not fut.is_completed():
                    with self._cv:
                        self._queue.appendleft((task, program, serial, fut))
                        self._wake()
                    return
                value, error = _outcome(fut)
        finally:
            _tls.depth -= 1

    def _done(self, task: Task, value: Any, error: BaseException | None, serial: bool) -> None:
        task._finish(value, error)
        with self._cv:
            if serial and error is None and isinstance(value, Future) and not value.is_completed():
                self._barrier = value
            self._busy = bool(self._queue)  # a queued program is the engine thread's next; nobody else starts
            if self._busy:
                self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue)
                task, program, serial, pending = self._queue.popleft()
                self._busy = True
                barrier, self._barrier = self._barrier, None
            if barrier is not None and pending is None:
                _outcome(barrier)           # serial: the previous program's transfer is delivered first
            resume = _outcome(pending) if pending is not None else None
            self._advance(task, program, serial, resume, on_caller=False)

    def abandon(self, error: BaseException) -> None:
        """Fail every queued program with `error` (their group is gone: a lost peer); the running one fails
        by itself at its next wait."""
        with self._cv:
            queued, self._queue = list(self._queue), collections.deque()
            self._barrier = None
        for task, program, _serial, _pending in queued:
            program.close()
            task._finish(error=error)


class _Callbacks:
    """One thread running `add_done_callback` callbacks, in the order their futures were registered."""

    def __init__(self):
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="thinwire-callbacks", daemon=True)
        self._thread.start()

    def put(self, fut: Future, fn) -> None:
        with self._cv:
            self._q.append((fut, fn))
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._q)
                fut, fn = self._q.popleft()
            _outcome(fut)                   # completed; its error is its owner's to see
            try:
                fn(fut)
            except BaseException:  # noqa: BLE001 - a callback's error is the callback's to report
                traceback.print_exc()


_CALLBACKS: _Callbacks | None = None
_CB_LOCK = threading.Lock()


def _callbacks() -> _Callbacks:
    global _CALLBACKS
    with _CB_LOCK:
        if _CALLBACKS is None:
            _CALLBACKS = _Callbacks()
        return _CALLBACKS


ENGINE = Engine()
