"""The elastic launcher: worker processes on one machine whose membership changes while they train.

`ElasticPool(workers, max_workers=...)` starts `workers` processes and runs `fn(member, workers, *args)` in each
(`member`: the worker's member id, 0..workers-1 for the first ones; a worker's rank in the current generation is
`trainer.transport.rank`). A worker that dies does not stop the job: the launcher announces a *loss generation*
in its store and the survivors go on (thinwire.comm.elastic). Newcomers join at the algorithm's next
synchronization boundary and take a live peer's state:
- `replace=True` starts a replacement for each lost worker (`replace_delay` seconds later; a fresh process);
- `run(..., joins=[...])` starts extra workers during the run: `("time", s)` s seconds after it began,
  `("step", k)` once a member reported step k (tests);
- `thinwire train --join HOST:PORT` joins by hand from another process, on this machine or another (the store
  address is printed; the store listens on `host`, 127.0.0.1 unless given, and on nothing wider).
Up to `max_workers` members at a time (rank 0 refuses the rest); the job fails when fewer than `min_workers`
remain and no replacement is coming (`replace=False`), or when none remains. The design: docs/reliability.md, "Workers that join a running job".

Watches: exit codes (a death is a loss, survived), heartbeats (a stalled worker is killed and taken for lost),
progress (no member advancing for the bound fails the job, as in `Pool`) and the deadline. A worker that raises
fails the job, unless its error says only that a peer went away (then it is taken for lost); a newcomer refused
(another configuration, the job full) is recorded in `refused`, not a failure.
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..comm import set_default_network
from ..comm import elastic
from ..comm.membership import MEMBERSHIP
from ..errors import UserError, WorkerError
from .pool import check_world_size
from .worker import (PROGRESS_TIMEOUT, Launcher, Watchdog, ctx, died, fail_and_exit, peer_failure, pin_gloo, process,
                     start, threads_per_worker)

FOREIGN_SILENCE_S = 3.0      # a member joined by hand (no child of this launcher) is lost after this much silence
JOIN_REACH_S = 30.0          # `--join HOST:PORT`: the bound on reaching the job's store, ...
STORE_ANSWER_S = 5.0         # ... of which the store's handshake takes about twice this, once the address answers


def _beat_store(store, me: int, every: float = 0.25) -> None:
    """(thread, a member joined by hand) tell the launcher through its store that this process is alive."""
    while True:
        try:
            store.set(f"alive/{me}", repr(time.time()))
        except Exception:   # noqa: BLE001 - the store is gone: the job is over
            return
        time.sleep(every)


def _run_member(store_client, prefix: str, task, member: int, joining: bool, max_members, timeout: float):
    """Run one task's function as member `member` of the elastic job under `prefix`; (status, payload)."""
    fn, args, network, seed, workers = task
    set_default_network(network, seed)
    MEMBERSHIP.reset()
    me = elastic.Member(dist.PrefixStore(prefix, store_client), member, joining, timeout, max_members)
    elastic.set_member(me)
    try:
        return "ok", fn(member, workers, *args)
    except elastic.JoinRefused as e:
        return "refused", str(e)
    except elastic.Dropped as e:
        return "dropped", str(e)
    finally:
        elastic.set_member(None)
        me.retire_old()
        box = [me.group]
        me.group = None
        elastic.retire(box)


def _elastic_main(slot, host, port, timeout_s, tasks, results, beats, steps, times, worker_init, threads):
    """A worker process of an ElasticPool: runs tasks (one training each) as the member the launcher names."""
    start(slot, (slot, -1, -1), host, results, beats, steps, times, threads, worker_init, (slot, -1))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except BaseException as e:  # noqa: BLE001
        fail_and_exit(results, (slot, -1, -1), "error", f"cannot start: {e}")
    results.put((slot, -1, -1, "ok", b"", ""))
    for task_id, blob, member, joining, prefix, max_members in iter(tasks.get, None):
        try:
            status, value = _run_member(store, prefix, pickle.loads(blob), member, joining, max_members, timeout_s)
            out = pickle.dumps(value) if status == "ok" else value
        except BaseException as e:  # noqa: BLE001
            kind = "usererror" if isinstance(e, UserError) else "error"
            fail_and_exit(results, (slot, task_id, member), kind, f"{type(e).__name__}: {e}")
        results.put((slot, task_id, member, status, out, ""))
    os._exit(0)


