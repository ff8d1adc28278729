"""The engine (thinwire.comm.engine): futures that chain, programs issued in submission order, inline when
idle, background and serial options, errors; and across real workers, that every multi-round exchange returns at
once and overlaps compute (the step takes about max(compute, comm), not the sum)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from thinwire.comm.engine import Engine, Future, Ready, Then, in_program, run_nested


class Gate(Future):
    """A future completed by the test."""

    def __init__(self):
        self.event, self.value = threading.Event(), None

    def set(self, value=None):
        self.value = value
        self.event.set()

    def result(self):
        self.event.wait()
        return self.value

    def is_completed(self):
        return self.event.is_set()


def test_programs_issue_in_submission_order_and_contiguously():
    eng, log = Engine(), []
    g1, g2 = Gate(), Gate()

    def prog(name, gate):
        log.append((name, 1, threading.current_thread().name))
        got = yield gate                      # needs a result before its second round
        log.append((name, 2, got))
        return Ready(name)

    t1 = eng.submit(prog("a", g1))            # idle engine: starts on the caller's thread
    t2 = eng.submit(prog("b", g2))            # queued behind a's second round
    assert log == [("a", 1, threading.current_thread().name)]
    assert not t1.is_completed() and not t2.is_completed()
    g2.set("B")                                # b's gate opens first: b still waits for a
    time.sleep(0.05)
    assert log == [("a", 1, threading.current_thread().name)]
    g1.set("A")
    assert t1.wait() == "a" and t2.wait() == "b"
    assert [entry[:2] for entry in log] == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert log[1][2] == "A" and log[3][2] == "B"
    assert log[2][2] == "thinwire-engine"      # b ran on the engine's thread


def test_background_never_runs_on_the_caller_and_serial_waits_for_delivery():
    eng = Engine()
    where, last = [], Gate()

    def prog():
        where.append(threading.current_thread().name)
        return last
        yield  # noqa: unreachable - a program

    def after():
        where.append(("after", last.is_completed()))
        return 1
        yield  # noqa: unreachable

    t = eng.submit(prog(), background=True, serial=True)
    t2 = eng.submit(after())
    time.sleep(0.05)
    assert where == ["thinwire-engine"]           # `after` waits: the serial program is not delivered yet
    assert t.issued and not t.is_completed()
    last.set(5)
    assert t.wait() == 5 and t2.wait() == 1
    assert where[1] == ("after", True)


def test_errors_reach_the_waiter_and_do_not_stop_the_engine():
    eng = Engine()

    def bad():
        yield Ready(1)
        raise ValueError("boom")

    def thrown(gate):
        try:
            yield gate
        except KeyError:
            return "caught"

    t = eng.submit(bad())
    with pytest.raises(ValueError, match="boom"):
        t.wait()
    g = Gate()
    g.result = lambda: (_ for _ in ()).throw(KeyError("x"))   # a future that fails
    g.event.set()
    assert eng.submit(thrown(g)).wait() == "caught"            # thrown into the program, which may handle it
    with pytest.raises(ValueError):
        eng.submit(bad()).unwrap()                             # a program that failed inline fails at once


def test_then_chains_values_and_futures_once():
    calls = []
    base = Gate()
    f = base.then(lambda v: calls.append(v) or v + 1).then(lambda v: Ready(v * 10))
    assert isinstance(f, Then) and not f.is_completed()
    base.set(1)
    assert f.wait() == 20 and f.wait() == 20 and calls == [1]
    done = []
    f.add_done_callback(lambda fut: done.append(fut.result()))   # completed: runs now, here
    g = Gate()
    g.add_done_callback(lambda fut: done.append(fut.result()))   # later, on the callback thread
    g.set(7)
    for _ in range(200):
        if len(done) == 2:
            break
        time.sleep(0.01)
    assert done == [20, 7]


def test_nested_programs_run_in_place():
    eng = Engine()

    def inner():
        v = yield Ready(2)
        return v * 3

    def outer():
        assert in_program()
        sub = eng.submit(inner())              # a program submitting another: run here, in its place
        return sub.result() + (yield from inner())

    assert eng.submit(outer()).wait() == 12 and run_nested(inner()) == 6 and not in_program()


# -- across real workers: every multi-round exchange overlaps compute -------------------------------------------
def _busy(seconds: float) -> None:
    a = torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a * 1e-3)


CASES = {  # name -> (compressor, memory, exchange options, transport all-reduce)
    "powersgd": ("powersgd", "powersgd", {}, "gloo"),          # two all-reduces
    "qsgd": ("qsgd", "none", {}, "gloo"),                      # a max all-reduce agrees on the scale first
    "gtopk": ("topk", "residual", {"sparse_collective": "gtopk"}, "gloo"),   # log2 n point-to-point rounds
    "ring": ("none", "none", {}, "ring"),                      # 2(n-1) point-to-point rounds
}


def _overlap_worker(rank, world_size):
    from thinwire.comm import Transport
    from thinwire.exchange import Exchange
    out = {}
    for name, (comp, mem, opts, allreduce) in CASES.items():
        tr = Transport(allreduce=allreduce)
        ex = Exchange(tr, comp, mem, **opts)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(rank))
        ex.start(x, "w", shapes=[(256, 64)]).wait()          # warm-up (connections, warm starts)
        tr.barrier()
        t0 = time.perf_counter()
        ex.start(x, "w", shapes=[(256, 64)]).wait()
        comm = time.perf_counter() - t0
        tr.barrier()
        t0 = time.perf_counter()
        fut = ex.start(x, "w", shapes=[(256, 64)])
        started = time.perf_counter() - t0
        _busy(comm)
        fut.wait()
        out[name] = {"comm": comm, "started": started, "overlap": time.perf_counter() - t0}
    return out


def test_every_multi_round_exchange_returns_at_once_and_overlaps_compute(pool4):
    for r in pool4.run(_overlap_worker, network="custom:latency=30ms"):
        for name, m in r.items():
            # several rounds at >= 2 × 20 ms each: comm is large; start() returned before the first round ended
            assert m["comm"] > 0.05, (name, m)
            assert m["started"] < 0.5 * m["comm"], (name, m)
            # compute ran ~comm and the exchange took ~comm: about max(compute, comm), far from their sum
            assert m["overlap"] < 1.6 * m["comm"] + 0.03, (name, m)
