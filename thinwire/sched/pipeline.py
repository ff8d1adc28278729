"""Compression pipelining (catalog §2.5.4, seed 000 §II-D): a 3-stage pipeline of gradient computation,
compression and communication.

The backward pass (stage 1) hands full buckets to one background thread that compresses each and starts its
transfer (stage 2: `Exchange.start`, which compensates, compresses and issues an asynchronous collective);
the transport's own thread moves the bytes (stage 3). So compressing bucket b overlaps both the backward of the
layers still running and the transfer of bucket b-1. One thread, first-in first-out, keeps the order of the
collectives the same on every rank. PyTorch kernels release the GIL, so the stages really run side by side.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


def wait_quietly(handle) -> None:
    """Block until `handle` completed, polling (back-off 50 µs .. 1 ms) instead of `wait()`, so the time spent
    here on a background thread is not counted as exposed communication."""
    pause = 5e-5
    while not handle.is_completed():
        time.sleep(pause)
        pause = min(1e-3, pause * 2)


class Pipeline:
    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._results: dict[Any, Any] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="thinwire-pipeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, fn = item
                if self._error is None:
                    self._results[key] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread by drain()
                self._error = e
            finally:
                self._q.task_done()

    def submit(self, key: Any, fn: Callable[[], Any]) -> None:
        self._q.put((key, fn))

    def drain(self) -> dict:
        """Wait until every submitted stage ran; return {key: result} and forget them."""
        self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            self._results.clear()
            raise err
        out, self._results = self._results, {}
        return out

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=10)
