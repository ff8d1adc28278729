"""The peers face thinwire's emulated network and are counted as its cells are: `AllReduceCounter` wraps
`torch.distributed.all_reduce` (which PyTorch's hooks and model averagers call) in the peer's worker; the real
all-reduce runs on gloo, then completes no earlier than the emulated link delivers it, with the Transport's α-β ring
all-reduce cost and per-rank link queue (`LinkClock`), and the bytes of each tensor (fp32, fp16, PowerSGD's factors,
averaged parameters) counted as the ring's bytes sent per worker. Under `--netem` it only counts. A process group of
a peer's own wraps its all-reduce the same way (`charge`, a `CountedWork`: torchft's). `PeerStepper`, the base of
the peers' steppers, reports per step what the counter saw."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ...comm import LinkClock
from ...comm.context import default_seed
from ...net import Islands, ring_allreduce
from ...run.stepper import Stepper
from ...trainer import nonfinite_stop

_now = time.perf_counter


class AllReduceCounter:
    """Wraps `torch.distributed.all_reduce` for one peer run: counted and delivered by the emulated link. On a
    two-tier network (`Islands`) an all-reduce is charged on its group's path (inside one island, or the thin link)
    on that link's queue, and the bytes this rank sends over the thin link (its ring neighbour in another island)
    are counted apart, as the Transport does."""

    def __init__(self, rank: int, link):
        self.link, self.rank = link, rank
        self.islands = link if isinstance(link, Islands) else None
        self.clocks: dict = {}
        self.bytes_sent = self.emulated_s = self.wait_s = self.bytes_across = 0.0
        self.ops = 0
        self._orig = dist.all_reduce
        self._lock = threading.Lock()
        self._sleepers = 0           # buckets' callbacks may sleep concurrently: count their union once
        self._since = 0.0

    def install(self) -> None:
        dist.all_reduce = self.all_reduce

    def uninstall(self) -> None:
        dist.all_reduce = self._orig

    def charge(self, n: int, nbytes: int, members=None, me: int | None = None):
        """Count one ring all-reduce of `nbytes` over `n` ranks (as the Transport does): its (cost, link), to
        deliver. `members`: the group's global ranks in ring order and `me` this rank's index there (default: the
        first n ranks, this rank's own)."""
        members = list(range(n)) if members is None else members
        me = self.rank if me is None else me
        path = self.link if self.islands is None else self.islands.path(members)
        cost = ring_allreduce(path.handshaking(), n, nbytes)
        self.bytes_sent += cost.sent
        if self.islands is not None and self.islands.ring_crossing(members, me):
            self.bytes_across += cost.sent
        self.ops += 1
        return cost, path

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        members = dist.get_process_group_ranks(group) if group is not None else None
        me = members.index(dist.get_rank()) if members is not None else None
        cost = self.charge(dist.get_world_size(group), tensor.numel() * tensor.element_size(), members, me)
        work = self._orig(tensor, op=op, group=group, async_op=True)
        if not async_op:
            work.wait()
            self.deliver(cost)
            return None
        return CountedWork(self, work, cost)

    def clock(self, link) -> LinkClock:
        """This rank's queue on `link` (one per link of a two-tier network)."""
        if link.name not in self.clocks:
            self.clocks[link.name] = LinkClock(link, self.rank, default_seed())
        return self.clocks[link.name]

    def deliver(self, charged) -> None:
        cost, link = charged
        t = _now()
        deadline = self.clock(link).schedule(t, cost)
        if deadline <= t:
            return
        with self._lock:
            self.emulated_s += deadline - t
            if self._sleepers == 0:
                self._since = t
            self._sleepers += 1
        time.sleep(deadline - t)
        with self._lock:
            self._sleepers -= 1
            if self._sleepers == 0:
                self.wait_s += _now() - self._since  # time spent waiting on the link, overlaps counted once

    def totals(self) -> dict:
        return {"ops": self.ops, "bytes_sent": self.bytes_sent, "emulated_s": self.emulated_s, "wait_s": self.wait_s,
                "bytes_across": self.bytes_across}


class CountedWork(dist._Work):
    """The real work, completing (wait, future) only once the emulated link delivered it (a `dist._Work`, as
    torchft's process group must return)."""

    def __init__(self, counter: AllReduceCounter, work, cost):
        super().__init__()
        self.counter, self.work, self.cost = counter, work, cost
        self._delivered = False

    def _deliver_once(self):
        if not self._delivered:
            self._delivered = True
            self.counter.deliver(self.cost)

    def wait(self, timeout=None):
        self.work.wait()
        self._deliver_once()
        return True

    def is_completed(self):
        return self._delivered

    def get_future(self):
        def done(fut):
            self._deliver_once()
            return fut.value()
        return self.work.get_future().then(done)


class PeerStepper(Stepper):
    """What the peers share: `step()` is `self.optimizer`'s step after the NaN/Inf check (a peer applies no
    non-finite gradient), and its traffic is what `self.counter` (an `AllReduceCounter`) saw since the last one.
    A subclass sets `counter`, `optimizer`, `desc` and, last in its `__init__`, calls `start_counting()`."""

    def start_counting(self) -> None:
        self.steps, self._before = 0, self.counter.totals()

    def step(self) -> dict:
        self.steps += 1
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):  # one host read
            raise nonfinite_stop(self.worker_rank, self.steps)
        self.optimizer.step()
        now = self.counter.totals()
        out = {k: now[k] - self._before[k] for k in ("bytes_sent", "emulated_s", "wait_s")}
        self._before = now
        return out

    def counted(self, before) -> tuple[dict, dict]:
        """The peer's traffic over the whole run: on resume (`ddp`), what the checkpoint counted plus this
        segment's."""
        total = self.counter.totals()
        if before:
            old = before["meter"]["total"]
            total = {k: v + old.get(k, 0) for k, v in total.items()}
        return {"total": total, "by_kind": {}}, {"peer": self.desc}
