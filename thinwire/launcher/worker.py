"""What the launchers (`pool.Pool`, `elastic.ElasticPool`: `Launcher`) and their worker processes share.

The launcher hosts the rendezvous store (`serve_store`: listening on `host` and on nothing wider, `listen`) and
starts its workers with `process`: forked from multiprocessing's fork server (`ctx`), in the launcher's environment,
each ending when the launcher ends (`die_with`). Each worker begins with `start`: it dies with its parent
(`die_with_parent`), writes every thread's Python stacks on `STACKS_SIGNAL` into a file the launcher handed it
(`Inherit`), runs the caller's `worker_init`, pins gloo's sockets to the interface through which it reaches the
launcher's host (`pin_gloo`, `interface_to`: the loopback for a loopback host), beats every 0.5 s into the
launcher's `beats` array (`heartbeat`), reports its steps into the launcher's `steps` and `times` arrays
(`thinwire.comm.progress`) and takes its share of the CPU threads (`threads_per_worker`). Each worker has a slot in
those arrays (a rank, or an elastic worker's process slot). A worker that fails reports the exception being handled
on the results queue and exits (`fail_and_exit`); the report is never lost.

The launcher names a process that died (`died`), tells an error that only says a peer went away
(`peer_failure`) from a worker's own, watches the steps (`Watchdog`, whose verdict is a `NoProgressError`) and
ends its processes and queues without leaving anything behind (`stop`).
"""
from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import ipaddress
import math
import multiprocessing as mp
import os
import select
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist

from ..comm import progress
from ..errors import UserError, WorkerError
from ..net import parse_network

# Workers are forked from a server process that imported torch and the launchers once, a fresh interpreter's 2-3 s
# of CPU that every spawned worker paid again (tools/launch_startup.py); nothing else of the launcher's is
# inherited, as with spawn, and each worker takes its launcher's environment as it is when the process is made.
if "forkserver" in mp.get_all_start_methods():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["thinwire.launcher.pool", "thinwire.launcher.elastic"])
else:                                                   # (Windows) every worker a fresh interpreter
    ctx = mp.get_context("spawn")


def process(target, name: str, args: tuple):
    """A worker process (daemonic, not started) running `target(*args)` in this process's environment, ending
    when this process ends."""
    return ctx.Process(target=_in_environment, name=name, daemon=True,
                       args=(dict(os.environ), os.getpid(), target, args))


def _in_environment(env: dict, launcher: int, target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    die_with(launcher)
    target(*args)


def die_with(pid: int) -> None:
    """End this process (SIGKILL) when process `pid` ends, even by SIGKILL: a thread waits on its pidfd. The
    parent-death signal (`die_with_parent`) would watch the fork server, which the workers it forked keep alive,
    and only the thread that started it. Without pidfds (Linux < 5.3, other systems) nothing is watched."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return

    def watch():
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="thinwire-launcher-watch", daemon=True).start()


PROGRESS_TIMEOUT = 300.0    # the progress watchdog's bound (s) by default, ...
PROGRESS_STEPS = 50         # ... raised to this many median step times when steps are slow
STACKS_SIGNAL = getattr(signal, "SIGUSR2", None)   # a worker writes its threads' Python stacks on it


class NoProgressError(WorkerError):
    """The progress watchdog's verdict. Its message is the whole story; `rank` is the rank the others wait
    for, or -1 when every rank is stuck at the same step (a stuck collective: no single rank to blame)."""

    def __init__(self, rank: int, cause: str, traceback: str = "", stacks: str = ""):
        super().__init__(rank, cause, stacks=stacks)
        self.args = (cause,)


def check_timeout(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UserError(f"{name} must be a finite number of seconds > 0{' (or None: off)' if allow_none else ''}, "
                        f"got {value!r}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_to(host: str) -> str | None:
    """The name of this machine's network interface whose (IPv4) address it reaches `host` from: the kernel's
    choice of route and source address, so for one of this machine's own addresses, the interface holding it. None
    where that cannot be told: a name that does not resolve, an unspecified address (0.0.0.0), no route, a
    source address that no interface holds as its first, a system other than Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0]
        if ipaddress.ip_address(addr[0]).is_unspecified:
            return None
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)     # UDP: nothing is sent; the kernel picks the route and the source address
            source = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue    # an interface without an IPv4 address
                if socket.inet_ntoa(got[20:24]) == source:
                    return name
    except (OSError, ValueError, IndexError):
        pass
    return None