class ElasticPool(Launcher):
    """Elastic workers on one machine (see the module doc). `spares` processes are started ahead and wait, so
    that a join in a test does not pay a process start; replacements (`replace=True`) are fresh processes."""

    def __init__(self, workers: int, max_workers: int | None = None, min_workers: int = 1, spares: int = 0,
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0, start_timeout: float = 120.0,
                 stall_timeout: float = 60.0, progress_timeout: float | None = PROGRESS_TIMEOUT,
                 replace: bool = False, replace_delay: float = 0.0, worker_init=None, threads: int | None = None):
        check_world_size(workers)
        max_workers = workers if max_workers is None else max_workers
        check_world_size(max_workers)
        if not 1 <= min_workers <= workers <= max_workers:
            raise UserError(f"elastic workers need 1 <= min <= workers <= max, got min {min_workers}, workers "
                            f"{workers}, max {max_workers}")
        if not (isinstance(replace_delay, (int, float)) and 0 <= replace_delay < 3600):
            raise UserError(f"replace_delay must be in [0, 3600) seconds, got {replace_delay!r}")
        super().__init__(host, port, timeout, start_timeout, stall_timeout, progress_timeout)
        self.workers, self.max_workers, self.min_workers = workers, max_workers, min_workers
        self.replace, self.replace_delay, self.worker_init = replace, float(replace_delay), worker_init
        # sized for the most workers the job may have: the same in every run of a job, whatever its members
        # (a checkpoint taken with 1 member resumes bitwise in a pool started with 1)
        self.threads = threads or threads_per_worker(max_workers)
        self.spares, self.host = spares, host
        self._slots: list[dict] = []       # {"proc", "tasks", "member", "busy"}
        self._cap = max_workers + spares + 64    # slots are reused; a replacement takes a dead worker's slot
        self._beats, self._steps, self._times = (ctx.Array(t, self._cap, lock=False) for t in "dqd")   # by slot
        self.lost: list[dict] = []         # {"member", "reason", "t"} of the last run
        self.joined: list[dict] = []       # {"member", "t"} newcomers started in the last run
        self.refused: dict[int, str] = {}  # member -> the one-line refusal
        self.generations: list[dict] = []  # the last run's generations, from the store
        try:
            for _ in range(workers + spares):
                self._spawn()
            self._await_ready(start_timeout)
        except BaseException:
            self.close(force=True)
            raise

    # -- processes ---------------------------------------------------------------------------------------
    def _spawn(self, slot: int | None = None) -> int:
        if slot is None:
            free = [i for i, s in enumerate(self._slots) if s["proc"] is None]
            slot = free[0] if free else len(self._slots)
            if slot >= self._cap:
                raise WorkerError(-1, f"more than {self._cap} worker processes")
        tasks = ctx.Queue()
        self._beats[slot], self._steps[slot], self._times[slot] = 0.0, -1, 0.0
        proc = process(_elastic_main, f"thinwire-elastic-{slot}",
                       (slot, self.host, self.port, self.timeout, tasks, self._results, self._beats, self._steps,
                        self._times, self.worker_init, self.threads))
        entry = {"proc": proc, "tasks": tasks, "member": None, "ready": False, "started": time.monotonic()}
        if slot == len(self._slots):
            self._slots.append(entry)
        else:
            self._slots[slot] = entry
        proc.start()
        return slot

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(s["ready"] for s in self._slots if s["proc"] is not None):
            try:
                slot, tid, _, status, payload, tb = self._results.get(timeout=0.05)
            except queue.Empty:
                slot = None
            if slot is not None and tid == -1:      # (an earlier run's late answers are dropped)
                if status != "ok":
                    raise WorkerError(slot, payload, tb)
                self._slots[slot]["ready"] = True
            for i, s in enumerate(self._slots):
                if s["proc"] is not None and s["proc"].exitcode is not None:
                    raise WorkerError(i, died(s["proc"].exitcode))
            if time.monotonic() > deadline:
                raise WorkerError(-1, f"workers did not start within {timeout:.0f} s")

    # -- a run -------------------------------------------------------------------------------------------
    def run(self, fn, *args, network="lan", seed: int = 0, timeout: float | None = None, joins=(),
            replace: bool | None = None, deadline: float | None = None) -> dict:
        """Run `fn(member, workers, *args)` as an elastic job; {member id: return value} of the members of the
        last generation (the lost and the refused are in `lost` and `refused`). `replace` overrides the pool's
        for this run. As `Pool.run`: a run that reports progress is bounded by the progress watchdog, one that
        reports none by `timeout`; `deadline` ends it whatever its progress."""
        tid = self._next_task(network)
        for kind, value in joins:
            if kind not in ("time", "step"):
                raise UserError(f"a join is ('time', seconds) or ('step', k), got {(kind, value)!r}")
        self.prefix = f"thinwire/elastic/{tid}/"
        store = dist.PrefixStore(self.prefix, self._store)
        self._run_store = store
        store.set("config", json.dumps({"max": self.max_workers, "min": self.min_workers}))
        store.add("next_id", self.workers)
        elastic.write_gen(store, 0, {"members": list(range(self.workers)), "kind": "start", "at": None,
                                     "joined": [], "lost": []})
        self._store.set("thinwire/elastic/current", self.prefix)
        self.lost, self.joined, self.refused, self.generations = [], [], {}, []
        self._blob = pickle.dumps((fn, args, network, seed, self.workers))
        self._steps[:] = [-1] * self._cap
        self._times[:] = [0.0] * self._cap
        for s in self._slots:                  # reap what an earlier run stopped (newcomers still waiting at its end)
            if s["proc"] is not None and not s["proc"].is_alive():
                s["proc"].join()
                s["proc"], s["member"] = None, None
        live = [s for s in self._slots if s["proc"] is not None]
        for _ in range(self.workers + self.spares - len(live)):   # processes lost in an earlier run
            self._spawn()
        self._await_ready(self.start_timeout)
        idle = [i for i, s in enumerate(self._slots) if s["proc"] is not None and s["ready"]]
        for member, slot in enumerate(idle[:self.workers]):
            self._assign(slot, member, joining=False)
        self._t0 = time.monotonic()
        self._pending_joins = sorted(((v, k) for k, v in joins), key=lambda j: (j[1], j[0]))
        self._replacements: list[float] = []
        self._replace = self.replace if replace is None else replace
        try:
            out = self._collect(tid, timeout or self.timeout, deadline)
        except BaseException:
            self.close(force=True)
            raise
        while self._run_store.check([elastic.gen_key(len(self.generations))]):     # the run's generations
            self.generations.append(elastic.read_gen(self._run_store, len(self.generations)))
        return out

    def _assign(self, slot: int, member: int, joining: bool) -> None:
        s = self._slots[slot]
        s["member"], s["joining"] = member, joining
        self._steps[slot], self._times[slot] = -1, 0.0
        s["tasks"].put((self._task_id, self._blob, member, joining, self.prefix, self.max_workers))

    def start_joiner(self) -> int:
        """Start one newcomer now (an idle spare, else a fresh process); its member id."""
        member = self._run_store.add("next_id", 1) - 1
        slot = next((i for i, s in enumerate(self._slots)     # an idle spare
                     if s["proc"] is not None and s["ready"] and s["member"] is None), None)
        if slot is None:
            slot = self._spawn()      # its task assigned once the process is ready
            self._slots[slot].update(pending_member=member, member=member, joining=True)
        else:
            self._assign(slot, member, joining=True)
        self.joined.append({"member": member, "t": time.monotonic() - self._t0})
        return member

    def _newest(self) -> dict:
        """The newest generation's record."""
        return elastic.read_gen(self._run_store, elastic.newest(self._run_store, 0))

    def _lose(self, member: int, reason: str) -> None:
        """A member (or a newcomer not yet taken in) is gone: announce it; start a replacement if asked."""
        if any(entry["member"] == member for entry in self.lost):
            return
        self.lost.append({"member": member, "reason": reason, "t": time.monotonic() - self._t0})
        if elastic.publish_loss(self._run_store, [member]) is None:
            self._run_store.append("gone", f"{member},")   # never a member: rank 0 will not admit it
        rec = self._newest()
        if not rec["members"] or (len(rec["members"]) < self.min_workers and not self._replace):
            raise WorkerError(member, f"{reason}; {len(rec['members'])} workers remain, fewer than the minimum "
                                      f"{self.min_workers}")
        if self._replace:       # (below the minimum the survivors go on while the replacements start)
            self._replacements.append(time.monotonic() + self.replace_delay)

    def _collect(self, tid: int, timeout: float, deadline: float | None) -> dict:
        got: dict[int, object] = {}
        t0 = time.monotonic()
        watch = Watchdog(self._steps, self._times, self.progress_timeout, noun="member")
        done_at = None
        while True:
            try:
                slot, t, member, status, payload, tb = self._results.get(timeout=0.05)
            except queue.Empty:
                slot = None
            if slot is not None:
                s = self._slots[slot]
                if t == -1:                             # a fresh process is ready: give it its task
                    s["ready"] = True
                    if s.get("pending_member") is not None:
                        self._assign(slot, s.pop("pending_member"), joining=True)
                elif t == tid:
                    s["member"] = None
                    if status == "ok":
                        got[member] = pickle.loads(payload)
                    elif status == "refused":
                        self.refused[member] = payload
                    elif status == "dropped" or (status == "error" and peer_failure(payload)):
                        self._lose(member, payload)         # (it saw a peer go away: taken for lost)
                    elif status == "usererror":
                        raise UserError(payload.split(": ", 1)[-1])
                    else:
                        raise WorkerError(member, payload, tb)
            now = time.monotonic()
            for s in self._slots:
                p = s["proc"]
                if p is None or p.exitcode is None:
                    continue
                member = s["member"]
                s["proc"], s["member"] = None, None
                if member is not None and member not in got:
                    self._lose(member, died(p.exitcode))
            for i, s in enumerate(self._slots):
                if (s["proc"] is not None and s["member"] is not None and s["ready"]
                        and 0 < self._beats[i] < now - self.stall_timeout):
                    os.kill(s["proc"].pid, signal.SIGKILL)     # stalled: taken for lost (its exit is seen next)
            while self._replacements and self._replacements[0] <= now:
                self._replacements.pop(0)
                self.start_joiner()
            while self._pending_joins and self._join_due(*self._pending_joins[0], now):
                self._pending_joins.pop(0)
                self.start_joiner()
            self._watch_foreign(got)
            members = self._newest()["members"]
            running = {s["member"]: i for i, s in enumerate(self._slots)
                       if s["member"] in members and s["proc"] is not None}
            stuck = watch.check(now, list(running), running)
            if stuck is not None:
                raise stuck
            if all(m in got for m in members):
                if done_at is None:
                    self._run_store.set("done", "1")   # newcomers still waiting give up (refused: the job ended)
                    done_at = now
                busy = [s for s in self._slots if s["proc"] is not None and s["member"] is not None]
                if not busy or now > done_at + 30.0:
                    for s in busy:
                        os.kill(s["proc"].pid, signal.SIGKILL)
                        s["proc"].join(timeout=5)
                        s["proc"], s["member"] = None, None
                    return {m: got[m] for m in members}
            limit = deadline if deadline is not None else (None if watch.seen else timeout)
            if limit is not None and now > t0 + limit:
                missing = [m for m in members if m not in got]
                raise WorkerError(missing[0] if missing else -1, f"stalled: no result within {limit:.0f} s "
                                                                  f"(members {missing} still running)")

    def _join_due(self, value, kind, now) -> bool:
        return now - self._t0 >= value if kind == "time" else max(self._steps[:len(self._slots)] or [-1]) >= value

    def _watch_foreign(self, got: dict) -> None:
        """Members joined by hand (`thinwire train --join`): their results and heartbeats come through the store."""
        for m, status, value in _hand_joined(self._run_store, set(got) | {e["member"] for e in self.lost}):
            if status == "ok":
                got[m] = value
            elif status == "refused":
                self.refused[m] = value
            else:
                self._lose(m, value)

    # -- the end ---------------------------------------------------------------------------------------
    def _workers(self) -> list:
        return [(s["proc"], s["tasks"]) for s in self._slots]

    def close(self, force: bool = False) -> None:
        super().close(force)
        self._run_store = None

    @property
    def pids(self) -> dict[int, int]:
        """{member id: pid} of the members running now."""
        return {s["member"]: s["proc"].pid for s in self._slots if s["proc"] is not None and s["member"] is not None}


