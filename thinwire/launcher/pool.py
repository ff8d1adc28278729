"""The embedded default: N worker processes on 127.0.0.1, each running torch.distributed (gloo).

`launch(fn, world_size)` runs `fn(rank, world_size, *args)` in every worker and returns the workers' return
values by rank. A `Pool` keeps the workers (and their process group) alive across several runs, which is what
the tests use: starting 4 gloo workers costs seconds. If any worker raises, dies or stalls, every worker is
stopped and a `WorkerError` names the rank and carries its traceback: nothing hangs, nothing is left behind.
Under torchrun, call `init()` instead: it reads torchrun's environment and initialises the same way.

What the launcher watches, quickest first:
- a worker process that dies is named at once (with its exit code or signal);
- liveness: each worker's heartbeat thread beats every 0.5 s; a process silent for `stall_timeout` (stopped,
  or wedged as a whole) is named;
- progress: a worker whose training loop calls `report_progress(step)` every step (`Trainer.step` does) is
  watched on its steps. When no running rank has advanced for max(`progress_timeout`, 50 x the median step
  time seen so far), the rank the others wait for (the lowest step) is named: `rank 2 made no progress for
  95 s (stuck at step 41; others at step 42)`; a stuck collective shows as every rank at one step. This is
  what catches a training thread that blocks while its heartbeat thread beats on;
- a run that reports no progress (none yet, or a function that never calls `report_progress`, or with the
  watchdog off) is bounded by `timeout` (3600 s under `launch`, 600 s for a bare `Pool`), the last resort. Once a
  run reports progress the watchdog bounds it instead: a run lasts as long as it progresses (hours, days);
- `deadline` (`launch(deadline=...)`, `Pool.run(deadline=...)`, `thinwire train --deadline S`; none by default)
  ends a run at that wall time whatever its progress, for those who want one.
When the launcher gives up on a hang (a stall, no progress, no result, or only "connection closed" from the
ranks), the error carries every live worker's Python stacks at that moment, each thread's (`faulthandler`, on
`STACKS_SIGNAL`: written from C, so a thread blocked inside a collective shows where it waits).

The rendezvous store listens on `host` only (127.0.0.1 by default: the launcher binds the socket there and
hands it to `TCPStore`, whose own listener would bind every interface), and with a loopback `host` the
workers' gloo sockets are pinned to the loopback interface (`GLOO_SOCKET_IFNAME=lo` unless already set).
Nothing here authenticates: keep these ports off untrusted networks.
"""
from __future__ import annotations

import ctypes
import ipaddress
import math
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections import deque
from datetime import timedelta

from ..comm import set_default_network
from ..comm import progress
from ..comm.membership import MEMBERSHIP
from ..errors import UserError, WorkerError
from ..net import parse_network

_ctx = mp.get_context("spawn")

MAX_LOCAL_WORKERS = 512     # processes on one machine: each holds an interpreter, torch and a copy of the model
PROGRESS_TIMEOUT = 300.0    # the progress watchdog's bound (s) by default, ...
PROGRESS_STEPS = 50         # ... raised to this many median step times when steps are slow

report_progress = progress.report   # thinwire.report_progress: see thinwire/comm/progress.py
STACKS_SIGNAL = getattr(signal, "SIGUSR2", None)   # a worker writes its threads' Python stacks on it
_stacks_file = None                                 # (worker) where, kept open for faulthandler


class DeadlineError(WorkerError):
    """The run outlived the deadline it was given (`deadline=`, `--deadline`), progress or not."""


class NoProgressError(WorkerError):
    """The progress watchdog's verdict. Its message is the whole story; `rank` is the rank the others wait
    for, or -1 when every rank is stuck at the same step (a stuck collective: no single rank to blame)."""

    def __init__(self, rank: int, cause: str, traceback: str = "", stacks: str = ""):
        super().__init__(rank, cause, stacks=stacks)
        self.args = (cause,)


def check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UserError(f"world size must be an integer >= 1, got {world_size!r}")
    if world_size > MAX_LOCAL_WORKERS:
        raise UserError(f"world size must be at most {MAX_LOCAL_WORKERS} on one machine, got {world_size} "
                        f"(each worker is a process with its own interpreter, torch runtime and copy of the "
                        f"model); across machines run under torchrun")