def pin_gloo(host: str) -> None:
    """gloo's sockets on the interface through which this process reaches `host` (the launcher's store, torchrun's
    MASTER_ADDR, the elastic job a worker joins by hand): the loopback for a loopback host, else `interface_to`.
    Left to gloo where `GLOO_SOCKET_IFNAME` is set or no interface can be told; gloo then listens on the address
    the host name resolves to, which on many machines is a loopback address (Debian's 127.0.1.1) that no other
    machine reaches."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = "lo" if is_loopback(host) and os.path.exists("/sys/class/net/lo") else interface_to(host)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def listen(host: str, port: int) -> tuple[int, int]:
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
        why = {errno.EADDRINUSE: "the port is in use",
               errno.EADDRNOTAVAIL: "no interface of this machine has that address"}.get(e.errno, str(e))
        raise UserError(f"cannot listen on {host}:{port}: {why}") from None
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def serve_store(host: str, port: int, timeout: float):
    """(the launcher) The rendezvous store, listening on `host` only; `port` 0: a free one (`store.port`).
    The launcher binds the socket itself: no free-port race."""
    fd, port = listen(host, port)
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                             master_listen_fd=fd)
    except (RuntimeError, OSError) as e:
        os.close(fd)  # the store did not take it over
        raise UserError(f"cannot listen on {host}:{port}: {e}") from None


def die_with_parent() -> None:
    """Ask the kernel to kill this worker when the launcher dies (Linux); no stray processes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def threads_per_worker(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


class Inherit:
    """One of the launcher's file descriptors, inherited by a worker it spawns (passed as multiprocessing passes a
    pipe's): put it in the process's arguments, the worker receives the descriptor's number there. A file the
    launcher made and unlinked at once is thus shared with its worker and outlives neither."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup) -> int:
    return dup.detach()


def fail_and_exit(results, head: tuple, kind: str, cause: str) -> None:
    """Report a failure, with the exception being handled, to the launcher and exit; the queue is flushed first
    so the report is never lost. `head`: the fields the launcher's results start with ((rank, task) for a
    `Pool`; (slot, task, member) for an `ElasticPool`)."""
    results.put((*head, kind, cause, traceback.format_exc()))
    results.close()
    results.join_thread()
    sys.stderr.flush()
    os._exit(1)


def heartbeat(beats, slot: int, every: float = 0.5) -> None:
    """(daemon thread) show the launcher this process is alive; a stopped or hung process stops beating."""
    while True:
        beats[slot] = time.monotonic()
        time.sleep(every)


def start(slot: int, head: tuple, host: str, results, beats, steps, times, threads: int, worker_init=None,
          init_args: tuple = (), stacks: int | None = None) -> None:
    """(a worker, first thing) The steps the module doc lists, in that order. `worker_init(*init_args)` runs on the
    main thread (e.g. to enter a network namespace); its failure is reported under `head` and ends the process."""
    die_with_parent()
    if stacks is not None and STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    try:
        if worker_init is not None:
            worker_init(*init_args)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which stops everyone
        fail_and_exit(results, head, "error", f"cannot start: worker_init failed: {type(e).__name__}: {e}")
    pin_gloo(host)
    threading.Thread(target=heartbeat, args=(beats, slot), daemon=True).start()
    progress.install(steps, times, slot)
    torch.set_num_threads(threads)


def died(code: int) -> str:
    """Why a worker process is gone, from its exit code (negative: the signal that killed it)."""
    why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"worker process died ({why})"


def peer_failure(message: str) -> bool:
    """An error that only says another worker went away."""
    text = message.lower()
    return any(k in text for k in ("connection closed by peer", "connection reset", "remote worker crash",
                                   "broken pipe", "connection refused", "socket closed"))


def stop(workers, results, force: bool = False) -> None:
    """(the launcher) End its worker processes and close their queues; `workers`: (process or None, task queue)
    pairs. Unless `force`, each is asked to finish (None on its task queue) and given 10 s; then terminated,
    then killed."""
    live = [(p, q) for p, q in workers if p is not None and p.pid is not None]  # Ctrl-C may come between starts
    if not force:
        for _, q in live:
            q.put(None)
        for p, _ in live:
            p.join(timeout=10)
    for p, _ in live:
        if p.is_alive():
            p.terminate()
    for p, _ in live:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join()
    queues = [q for _, q in workers]
    for q in queues + [results]:
        q.close()
        q.cancel_join_thread()
    # A task queue's feeder thread holds the queue's semaphores. Left running, it may drop the last
    # reference after this process began to exit; the semaphore is then unlinked by a daemon thread that is
    # stopped before it tells multiprocessing's resource tracker, which reports "leaked semaphore" (seen
    # after SIGTERM). Ended here, the semaphores are released by this thread when the pool goes.
    for q in queues:
        feeder = getattr(q, "_thread", None)
        if feeder is not None:
            feeder.join(timeout=5)


class Launcher:
    """(base of `Pool`, `ElasticPool`) Their bounds, checked before any process starts, the rendezvous store, the
    results queue and the end (`close`, forced when an exception leaves a `with` block); `_workers()`: (process or
    None, task queue) of each worker process."""

    def __init__(self, host: str, port: int, timeout: float, start_timeout: float, stall_timeout: float,
                 progress_timeout: float | None):
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout), ("stall_timeout", stall_timeout)):
            check_timeout(name, value)
        check_timeout("progress_timeout", progress_timeout, allow_none=True)
        self.timeout, self.start_timeout = timeout, start_timeout
        self.stall_timeout, self.progress_timeout = stall_timeout, progress_timeout
        self._store = serve_store(host, port, timeout)
        self.port = self._store.port
        self._results = ctx.Queue()
        self._task_id = -1
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _next_task(self, network) -> int:
        """A run's task id; a closed launcher or a bad network profile (the caller's error) is refused first."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        parse_network(network)
        self._task_id += 1
        return self._task_id

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        stop(self._workers(), self._results, force)
        self._store = None  # closes the listening socket

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