def _hand_joined(run_store, known: set) -> list[tuple[int, str, object]]:
    """(the launcher) What the store says of the members joined by hand (`join_by_hand`) that are not `known`:
    (member, status, value) for each that handed in its result (status "ok", "refused" or "error") or whose
    heartbeat stopped ("silent")."""
    if not run_store.check(["foreign"]):
        return []
    news = []
    for m in {int(x) for x in run_store.get("foreign").decode().split(",") if x}:
        if m in known:
            continue
        if run_store.check([f"result/{m}"]):
            news.append((m, *json.loads(run_store.get(f"result/{m}").decode())))
        elif run_store.check([f"alive/{m}"]):
            if time.time() - float(run_store.get(f"alive/{m}").decode()) > FOREIGN_SILENCE_S:
                news.append((m, "silent", f"no heartbeat for {FOREIGN_SILENCE_S:.0f} s (joined by hand)"))
    return news


def _connect(host: str, port: int):
    """A client of the job's store at `host`:`port`, or a one-line UserError within `JOIN_REACH_S`. The address
    is probed first with a plain socket (the name lookup on a thread: it takes no timeout); then `TCPStore`,
    whose client retries past its timeout and writes a C++ stack dump at each try, has `STORE_ANSWER_S` to
    shake hands, with this process's stderr (fd 2) on /dev/null meanwhile."""
    failure = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=JOIN_REACH_S - 2 * STORE_ANSWER_S).close()
            failure.append(None)
        except OSError as e:
            failure.append(e.strerror or str(e) or type(e).__name__)
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(JOIN_REACH_S - 2 * STORE_ANSWER_S)
    why = failure[0] if failure else f"no answer within {JOIN_REACH_S - 2 * STORE_ANSWER_S:.0f} s"
    if why is not None:
        raise UserError(f"cannot reach the elastic job at {host}:{port}: {why}")
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_ANSWER_S))
    except (RuntimeError, OSError) as e:
        raise UserError(f"cannot reach the elastic job at {host}:{port}: it answers, but as no thinwire job's "
                        f"store ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
    store.set_timeout(timedelta(seconds=JOIN_REACH_S))    # each of its operations' bound from now on
    return store


def join_by_hand(address: str, fn, *args, timeout: float = 3600.0):
    """Join the elastic job whose launcher's store is at `address` ("HOST:PORT") from this process (`thinwire
    train --join`, also under torchrun: each process joins as one member): run `fn(member, workers, *args)` as a
    newcomer and hand the result (JSON-able) to the launcher through its store. Returns the result."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--join takes HOST:PORT (the address an elastic job prints), got {address!r}")
    store = _connect(host, int(port))
    end = time.monotonic() + STORE_ANSWER_S     # (a job sets it as its run begins, just after it prints its address)
    while not store.check(["thinwire/elastic/current"]):
        if time.monotonic() > end:
            raise UserError(f"{address} is no thinwire elastic job")
        time.sleep(0.05)
    prefix = store.get("thinwire/elastic/current").decode()
    run = dist.PrefixStore(prefix, store)
    config = json.loads(run.get("config").decode())
    member = run.add("next_id", 1) - 1
    run.append("foreign", f"{member},")
    threading.Thread(target=_beat_store, args=(run, member), daemon=True).start()
    pinned = os.environ.get("GLOO_SOCKET_IFNAME")
    pin_gloo(host)
    MEMBERSHIP.reset()
    me = elastic.Member(run, member, True, timeout, config["max"])
    elastic.set_member(me)
    try:
        value = fn(member, len(elastic.read_gen(run, 0)["members"]), *args)
    except elastic.JoinRefused as e:
        run.set(f"result/{member}", json.dumps(["refused", str(e)]))
        raise
    except BaseException as e:
        run.set(f"result/{member}", json.dumps(["error", f"{type(e).__name__}: {e}"]))
        raise
    finally:
        elastic.set_member(None)
        if pinned is None:      # this process goes on (an in-process `--join`): its next job picks its own interface
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    run.set(f"result/{member}", json.dumps(["ok", value]))
    return value