def _check_timeout(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UserError(f"{name} must be a finite number of seconds > 0{' (or None: off)' if allow_none else ''}, "
                        f"got {value!r}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _listen(host: str, port: int) -> tuple[int, int]:
    """A socket listening on `host`:`port` and on nothing wider, detached: (fd, port). `TCPStore` takes the fd
    over (`master_listen_fd`); its own master listener would bind every interface (`*:PORT`)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} (port in use?): {e}") from None
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker when the launcher dies (Linux); no stray processes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _threads_per_worker(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


def _fail_and_exit(results, head: tuple, kind: str, cause: str) -> None:
    """Report a failure, with the exception being handled, to the launcher and exit; the queue is flushed first
    so the report is never lost. `head`: the fields the launcher's results start with ((rank, task) here; the
    elastic launcher's (slot, task, member))."""
    results.put((*head, kind, cause, traceback.format_exc()))
    results.close()
    results.join_thread()
    sys.stderr.flush()
    os._exit(1)


def _heartbeat(beats, rank: int, every: float = 0.5) -> None:
    """(daemon thread) show the launcher this process is alive; a stopped or hung process stops beating."""
    while True:
        beats[rank] = time.monotonic()
        time.sleep(every)


def _watch_membership(host: str, port: int, world_size: int) -> None:
    """(daemon thread, on_failure="continue") hand the launcher's announcements of lost workers to
    `thinwire.comm.membership`: generation g's surviving ranks are published under `thinwire/members/g`."""
    import torch.distributed as dist
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(days=365))
    generation = 0
    while True:
        key = f"thinwire/members/{generation + 1}"
        store.wait([key])
        generation += 1
        MEMBERSHIP.announce(generation, [int(r) for r in store.get(key).decode().split(",")])


def pick_backend(backend: str | None, device: str | None, local_world_size: int = 1) -> tuple[str, str]:
    """(backend, device) from what was asked: the CPU means gloo; CUDA means NCCL with one process per GPU, or,
    with more processes on this machine than GPUs (e.g. 4 workers racing on one workstation GPU), gloo with the
    processes sharing the GPUs (worker r on GPU r mod count): NCCL refuses two ranks on one device, gloo runs
    collectives on CUDA tensors, and thinwire's transport stages point-to-point messages through host buffers.
    Bad combinations are the caller's error, raised before any process starts."""
    if backend not in (None, "gloo", "nccl"):
        raise UserError(f"unknown backend {backend!r}; valid: gloo, nccl")
    if device not in (None, "cpu", "cuda"):
        raise UserError(f"unknown device {device!r}; valid: cpu, cuda")
    device = device or ("cuda" if backend == "nccl" else "cpu")
    if backend == "nccl" and device != "cuda":
        raise UserError("backend nccl needs device cuda; valid: backend gloo with device cpu, nccl with cuda")
    if device == "cuda":
        import torch
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not have:
            raise UserError("device cuda: this machine has no GPU that torch can use "
                            "(torch.cuda.is_available() is False); valid: device cpu")
        if backend == "nccl" and have < local_world_size:
            raise UserError(f"backend nccl: {local_world_size} workers need {local_world_size} GPUs (NCCL takes "
                            f"one process per GPU), this machine has {have}; valid: backend gloo (workers share "
                            f"the GPUs), or at most {have} workers")
        backend = backend or ("nccl" if local_world_size <= have else "gloo")
    return backend or "gloo", device


def gpu_of(local_rank: int) -> int:
    """The GPU a worker of this machine trains on: its own where there are enough, else shared (round robin)."""
    import torch
    return local_rank % torch.cuda.device_count()


def _dump_stacks_on_signal(path: str | None) -> None:
    """(worker) On `STACKS_SIGNAL`, write every thread's Python stack to `path`."""
    global _stacks_file
    if path is None or STACKS_SIGNAL is None:
        return
    import faulthandler
    _stacks_file = open(path, "w")
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)


