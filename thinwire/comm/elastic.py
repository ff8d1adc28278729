"""Elastic membership: workers that join a running job, and the group each generation of members trains on.

The design is in docs/reliability.md ("Workers that join a running job"). In short: every worker process is a
*member* with an id never reused (the first workers 0..N-1, each newcomer the next); the membership is a sequence
of *generations*, lists of member ids (old members first: rank 0 of a generation always trained before), small
JSON records written once (`compare_set`) in the launcher's rendezvous store (`gen/<g>`): the launcher writes
`loss` generations (the members' waits then raise `PeerLost`), rank 0 writes `join` generations at a
synchronization boundary, with `at`, the step where every member switches. Each generation trains on a gloo group
of its own, made from the store under `pg/<g>/` (torch.distributed's default group cannot grow, and destroying a
gloo group blocks while one of its operations waits on a lost peer). What a newcomer takes from a live peer
crosses in comm/state.py's format, point to point on the Transport (`send_state`, `recv_state`,
`broadcast_state`): nothing is unpickled.

`MEMBER` is this process's membership (None outside an elastic job), set by the launcher
(`thinwire.launcher.elastic`) in each worker before the worker's function runs.
"""
from __future__ import annotations

import json
import math
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import UserError, WorkerError
from . import state
from .membership import MEMBERSHIP

HOST = "cpu"             # a state crosses from host buffers (the groups of an elastic job are gloo's)
POLL_S = 0.01            # how often a member waiting for the others of its generation looks again


class JoinRefused(UserError):
    """A worker may not join this job (another configuration or model, or the job is full); one line."""


class Dropped(WorkerError):
    """This member is not in the job's newest generation (the launcher took it for lost)."""


# -- the group of one generation ---------------------------------------------------------------------------
def make_group(store, rank: int, size: int, timeout: float) -> dist.ProcessGroup:
    """A gloo process group of `size` ranks rendezvousing through `store` (a prefix of its own), not registered
    with torch.distributed's world: the Transport addresses its ranks within the group (`group_src`,
    `group_dst`), and dropping it never waits for the default group."""
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _release(box: list) -> None:
    """(thread) Drop a retired group: gloo's destructor joins its threads, which may wait on a lost peer until
    the group's timeout; here that delays nobody."""
    box.clear()


def retire(box: list) -> None:
    """Drop the groups in `box` (a list holding the last references) on a thread of their own."""
    if box:
        threading.Thread(target=_release, args=(box,), daemon=True, name="thinwire-retire-group").start()


# -- state as tensors behind a JSON header (the format of comm/state.py), point to point ------------------
def send_state(transport, obj, dst: int) -> None:
    """Send `obj` (comm/state.py's format) to group rank `dst` of `transport` (`state.transfer`: three messages,
    counted and emulated as any transfer)."""
    state.transfer(obj, True, lambda t: transport.send(t, dst), HOST)


def recv_state(transport, src: int):
    return state.decode(*state.transfer(None, False, lambda t: transport.recv(t, src), HOST))


def broadcast_state(transport, obj, src: int = 0):
    """`obj` of group rank `src` on every rank of `transport` (the others pass anything; see `state.pack`)."""
    move = lambda t: transport.broadcast(t, src)     # noqa: E731
    return state.decode(*state.transfer(obj, transport.rank == src, move, HOST))


# -- the coordinator's records -----------------------------------------------------------------------------
def gen_key(g: int) -> str:
    return f"gen/{g}"


def read_gen(store, g: int) -> dict:
    return json.loads(store.get(gen_key(g)).decode())


def write_gen(store, g: int, record: dict) -> bool:
    """Define generation `g` as `record` unless someone already did; whether this call did."""
    value = json.dumps(record, sort_keys=True)
    return store.compare_set(gen_key(g), "", value).decode() == value


def newest(store, g: int) -> int:
    """The newest generation from `g` on (g itself must exist)."""
    while store.check([gen_key(g + 1)]):
        g += 1
    return g