class Watchdog:
    """Progress of one run, read from the workers' `report_progress` arrays at each poll of the launcher. The
    workers are named by rank (`noun`: what a name is), each reporting into its slot (by default, its rank)."""

    def __init__(self, steps, times, bound: float | None, noun: str = "rank"):
        self.steps, self.times, self.bound, self.noun = steps, times, bound, noun
        self.seen: dict[int, tuple] = {}   # rank -> (step, when it was reported, its latest activity) last seen
        self.step_s: deque = deque(maxlen=4096)         # seconds per step, from successive reports

    @property
    def watching(self) -> bool:
        """Whether the run is under watch: the watchdog is on and some rank has reported a step."""
        return self.bound is not None and bool(self.seen)

    def check(self, now: float, running: list[int], slot_of: dict[int, int] | None = None) -> NoProgressError | None:
        """The verdict on the ranks still `running` (each reporting into `slot_of[rank]`), or None."""
        if self.bound is None:
            return None
        for r in running:
            i = r if slot_of is None else slot_of[r]
            step = self.steps[i]
            if step < 0:
                continue
            when = self.times[i]
            old = self.seen.get(r)
            if old is None or step != old[0]:
                if old is not None and step > old[0]:
                    self.step_s.append((when - old[1]) / (step - old[0]))
                self.seen[r] = (step, when, when)
            elif when > old[2]:     # the same step, a fresh time: a transfer still moving (`progress.moving`)
                self.seen[r] = (step, old[1], when)
        watched = [r for r in running if r in self.seen]  # ranks that report steps and are not done
        if not self.seen or not running:
            return None
        # (when every rank that reports steps is done, the rest are bounded from the last step reported)
        idle = now - max(self.seen[r][2] for r in (watched or self.seen))
        if idle <= self.bound:
            return None
        limit = max(self.bound, PROGRESS_STEPS * statistics.median(self.step_s or [0.0]))
        if idle <= limit:
            return None
        quiet = [r for r in running if r not in self.seen]
        if not watched:
            who = f"{self.noun} {quiet[0]}" if len(quiet) == 1 else f"{self.noun}s {quiet}"
            return NoProgressError(quiet[0], f"{who} still running {idle:.0f} s after the last step reported (the "
                                             f"{self.noun}s that report steps have finished; {who} report none) "
                                             f"(bound {limit:.0f} s: progress_timeout, --progress-timeout)")
        return self._verdict(now, idle, watched, quiet, limit)

    def _verdict(self, now, idle, watched, quiet, limit) -> NoProgressError:
        at = {r: self.seen[r][0] for r in watched}
        low = min(at.values())
        behind = [r for r in watched if at[r] == low]
        ahead = sorted({at[r] for r in watched if at[r] != low})
        noun = self.noun
        note = f"; {noun}s {quiet} report no steps" if quiet else ""
        bound = f" (bound {limit:.0f} s: progress_timeout, --progress-timeout)"
        if ahead:
            others = f"step {ahead[0]}" if len(ahead) == 1 else f"steps {ahead[0]}-{ahead[-1]}"
            who = f"{noun} {behind[0]}" if len(behind) == 1 else f"{noun}s {behind}"
            since = now - max(self.seen[r][2] for r in behind)
            return NoProgressError(behind[0], f"{who} made no progress for {since:.0f} s (stuck at step {low}; "
                                              f"others at {others}{note}){bound}")
        if len(watched) == 1 and not quiet:  # the only rank still running
            r = watched[0]
            return NoProgressError(r, f"{noun} {r} made no progress for {idle:.0f} s (stuck at step {low}){bound}")
        return NoProgressError(-1, f"no {noun} made progress for {idle:.0f} s ({noun}s {watched} all at step "
                                   f"{low}{note}): a collective is stuck or every worker is blocked{bound}")