def _worker_main(rank, world_size, backend, host, port, timeout_s, tasks, results, beats, steps, times,
                 worker_init, on_failure="stop", device="cpu", stacks=None):
    _die_with_parent()
    _dump_stacks_on_signal(stacks)
    try:
        if worker_init is not None:  # first, on this (main) thread: e.g. enter a network namespace
            worker_init(rank, world_size)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops everyone
        _fail_and_exit(results, (rank, -1), "error", f"cannot start: worker_init failed: {type(e).__name__}: {e}")
    if _is_loopback(host) and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback too, not the host's address
    import threading
    threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True).start()
    progress.install(steps, times, rank)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(_threads_per_worker(world_size))
    if backend == "nccl":  # one process per GPU: this worker's rank is its local rank
        os.environ["LOCAL_RANK"] = str(rank)
    if device == "cuda":   # its GPU (shared with other workers under gloo) is its current device
        torch.cuda.set_device(gpu_of(rank))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops everyone
        _fail_and_exit(results, (rank, -1), "error", f"cannot start: {e}")
    if on_failure == "continue":
        MEMBERSHIP.watch(world_size)
        threading.Thread(target=_watch_membership, args=(host, port, world_size), daemon=True).start()
    results.put((rank, -1, "ok", b"", ""))
    for task_id, blob in iter(tasks.get, None):  # until close() sends None
        try:
            fn, args, network, seed = pickle.loads(blob)
            set_default_network(network, seed)
            out = pickle.dumps(fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001
            kind = "usererror" if isinstance(e, UserError) else "error"
            _fail_and_exit(results, (rank, task_id), kind, f"{type(e).__name__}: {e}")
        results.put((rank, task_id, "ok", out, ""))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _died(code: int) -> str:
    """Why a worker process is gone, from its exit code (negative: the signal that killed it)."""
    why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"worker process died ({why})"


def _hung(error: WorkerError) -> bool:
    """A failure that shows a hang (a stall, no progress, no result) or only a peer's going away: where every
    worker was is then the story."""
    return isinstance(error, NoProgressError) or error.cause.startswith("stalled") or _peer_failure(error.cause)


def _peer_failure(message: str) -> bool:
    """An error that only says another worker went away."""
    text = message.lower()
    return any(k in text for k in ("connection closed by peer", "connection reset", "remote worker crash",
                                   "broken pipe", "connection refused", "socket closed"))


class Pool:
    """`world_size` workers with an initialised process group, running functions on request.

    `worker_init(rank, world_size)`, if given (picklable: a module-level function or a `functools.partial` of
    one), runs first in each worker, before the process group is initialised: e.g. to enter a network
    namespace. `progress_timeout` (None: off) bounds the time without progress (see `report_progress`).

    `on_failure="continue"`: a worker process that dies does not stop the others. The launcher announces the
    survivors (a new membership generation in its store); a `Trainer(on_failure="continue")` in each survivor
    forms a new group at its next synchronization point and goes on. `run` returns None for a lost rank and
    `lost` names it. The pool's group has changed: it is closed after that run."""

    def __init__(self, world_size: int, backend: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0, start_timeout: float = 120.0, stall_timeout: float = 60.0,
                 progress_timeout: float | None = PROGRESS_TIMEOUT, worker_init=None, on_failure: str = "stop",
                 device: str | None = None):
        check_world_size(world_size)
        if on_failure not in ("stop", "continue"):
            raise UserError(f"on_failure must be stop or continue, got {on_failure!r}")
        self.on_failure = on_failure
        self.lost: list[dict] = []          # workers lost and survived (on_failure="continue")
        self.backend, self.device = pick_backend(backend, device, world_size)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise UserError(f"port must be in 0..65535, got {port!r}")
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout),
                            ("stall_timeout", stall_timeout)):
            _check_timeout(name, value)
        _check_timeout("progress_timeout", progress_timeout, allow_none=True)
        if worker_init is not None and not callable(worker_init):
            raise UserError(f"worker_init must be callable, got {type(worker_init).__name__}")
        import torch.distributed as dist
        self.world_size, self.timeout, self.stall_timeout = world_size, timeout, stall_timeout
        self.progress_timeout = progress_timeout
        fd, self.port = _listen(host, port)  # the store listens on `host` only
        try:  # the launcher hosts the rendezvous store: no free-port race
            self._store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout), master_listen_fd=fd)
        except (RuntimeError, OSError) as e:
            os.close(fd)  # the store did not take it over
            raise UserError(f"cannot listen on {host}:{self.port}: {e}") from None
        self._results = _ctx.Queue()
        self._beats = _ctx.Array("d", world_size, lock=False)   # last heartbeat of each worker (monotonic)
        self._steps = _ctx.Array("q", world_size, lock=False)   # last step reported (-1: none in this run)
        self._times = _ctx.Array("d", world_size, lock=False)   # when it was reported (monotonic)
        self._tasks = [_ctx.Queue() for _ in range(world_size)]
        self._stacks_dir = tempfile.mkdtemp(prefix="thinwire-stacks-")
        self._procs = [_ctx.Process(target=_worker_main, name=f"thinwire-worker-{r}", daemon=True,
                                    args=(r, world_size, self.backend, host, self.port, timeout, self._tasks[r],
                                          self._results, self._beats, self._steps, self._times, worker_init,
                                          on_failure, self.device, self._stacks_path(r)))
                       for r in range(world_size)]
        self._task_id = -1
        self._gone: set[int] = set()
        self._generation = 0
        self._closed = False
        try:
            for p in self._procs:
                p.start()
            self._collect(-1, start_timeout)
        except BaseException:  # Ctrl-C or SIGTERM while starting: leave nothing behind
            self.close(force=True)
            raise

    def _collect(self, task_id: int, timeout: float | None, deadline: float | None = None) -> list:
        """The workers' answers to task `task_id` (-1: their start). Bounds: `timeout` while the run reports no
        progress (the watchdog off, or before the first report), then the progress watchdog; `deadline`, if
        given, whatever the progress."""
        got: dict[int, bytes] = {}
        errors: list[WorkerError] = []
        timeout = timeout or self.timeout
        start = time.monotonic()
        watch = _Watchdog(self._steps, self._times, self.progress_timeout) if task_id >= 0 else None
        while len(got) < self.world_size:
            try:
                rank, tid, status, payload, tb = self._results.get(timeout=0.05)
                if status == "usererror":  # bad input found inside a worker: the caller's error, not a crash
                    self._fail(UserError(payload.split(": ", 1)[-1]))
                if status == "error":
                    errors.append(WorkerError(rank, payload, tb))
                elif tid == task_id:
                    got[rank] = payload
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if r not in got and p.exitcode is not None]
            if dead and not errors and task_id >= 0 and self.on_failure == "continue":
                self._announce_lost(dead)   # every dead rank is gone now: the survivors go on
            elif errors or dead:
                self._fail(self._root_cause(errors))
            now = time.monotonic()
            silent = [r for r in range(self.world_size)
                      if r not in self._gone and 0 < self._beats[r] < now - self.stall_timeout]
            if silent:
                self._fail(WorkerError(silent[0], f"stalled: no heartbeat for {now - self._beats[silent[0]]:.0f} s "
                                                  f"(the process is stopped or hung)"))
            running = [r for r in range(self.world_size) if r not in got and r not in self._gone]
            stuck = watch.check(now, running) if watch else None
            if stuck is not None:
                self._fail(stuck)
            if now > start + timeout and not (watch and watch.watching):
                missing = [r for r in range(self.world_size) if r not in got]
                self._fail(WorkerError(missing[0], f"stalled: no result within {timeout:.0f} s and no progress "
                                                   f"reported (ranks {missing} still running)"))
            if deadline is not None and now > start + deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                self._fail(DeadlineError(missing[0], f"deadline: no result within {deadline:.0f} s, the run's "
                                                     f"deadline (ranks {missing} still running)"))
            if len(got.keys() | self._gone) == self.world_size:   # (a rank lost after it answered counts once)
                break
        return [got.get(r) for r in range(self.world_size)]

    def _announce_lost(self, dead: list[int]) -> None:
        """on_failure="continue": publish the survivors as a new membership generation (once per loss)."""
        new = [r for r in dead if r not in self._gone]
        if not new:
            return
        for r in new:
            self.lost.append({"rank": r, "reason": _died(self._procs[r].exitcode),
                              "step": max(int(self._steps[r]), 0)})
        self._gone.update(new)
        members = [r for r in range(self.world_size) if r not in self._gone]
        if not members:
            self._fail(WorkerError(new[0], "every worker was lost"))
        self._generation += 1
        self._store.set(f"thinwire/members/{self._generation}", ",".join(map(str, members)))

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
            if r not in reported and p.exitcode not in (None, 0):
                return WorkerError(r, _died(p.exitcode))
        return errors[0] if errors else WorkerError(-1, "a worker exited unexpectedly")

    def _fail(self, error: Exception):
        if isinstance(error, WorkerError) and _hung(error) and not error.stacks:
            error = type(error)(error.rank, error.cause, error.traceback, self._stacks())
        self.close(force=True)
        raise error

    def _stacks_path(self, rank: int) -> str:
        return os.path.join(self._stacks_dir, f"{rank}.txt")

    def _stacks(self, wait: float = 0.5) -> str:
        """Every live worker's Python stacks, each thread's, written on `STACKS_SIGNAL` ("" where none can)."""
        live = [r for r, p in enumerate(self._procs) if p.pid is not None and p.exitcode is None]
        if STACKS_SIGNAL is None or not live:
            return ""
        for r in live:
            try:
                os.kill(self._procs[r].pid, STACKS_SIGNAL)
            except OSError:
                pass
        time.sleep(wait)
        out = []
        for r in live:
            try:
                with open(self._stacks_path(r)) as f:
                    text = f.read()
            except OSError:
                continue
            if text.strip():
                out.append(f"--- Python stacks of worker {r} when the launcher gave up ---\n{text[-6000:].rstrip()}")
        return "\n".join(out)

    def run(self, fn, *args, network="lan", seed: int = 0, timeout: float | None = None,
            deadline: float | None = None) -> list:
        """Run `fn(rank, world_size, *args)` on every worker; the list of return values by rank. `timeout`
        (default: the pool's) bounds a run that reports no progress; `deadline` (default none) any run."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        parse_network(network)  # a bad profile is the caller's error, reported before any work starts
        if timeout is not None:
            _check_timeout("timeout", timeout)
        _check_timeout("deadline", deadline, allow_none=True)
        self._task_id += 1
        blob = pickle.dumps((fn, args, network, seed))
        self._steps[:] = [-1] * self.world_size   # the last run's steps are not this run's progress
        self._times[:] = [0.0] * self.world_size
        for q in self._tasks:
            q.put((self._task_id, blob))
        out = [None if b is None else pickle.loads(b) for b in self._collect(self._task_id, timeout, deadline)]
        if self._gone:              # the survivors' group is not this pool's any more
            self.close(force=True)
        return out

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        started = [p for p in self._procs if p.pid is not None]  # Ctrl-C may come between two starts
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        for q in self._tasks + [self._results]:
            q.close()
            q.cancel_join_thread()
        # A task queue's feeder thread holds the queue's semaphores. Left running, it may drop the last
        # reference after this process began to exit; the semaphore is then unlinked by a daemon thread that is
        # stopped before it tells multiprocessing's resource tracker, which reports "leaked semaphore" (seen
        # after SIGTERM). Ended here, the semaphores are released by this thread when the pool goes.
        for q in self._tasks:
            feeder = getattr(q, "_thread", None)
            if feeder is not None:
                feeder.join(timeout=5)
        self._store = None  # closes the listening socket
        shutil.rmtree(getattr(self, "_stacks_dir", ""), ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


class _Watchdog:
    """Progress of one run, read from the workers' `report_progress` arrays at each poll of the launcher."""

    def __init__(self, steps, times, bound: float | None):
        self.steps, self.times, self.bound = steps, times, bound
        self.seen: dict[int, tuple[int, float]] = {}   # rank -> (step, when) last seen
        self.step_s: deque = deque(maxlen=4096)         # seconds per step, from successive reports

    @property
    def watching(self) -> bool:
        """Whether the run is under watch: the watchdog is on and some rank has reported a step."""
        return self.bound is not None and bool(self.seen)

    def check(self, now: float, running: list[int]) -> NoProgressError | None:
        if self.bound is None:
            return None
        for r in running:
            step = self.steps[r]
            if step < 0:
                continue
            when = self.times[r]
            old = self.seen.get(r)
            if old is None or step != old[0]:
                if old is not None and step > old[0]:
                    self.step_s.append((when - old[1]) / (step - old[0]))
                self.seen[r] = (step, when)
        watched = [r for r in running if r in self.seen]  # ranks that report steps and are not done
        if not self.seen or not running:
            return None
        # (when every rank that reports steps is done, the rest are bounded from the last step reported)
        idle = now - max(self.seen[r][1] for r in (watched or self.seen))
        if idle <= self.bound:
            return None
        limit = max(self.bound, PROGRESS_STEPS * statistics.median(self.step_s or [0.0]))
        if idle <= limit:
            return None
        quiet = [r for r in running if r not in self.seen]
        if not watched:
            who = f"rank {quiet[0]}" if len(quiet) == 1 else f"ranks {quiet}"
            return NoProgressError(quiet[0], f"{who} still running {idle:.0f} s after the last step reported (the "
                                             f"ranks that report steps have finished; {who} report none) "
                                             f"(bound {limit:.0f} s: progress_timeout, --progress-timeout)")
        return self._verdict(now, idle, watched, quiet, limit)

    def _verdict(self, now, idle, watched, quiet, limit) -> NoProgressError:
        at = {r: self.seen[r][0] for r in watched}
        low = min(at.values())
        behind = [r for r in watched if at[r] == low]
        ahead = sorted({at[r] for r in watched if at[r] != low})
        note = f"; ranks {quiet} report no steps" if quiet else ""
        bound = f" (bound {limit:.0f} s: progress_timeout, --progress-timeout)"
        if ahead:
            others = f"step {ahead[0]}" if len(ahead) == 1 else f"steps {ahead[0]}-{ahead[-1]}"
            who = f"rank {behind[0]}" if len(behind) == 1 else f"ranks {behind}"
            since = now - max(self.seen[r][1] for r in behind)
            return NoProgressError(behind[0], f"{who} made no progress for {since:.0f} s (stuck at step {low}; "
                                              f"others at {others}{note}){bound}")
        if len(watched) == 1 and not quiet:  # the only rank still running
            r = watched[0]
            return NoProgressError(r, f"rank {r} made no progress for {idle:.0f} s (stuck at step {low}){bound}")
        return NoProgressError(-1, f"no rank made progress for {idle:.0f} s (ranks {watched} all at step {low}{note}): "
                                   f"a collective is stuck or every worker is blocked{bound}")