def publish_loss(store, dead: list[int]) -> tuple[int, dict] | None:
    """(launcher) A loss generation without `dead`, on top of the newest one (None: none of them was a member)."""
    g = newest(store, 0)
    while True:
        rec = read_gen(store, g)
        if not set(dead) & set(rec["members"]):
            return None
        new = {"members": [m for m in rec["members"] if m not in dead], "kind": "loss", "at": None,
               "joined": [], "lost": sorted(set(dead) & set(rec["members"]))}
        if write_gen(store, g + 1, new):
            return g + 1, new
        g = newest(store, g + 1)


# -- this process's membership -----------------------------------------------------------------------------
class Member:
    """This worker's place in an elastic job: its id, the generation it trains in and that generation's group.

    `store` is a client of the launcher's store with this job's prefix. A member started with the job (`joining`
    False) trains in generation 0; a newcomer calls `join()`, which returns once a generation takes it in and its
    group is formed. At every synchronization boundary the Trainer calls `boundary(step, after)`."""

    def __init__(self, store, me: int, joining: bool, timeout: float = 600.0, max_members: int | None = None):
        self.store, self.me, self.joining, self.timeout = store, int(me), bool(joining), float(timeout)
        self.max_members = max_members
        self.gen: int | None = None          # the generation formed (trained in)
        self.record: dict | None = None
        self.group = None
        self.switch_at: int | None = None    # a join generation announced: the step of the boundary to switch at
        self._watch_from = 0
        self._watcher: threading.Thread | None = None
        self._seen_pending = 0
        self._npending = 0                   # newcomers that asked so far (the watcher's count)
        self._proposed: int | None = None    # a join generation proposed (and acknowledged by this member)
        self._retired: list = []
        self._lock = threading.Lock()        # the generation, its record and the proposal: main thread and watcher

    # -- generations --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.record["members"].index(self.me)

    @property
    def members(self) -> list[int]:
        return list(self.record["members"])

    def start(self) -> dict:
        """A member of the job's first generation: form generation 0's group (the launcher wrote generation 0)."""
        return self._form(0)

    def agree(self, section: str, description: dict) -> None:
        """The job's `section` (a JSON-able dict: the configuration, the model) must be the same for every member:
        the first member of generation 0 publishes it, a newcomer compares its own and is refused (one line,
        naming the first difference) if they differ."""
        key = f"job/{section}"
        mine = json.dumps(description, sort_keys=True, default=str)
        if not self.joining:
            self.store.compare_set(key, "", mine)
            return
        if not self._wait_key(key):
            raise JoinRefused("cannot join: the job has ended")
        theirs = json.loads(self.store.get(key).decode())
        ours = json.loads(mine)
        for k in sorted(theirs.keys() | ours.keys()):
            a, b = theirs.get(k), ours.get(k)
            if a == b:
                continue
            if isinstance(a, list) and isinstance(b, list):    # name the first entry that differs
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                a = a[i] if i < len(a) else f"{len(a)} entries"
                b = b[i] if i < len(b) else f"{len(b)} entries"
            elif isinstance(a, dict) and isinstance(b, dict):
                key = next(x for x in sorted(a.keys() | b.keys(), key=str) if a.get(x) != b.get(x))
                k, a, b = f"{k} {key}", a.get(key), b.get(key)
            raise JoinRefused(f"cannot join: the job runs {k} {_show(a)}, this worker {_show(b)}")

    def join(self) -> dict:
        """Ask to join; wait until a generation takes this member in and its group is formed. Raises JoinRefused
        if rank 0 refuses it (the job is full) or the job ends first."""
        self.store.append("pending", f"{self.me},")
        self.store.add("npending", 1)
        key = f"admit/{self.me}"
        if not self._wait_key(key):
            raise JoinRefused("cannot join: the job ended before it reached a synchronization boundary")
        answer = self.store.get(key).decode()
        if not answer.isdigit():
            raise JoinRefused(f"cannot join: {answer}")
        return self._form(int(answer))

    def _wait_key(self, key: str) -> bool:
        """Wait for `key`; False if the job ended (`done`) first."""
        deadline = time.monotonic() + self.timeout
        while not self.store.check([key]):
            if self.store.check(["done"]) or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _form(self, g: int) -> dict:
        """Form the group of generation `g`, or of a newer one that appears while the members gather."""
        while True:
            g = self._newest_with_me(g)
            rec = read_gen(self.store, g)
            n = len(rec["members"])
            arrived = self.store.add(f"arrived/{g}", 1)
            deadline = time.monotonic() + self.timeout
            superseded = False
            while arrived < n:
                if self.store.check([gen_key(g + 1)]):
                    superseded = True
                    break
                if self.store.check(["done"]):
                    raise JoinRefused(f"cannot join: the job ended before generation {g} formed")
                if time.monotonic() > deadline:
                    raise WorkerError(self.me, f"generation {g}: {arrived} of {n} members arrived within "
                                               f"{self.timeout:.0f} s")
                time.sleep(POLL_S)
                arrived = self.store.add(f"arrived/{g}", 0)
            if superseded:
                continue
            group = make_group(dist.PrefixStore(f"pg/{g}/", self.store), rec["members"].index(self.me), n,
                               self.timeout)
            if self.group is not None:
                self._retired.append(self.group)   # dropped by `retire_old` once the Transport let go of it
            self.group = group
            with self._lock:
                self.gen, self.record, self.switch_at = g, rec, None
            self._watch(g)
            return rec

    def retire_old(self) -> None:
        """Drop the groups of earlier generations (call once nothing else refers to them: the Transport
        regrouped), on a thread: a gloo group whose operation waits on a lost peer blocks its destructor."""
        box, self._retired = self._retired, []
        retire(box)

    def _newest_with_me(self, g: int) -> int:
        g = newest(self.store, g)
        rec = read_gen(self.store, g)
        if self.me not in rec["members"]:
            raise Dropped(self.me, f"member {self.me} is not in generation {g} of the job (members "
                                   f"{rec['members']}): it was taken for lost")
        return g

    # -- at a synchronization boundary ----------------------------------------------------------------------
    def boundary(self, step: int, after) -> bool:
        """At the synchronization boundary that ends `step` (local flags only, unless a join is under way):
        rank 0 proposes a join generation for the newcomers waiting, and once every member acknowledged it,
        fixes the boundary `after(step)` where all switch; the others read that step. Returns whether this
        member switches now (the caller then calls `switch()`); raises PeerLost if a loss was announced."""
        lost = MEMBERSHIP.lost(self.gen)
        if lost is not None:
            raise lost
        nxt = self.gen + 1
        if self.switch_at is None:
            self._propose_if_waiting()
            if self._proposed == nxt:
                if self.rank == 0:
                    if self.store.add(f"ack/{nxt}", 0) >= len(self.record["members"]):
                        at = int(after(step))
                        self.store.set(f"at/{nxt}", str(at))
                        self.switch_at = at
                elif self.store.check([f"at/{nxt}"]):     # (a join under way: one store round trip)
                    self.switch_at = int(self.store.get(f"at/{nxt}").decode())
        if self.switch_at is None:
            return False
        if self.switch_at < step:
            raise RuntimeError(f"member {self.me} passed step {self.switch_at}, where generation {nxt} switches, "
                               f"without switching (now at step {step})")
        return self.switch_at == step

    def ahead(self, step: int, after) -> None:
        """(rank 0, at the end of a step that is no boundary) Once every member acknowledged the join proposed,
        fix the switch at `after(step)`: the first boundary whose synchronization rank 0 has not issued yet (it
        issues its part after writing `at`, so no member passes that boundary unaware), or leave it to the next
        boundary where `after` gives None. One store round trip per step while acknowledgements are awaited."""
        nxt = self.gen + 1
        if self._proposed != nxt or self.switch_at is not None or self.rank != 0:
            return
        if self.store.add(f"ack/{nxt}", 0) < len(self.record["members"]):
            return
        at = after(step)
        if at is not None:
            self.store.set(f"at/{nxt}", str(int(at)))
            self.switch_at = int(at)

    def switch(self) -> dict:
        """Form the next generation's group (after `boundary` returned True); a newer one if it came meanwhile."""
        return self._form(self.gen + 1)

    def regroup(self, generation: int) -> dict:
        """After a loss announced as `generation`: form the newest generation's group."""
        return self._form(max(generation, self.gen + 1))

    def _propose_if_waiting(self) -> None:
        """(rank 0, at a boundary or from the watcher as soon as a newcomer asks) Propose a join generation if
        newcomers are waiting and none is proposed: the members' watchers acknowledge it while they train, so
        rank 0 can fix the switch at the first boundary whose synchronization it has not issued (`ahead`)."""
        with self._lock:
            if (self.record is not None and self.rank == 0 and self.switch_at is None
                    and self._proposed != self.gen + 1 and self._npending > self._seen_pending):
                self._propose()

    def _propose(self) -> None:
        """(rank 0, holding the lock) A join generation for the newcomers waiting (up to the maximum; the rest are
        refused)."""
        count = self.store.add("npending", 0)
        ids = [int(x) for x in self.store.get("pending").decode().split(",") if x]
        gone = set()
        if self.store.check(["gone"]):
            gone = {int(x) for x in self.store.get("gone").decode().split(",") if x}
        fresh = [i for i in dict.fromkeys(ids) if i not in gone and i not in self.record["members"]
                 and not self.store.check([f"admit/{i}"])]
        room = max(0, int(min((self.max_members or math.inf) - len(self.record["members"]), len(fresh))))
        for i in fresh[room:]:
            self.store.compare_set(f"admit/{i}", "", f"the job has its maximum of {self.max_members} workers")
        take, nxt = fresh[:room], self.gen + 1
        if take:
            rec = {"members": self.record["members"] + take, "kind": "join", "at": None, "joined": take,
                   "lost": []}
            if not write_gen(self.store, nxt, rec):
                return          # the launcher announced a loss first: the newcomers are admitted after it
            self._proposed = nxt
            self.store.add(f"ack/{nxt}", 1)
            for i in take:
                self.store.set(f"admit/{i}", str(nxt))
        self._seen_pending = count

    # -- the watcher: losses at once, join proposals acknowledged -------------------------------------------
    def _watch(self, g: int) -> None:
        """Follow the generations after `g` on a thread: tell MEMBERSHIP of losses at once (the members' waits on
        the old group then raise PeerLost), acknowledge join proposals, and keep count of the newcomers waiting."""
        self._watch_from = g
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._follow, daemon=True, name="thinwire-elastic-watch")
            self._watcher.start()

    def _follow(self) -> None:
        g = self._watch_from
        while True:
            try:
                g = max(g, self._watch_from)
                if self.store.check([gen_key(g + 1)]):
                    g += 1
                    rec, prev = read_gen(self.store, g), read_gen(self.store, g - 1)
                    if rec["kind"] == "loss":
                        MEMBERSHIP.announce(g, rec["members"], sorted(set(prev["members"]) - set(rec["members"])))
                        continue
                    with self._lock:    # (not rank 0's own proposal, made under the lock)
                        if self.me in prev["members"] and g == self.gen + 1 and self._proposed != g:
                            self._proposed = g          # set before acknowledging: then this member reads `at`
                            self.store.add(f"ack/{g}", 1)
                    continue
                self._npending = self.store.add("npending", 0)
                self._propose_if_waiting()
                time.sleep(0.05)
            except Exception:   # noqa: BLE001 - the store is gone: the job is over
                return


def _show(value) -> str:
    return repr(value) if not isinstance(value, (dict, list)) else json.dumps(value)[:200]


MEMBER: Member | None = None


def set_member(member: Member | None) -> None:
    global MEMBER
    MEMBER = member
