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

The rendezvous store listens on `host` only (`worker.listen`), and the workers' gloo sockets are pinned to the
interface through which they reach `host` (`worker.pin_gloo`: the loopback for a loopback `host`; under torchrun,
`init` does the same for MASTER_ADDR). Nothing here authenticates: keep these ports off untrusted networks
(docs/multi-host.md).
"""
from __future__ import annotations

import os
import pickle
import queue
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import speeds as speed_profiles
from ..comm import set_default_network
from ..comm.context import set_store
from ..comm import progress
from ..comm.membership import MEMBERSHIP
from ..errors import UserError, WorkerError
from ..net import parse_network
from .worker import (PROGRESS_TIMEOUT, STACKS_SIGNAL, Inherit, Launcher, NoProgressError, Watchdog, check_timeout, ctx,
                     died, fail_and_exit, peer_failure, pin_gloo, process, start, threads_per_worker)

MAX_LOCAL_WORKERS = 512     # processes on one machine: each holds an interpreter, torch and a copy of the model


def report_progress(step: int | None = None) -> None:
    """Tell the launcher's progress watchdog that this rank has reached training step `step`, for a loop that
    drives no `Trainer` (`Trainer.step` reports itself). Call it once per step, best after the step's local
    computation and before its communication waits: a rank that stopped computing is then told apart from the
    ranks waiting for it. A no-op outside a worker of `tw.launch` or a `Pool` (thinwire/comm/progress.py).

    Args:
        step: the step reached (default: one more than this rank's last report).
    """
    progress.report(step)


class DeadlineError(WorkerError):
    """The run outlived the deadline it was given (`deadline=`, `--deadline`), progress or not."""


def check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UserError(f"world size must be an integer >= 1, got {world_size!r}")
    if world_size > MAX_LOCAL_WORKERS:
        raise UserError(f"world size must be at most {MAX_LOCAL_WORKERS} on one machine, got {world_size} "
                        f"(each worker is a process with its own interpreter, torch runtime and copy of the "
                        f"model); across machines run under torchrun")


def _watch_membership(host: str, port: int, world_size: int) -> None:
    """(daemon thread, on_failure="continue") hand the launcher's announcements of lost workers to
    `thinwire.comm.membership`: generation g's surviving ranks are published under `thinwire/members/g`."""
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
    return local_rank % torch.cuda.device_count()


def _worker_main(rank, world_size, backend, host, port, timeout_s, tasks, results, beats, steps, times,
                 worker_init, on_failure="stop", device="cpu", stacks=None):
    start(rank, (rank, -1), host, results, beats, steps, times, threads_per_worker(world_size), worker_init,
          (rank, world_size), stacks)
    if backend == "nccl":  # one process per GPU: this worker's rank is its local rank
        os.environ["LOCAL_RANK"] = str(rank)
    if device == "cuda":   # its GPU (shared with other workers under gloo) is its current device
        torch.cuda.set_device(gpu_of(rank))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        set_store(store)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops everyone
        fail_and_exit(results, (rank, -1), "error", f"cannot start: {e}")
    if on_failure == "continue":
        MEMBERSHIP.watch(world_size)
        threading.Thread(target=_watch_membership, args=(host, port, world_size), daemon=True).start()
    results.put((rank, -1, "ok", b"", ""))
    for task_id, blob in iter(tasks.get, None):  # until close() sends None
        try:
            fn, args, network, seed, speeds = pickle.loads(blob)
            set_default_network(network, seed)
            speed_profiles.set_process(speeds, rank, world_size, seed)
            out = pickle.dumps(fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001
            kind = "usererror" if isinstance(e, UserError) else "error"
            fail_and_exit(results, (rank, task_id), kind, f"{type(e).__name__}: {e}")
        results.put((rank, task_id, "ok", out, ""))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


class Pool(Launcher):
    """`world_size` workers with an initialised process group, running functions on request.

    `worker_init(rank, world_size)`, if given (picklable: a module-level function or a `functools.partial` of
    one), runs first in each worker, before the process group is initialised: e.g. to enter a network
    namespace. `progress_timeout` (None: off) bounds the time without progress (see `report_progress`).

    `on_failure="continue"`: a worker process that dies does not stop the others. The launcher announces the
    survivors (a new membership generation in its store); a `Trainer(on_failure="continue")` in each survivor
    forms a new group at its next synchronization point and goes on. `run` returns None for a lost rank and
    `lost` names it. The pool's group has changed: it is closed after that run.

    Args:
        world_size: the number of worker processes (each one rank of the process group).
        backend: "gloo" or "nccl" (default: follows from `device`).
        host: the address the rendezvous store listens on and the workers' gloo sockets reach it by.
        port: the store's port (0: a free one).
        timeout: bounds a run that reports no progress, and gloo's operations (seconds).
        start_timeout: bounds the workers' start-up and rendezvous (seconds).
        stall_timeout: a worker process whose heartbeat is silent this long is named (seconds).
        progress_timeout: a run whose ranks make no progress this long is stopped, naming the rank the others
            wait for (seconds; None: off; raised to 50 median step times when steps are slow).
        worker_init: `worker_init(rank, world_size)`, run first in each worker (picklable).
        on_failure: "stop" (a lost worker stops every worker) or "continue" (the others go on).
        device: None or "cpu" (gloo on the CPU), or "cuda" (one worker per GPU on NCCL; more workers than GPUs
            share them over gloo).
    """

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
        if worker_init is not None and not callable(worker_init):
            raise UserError(f"worker_init must be callable, got {type(worker_init).__name__}")
        super().__init__(host, port, timeout, start_timeout, stall_timeout, progress_timeout)
        self.world_size = world_size
        self._beats = ctx.Array("d", world_size, lock=False)   # last heartbeat of each worker (monotonic)
        self._steps = ctx.Array("q", world_size, lock=False)   # last step reported (-1: none in this run)
        self._times = ctx.Array("d", world_size, lock=False)   # when it was reported (monotonic)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # where each worker writes its stacks: unlinked at once, shared with the worker, outliving neither
        self._stack_files = [tempfile.TemporaryFile() for _ in range(world_size)]
        self._procs = [process(_worker_main, f"thinwire-worker-{r}",
                               (r, world_size, self.backend, host, self.port, timeout, self._tasks[r], self._results,
                                self._beats, self._steps, self._times, worker_init, on_failure, self.device,
                                Inherit(self._stack_files[r].fileno())))
                       for r in range(world_size)]
        self._gone: set[int] = set()
        self._generation = 0
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
        watch = Watchdog(self._steps, self._times, self.progress_timeout) if task_id >= 0 else None
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
            self.lost.append({"rank": r, "reason": died(self._procs[r].exitcode),
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
        primary = [e for e in errors if not peer_failure(e.cause)]
        if primary:
            return primary[0]
        reported = {e.rank for e in errors}
        for r, p in enumerate(self._procs):
            if r not in reported and p.exitcode not in (None, 0):
                return WorkerError(r, died(p.exitcode))
        return errors[0] if errors else WorkerError(-1, "a worker exited unexpectedly")

    def _fail(self, error: Exception):
        """Close and raise `error`; a hang (a stall, no progress, no result) or only a peer's going away carries
        every live worker's stacks: where each was is then the story."""
        if isinstance(error, WorkerError) and not error.stacks and (isinstance(error, NoProgressError) or
                                                                   error.cause.startswith("stalled") or
                                                                   peer_failure(error.cause)):
            error = type(error)(error.rank, error.cause, error.traceback, self._stacks())
        self.close(force=True)
        raise error

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
            fd = self._stack_files[r].fileno()
            text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
            if text.strip():
                out.append(f"--- Python stacks of worker {r} when the launcher gave up ---\n{text[-6000:].rstrip()}")
        return "\n".join(out)

    def run(self, fn, *args, network="lan", seed: int = 0, timeout: float | None = None,
            deadline: float | None = None, speeds=None) -> list:
        """Run `fn(rank, world_size, *args)` on every worker; the list of return values by rank.

        Args:
            fn: a picklable function (module level) of `(rank, world_size, *args)`.
            *args: more arguments of `fn`, the same for every worker (picklable).
            network: the network every worker emulates (a profile name, "custom:...", or a `Link`).
            seed: the seed of the emulated network's randomness (jitter, loss).
            timeout: bounds a run that reports no progress (seconds; default: the pool's).
            deadline: ends the run at this wall time whatever its progress (seconds; default none).
            speeds: a `thinwire.speeds` profile or spec ("1,1,1,0.5", "stragglers"): slows the models a
                Trainer builds in the workers.
        """
        speeds = speed_profiles.parse(speeds)
        if speeds is not None:
            speeds.check_workers(self.world_size)
        task_id = self._next_task(network)
        if timeout is not None:
            check_timeout("timeout", timeout)
        check_timeout("deadline", deadline, allow_none=True)
        blob = pickle.dumps((fn, args, network, seed, speeds))
        self._steps[:] = [-1] * self.world_size   # the last run's steps are not this run's progress
        self._times[:] = [0.0] * self.world_size
        for q in self._tasks:
            q.put((task_id, blob))
        out = [None if b is None else pickle.loads(b) for b in self._collect(task_id, timeout, deadline)]
        if self._gone:              # the survivors' group is not this pool's any more
            self.close(force=True)
        return out

    def _workers(self) -> list:
        return list(zip(self._procs, self._tasks))

    def close(self, force: bool = False) -> None:
        """Stop the workers (leaving a `with` block does it).

        Args:
            force: terminate them at once instead of asking each to finish (10 s) first.
        """
        super().close(force)
        for f in self._stack_files:
            f.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, by rank."""
        return [p.pid for p in self._procs]


LAUNCH_TIMEOUT = 3600.0     # launch(): gloo's operation timeout, and the bound of a run that reports no progress


def launch(fn, world_size: int, network="lan", backend: str | None = None, args: tuple = (),
           timeout: float | None = None, seed: int = 0, host: str = "127.0.0.1", port: int = 0,
           progress_timeout: float | None = PROGRESS_TIMEOUT, worker_init=None, on_failure: str = "stop",
           device: str | None = None, deadline: float | None = None, speeds=None) -> list:
    """Start `world_size` workers on `host`, run `fn(rank, world_size, *args)` in each under the emulated
    `network` (and, with `speeds`, each worker's model at its emulated speed), and return their return values by
    rank. Raises `WorkerError` if any worker fails (with `on_failure="continue"`, a lost worker's value is None
    and the others go on; see `Pool`). A run that reports progress (`report_progress`; `Trainer.step` does) is
    bounded by the progress watchdog and may last as long as it progresses; one that reports none, by `timeout`.
    `device="cuda"` starts one worker per GPU on NCCL (worker r on cuda:r, its current device), or, with more
    workers than GPUs, workers sharing the GPUs over gloo (`pick_backend`); the default is the CPU on gloo.

    Args:
        fn: a picklable function (module level) of `(rank, world_size, *args)`, run in every worker.
        world_size: the number of workers.
        network: the network every worker emulates: a profile name ("lan", "wan", "world", ...),
            "custom:bandwidth=200mbit,latency=25ms", "islands:...", or a `Link`.
        backend: "gloo" or "nccl" (default: follows from `device`).
        args: more arguments of `fn`, the same for every worker (picklable).
        timeout: bounds a run that reports no progress, and gloo's operations (seconds; default 3600).
        seed: the seed of the emulated network's randomness (jitter, loss).
        host: the address the rendezvous listens on.
        port: the rendezvous port (0: a free one).
        progress_timeout: a run whose ranks make no progress this long is stopped (seconds; None: off).
        worker_init: `worker_init(rank, world_size)`, run first in each worker (see `Pool`).
        on_failure: "stop" (a failed worker stops every worker: `WorkerError`) or "continue".
        device: None or "cpu", or "cuda" (one worker per GPU on NCCL, else shared over gloo).
        deadline: ends the run at this wall time whatever its progress (seconds; default none).
        speeds: each worker's emulated compute speed, a `thinwire.speeds` spec ("1,1,1,0.5", "stragglers").

    Returns:
        `fn`'s return values, by rank.
    """
    parse_network(network)
    check_timeout("deadline", deadline, allow_none=True)
    profile = speed_profiles.parse(speeds)
    if profile is not None:
        profile.check_workers(world_size)
    with Pool(world_size, backend=backend, host=host, port=port, timeout=timeout or LAUNCH_TIMEOUT,
              progress_timeout=progress_timeout, worker_init=worker_init, on_failure=on_failure,
              device=device) as pool:
        return pool.run(fn, *args, network=network, seed=seed, timeout=timeout, deadline=deadline, speeds=profile)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                  and "MASTER_ADDR" in os.environ)


def init(network="lan", backend: str | None = None, seed: int = 0, timeout: float = 1800.0,
         device: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed inside a process started by torchrun; returns (rank, world_size).
    `device="cuda"`: this process's GPU is cuda:LOCAL_RANK (made the current device) on NCCL, or, with more
    processes on this machine than GPUs, GPU LOCAL_RANK mod count, shared over gloo (`pick_backend`).
    gloo's sockets go on the interface through which this machine reaches MASTER_ADDR, unless
    `GLOO_SOCKET_IFNAME` names one (`pin_gloo`): across machines, the address the others reach.

    Args:
        network: the network this process emulates (a profile name, "custom:...", or a `Link`); "lan" (the
            default) emulates nothing: across machines, the real link as it is.
        backend: "gloo" or "nccl" (default: follows from `device`).
        seed: the seed of the emulated network's randomness (jitter, loss).
        timeout: gloo's (or NCCL's) operation timeout, seconds.
        device: None or "cpu", or "cuda" (this process's GPU: LOCAL_RANK's).

    Returns:
        `(rank, world_size)` of this process.
    """
    if not under_torchrun():
        raise UserError("thinwire.init() expects torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR); "
                        "on one machine use thinwire.launch instead")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, device = pick_backend(backend, device, local)
    set_default_network(network, seed)
    if device == "cuda":
        torch.cuda.set_device(gpu_of(int(os.environ.get("LOCAL_RANK", "0"))))
    if not dist.is_initialized():
        if os.environ.get("MASTER_ADDR"):
            pin_gloo(os.environ["MASTER_ADDR"])
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or threads_per_worker(local)))
    return dist.get_rank(), dist.get_world_size()
