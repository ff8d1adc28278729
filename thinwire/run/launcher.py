"""The embedded default: N worker processes on 127.0.0.1, each running torch.distributed (gloo).

`launch(fn, world_size)` runs `fn(rank, world_size, *args)` in every worker and returns the workers' return
values by rank. A `Pool` keeps the workers (and their process group) alive across several runs, which is what
the tests use: starting 4 gloo workers costs seconds. If any worker raises, dies or stalls, every worker is
stopped and a `WorkerError` names the rank and carries its traceback: nothing hangs, nothing is left behind.
Under torchrun, call `init()` instead: it reads torchrun's environment and initialises the same way.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from datetime import timedelta

from ..comm import set_default_network
from ..errors import UserError, WorkerError
from ..net import parse_network

_ctx = mp.get_context("spawn")


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker when the launcher dies (Linux); no stray processes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _threads_per_worker(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


def _report_and_exit(results, message, code: int) -> None:
    """Report to the launcher and exit; the queue is flushed first so the report is never lost."""
    results.put(message)
    results.close()
    results.join_thread()
    sys.stderr.flush()
    os._exit(code)


def _heartbeat(beats, rank: int, every: float = 0.5) -> None:
    """(daemon thread) show the launcher this process is alive; a stopped or hung process stops beating."""
    while True:
        beats[rank] = time.monotonic()
        time.sleep(every)


def _worker_main(rank, world_size, backend, host, port, timeout_s, tasks, results, beats):
    _die_with_parent()
    import threading
    threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True).start()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(_threads_per_worker(world_size))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops everyone
        _report_and_exit(results, (rank, -1, "error", f"cannot start: {e}", traceback.format_exc()), 1)
    results.put((rank, -1, "ok", b"", ""))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, blob = task
        try:
            fn, args, network, seed = pickle.loads(blob)
            set_default_network(network, seed)
            value = fn(rank, world_size, *args)
            out = pickle.dumps(value)
        except BaseException as e:  # noqa: BLE001
            kind = "usererror" if isinstance(e, UserError) else "error"
            _report_and_exit(results, (rank, task_id, kind, f"{type(e).__name__}: {e}",
                                       traceback.format_exc()), 1)
        results.put((rank, task_id, "ok", out, ""))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _peer_failure(message: str) -> bool:
    """An error that only says another worker went away."""
    text = message.lower()
    return any(k in text for k in ("connection closed by peer", "connection reset", "remote worker crash",
                                   "broken pipe", "connection refused", "socket closed"))


class Pool:
    """`world_size` workers with an initialised process group, running functions on request."""

    def __init__(self, world_size: int, backend: str = "gloo", host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0, start_timeout: float = 120.0, stall_timeout: float = 60.0):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise UserError(f"world size must be an integer >= 1, got {world_size!r}")
        if backend not in ("gloo", "nccl"):
            raise UserError(f"unknown backend {backend!r}; valid: gloo, nccl")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise UserError(f"port must be in 0..65535, got {port!r}")
        import torch.distributed as dist
        self.world_size, self.timeout, self.stall_timeout = world_size, timeout, stall_timeout
        try:  # the launcher hosts the rendezvous store: no free-port race
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout))
        except (RuntimeError, OSError) as e:
            raise UserError(f"cannot listen on {host}:{port} (port in use?): {e}") from None
        self.port = self._store.port
        self._results = _ctx.Queue()
        self._beats = _ctx.Array("d", world_size, lock=False)  # last heartbeat of each worker (monotonic)
        self._tasks = [_ctx.Queue() for _ in range(world_size)]
        self._procs = [_ctx.Process(target=_worker_main, name=f"thinwire-worker-{r}", daemon=True,
                                    args=(r, world_size, backend, host, self.port, timeout,
                                          self._tasks[r], self._results, self._beats))
                       for r in range(world_size)]
        self._task_id = -1
        self._closed = False
        for p in self._procs:
            p.start()
        self._collect(-1, start_timeout)

    def _collect(self, task_id: int, timeout: float | None) -> list:
        got: dict[int, bytes] = {}
        errors: list[WorkerError] = []
        deadline = time.monotonic() + (timeout if timeout else self.timeout)
        while len(got) < self.world_size:
            try:
                rank, tid, status, payload, tb = self._results.get(timeout=0.05)
                if status == "usererror":  # bad input found inside a worker: the caller's error, not a crash
                    self.close(force=True)
                    raise UserError(payload.split(": ", 1)[-1])
                if status == "error":
                    errors.append(WorkerError(rank, payload, tb))
                elif tid == task_id:
                    got[rank] = payload
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if r not in got and p.exitcode is not None]
            if errors or dead:
                self._fail(self._root_cause(errors))
            now = time.monotonic()
            silent = [r for r in range(self.world_size) if 0 < self._beats[r] < now - self.stall_timeout]
            if silent:
                self._fail(WorkerError(silent[0], f"stalled: no heartbeat for {now - self._beats[silent[0]]:.0f} s "
                                                  f"(the process is stopped or hung)"))
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                self._fail(WorkerError(missing[0], f"stalled: no result within {timeout or self.timeout:.0f} s "
                                                   f"(ranks {missing} still running)"))
        return [got[r] for r in range(self.world_size)]

    def _root_cause(self, errors: list[WorkerError], grace: float = 1.0) -> WorkerError:
        """When one worker fails, its peers soon fail too ("connection closed"): wait a moment, then name the
        first worker that failed on its own, else one that died without a word, else the first report."""
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                rank, _, status, payload, tb = self._results.get(timeout=0.05)
                if status == "error":
                    errors.append(WorkerError(rank, payload, tb))
            except queue.Empty:
                pass
        primary = [e for e in errors if not _peer_failure(e.cause)]
        if primary:
            return primary[0]
        reported = {e.rank for e in errors}
        for r, p in enumerate(self._procs):
            code = p.exitcode
            if r not in reported and code not in (None, 0):
                why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return WorkerError(r, f"worker process died ({why})")
        return errors[0] if errors else WorkerError(-1, "a worker exited unexpectedly")

    def _fail(self, error: Exception):
        self.close(force=True)
        raise error

    def run(self, fn, *args, network="lan", seed: int = 0, timeout: float | None = None) -> list:
        """Run `fn(rank, world_size, *args)` on every worker; the list of return values by rank."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        parse_network(network)  # a bad profile is the caller's error, reported before any work starts
        self._task_id += 1
        blob = pickle.dumps((fn, args, network, seed))
        for q in self._tasks:
            q.put((self._task_id, blob))
        return [pickle.loads(b) for b in self._collect(self._task_id, timeout)]

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        for q in self._tasks + [self._results]:
            q.close()
            q.cancel_join_thread()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


def launch(fn, world_size: int, network="lan", backend: str = "gloo", args: tuple = (),
           timeout: float | None = None, seed: int = 0, host: str = "127.0.0.1", port: int = 0) -> list:
    """Start `world_size` workers on `host`, run `fn(rank, world_size, *args)` in each under the emulated
    `network`, and return their return values by rank. Raises `WorkerError` if any worker fails."""
    parse_network(network)
    with Pool(world_size, backend=backend, host=host, port=port, timeout=timeout or 3600.0) as pool:
        return pool.run(fn, *args, network=network, seed=seed, timeout=timeout)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                  and "MASTER_ADDR" in os.environ)


def init(network="lan", backend: str = "gloo", seed: int = 0, timeout: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed inside a process started by torchrun; returns (rank, world_size)."""
    import torch
    import torch.distributed as dist
    if not under_torchrun():
        raise UserError("thinwire.init() expects torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR); "
                        "on one machine use thinwire.launch instead")
    set_default_network(network, seed)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or
                              _threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    return dist.get_rank(), dist.get_world_size()