LAUNCH_TIMEOUT = 3600.0     # launch(): gloo's operation timeout, and the bound of a run that reports no progress


def launch(fn, world_size: int, network="lan", backend: str | None = None, args: tuple = (),
           timeout: float | None = None, seed: int = 0, host: str = "127.0.0.1", port: int = 0,
           progress_timeout: float | None = PROGRESS_TIMEOUT, worker_init=None, on_failure: str = "stop",
           device: str | None = None, deadline: float | None = None) -> list:
    """Start `world_size` workers on `host`, run `fn(rank, world_size, *args)` in each under the emulated
    `network`, and return their return values by rank. Raises `WorkerError` if any worker fails (with
    `on_failure="continue"`, a lost worker's value is None and the others go on; see `Pool`). A run that
    reports progress (`report_progress`; `Trainer.step` does) is bounded by the progress watchdog and may last
    as long as it progresses; one that reports none, by `timeout` (default 3600 s, also gloo's operation
    timeout). `deadline` (seconds; default none) ends the run whatever its progress. See `Pool` for
    `progress_timeout` and `worker_init`.
    `device="cuda"` starts one worker per GPU on NCCL (worker r on cuda:r, its current device), or, with more
    workers than GPUs, workers sharing the GPUs over gloo (`pick_backend`); the default is the CPU on gloo.
    `backend` may be left out: it follows from the device."""
    parse_network(network)
    _check_timeout("deadline", deadline, allow_none=True)
    with Pool(world_size, backend=backend, host=host, port=port, timeout=timeout or LAUNCH_TIMEOUT,
              progress_timeout=progress_timeout, worker_init=worker_init, on_failure=on_failure,
              device=device) as pool:
        return pool.run(fn, *args, network=network, seed=seed, timeout=timeout, deadline=deadline)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                  and "MASTER_ADDR" in os.environ)


def init(network="lan", backend: str | None = None, seed: int = 0, timeout: float = 1800.0,
         device: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed inside a process started by torchrun; returns (rank, world_size).
    `device="cuda"`: this process's GPU is cuda:LOCAL_RANK (made the current device) on NCCL, or, with more
    processes on this machine than GPUs, GPU LOCAL_RANK mod count, shared over gloo (`pick_backend`)."""
    import torch
    import torch.distributed as dist
    if not under_torchrun():
        raise UserError("thinwire.init() expects torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR); "
                        "on one machine use thinwire.launch instead")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, device = pick_backend(backend, device, local)
    set_default_network(network, seed)
    if device == "cuda":
        torch.cuda.set_device(gpu_of(int(os.environ.get("LOCAL_RANK", "0"))))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or _threads_per_worker(local)))
    return dist.get_rank(), dist.get_world_size()
