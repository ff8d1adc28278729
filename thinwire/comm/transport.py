"""The Transport: every operation thinwire puts on the wire, counted and (optionally) emulated.

One object wraps a torch.distributed process group. Each operation runs for real on the group (gloo on
127.0.0.1, or NCCL) and completes no earlier than the emulated link would have delivered it: the α-β cost of the
algorithm that runs (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A
Comprehensive Survey", arXiv 2003.06307, Table III), queued behind this rank's earlier transfers. Every op has a
synchronous form (the result; tensors used in place where torch.distributed does: all_reduce, broadcast, recv) and
an `async_op=True` form (a `Handle`, `thinwire.comm.handle`: compute done before its `wait()` overlaps the emulated
transfer). Every op is issued through the process's engine (`thinwire.comm.engine`) in submission order; inside a
program (`run`) ops are issued directly. A program's `serial` and `background` options are the caller's: the
transport keeps no mode of its own.

On a two-tier network (`thinwire.net.Islands`) every op is charged on the link it crosses: a collective on its
group's path (`inside` when the group lies in one island, else the thin link), a point-to-point message on the
link between its two ranks, each on that link's queue (`clocks`: one LinkClock per link of this worker, shared by
the transports of its subgroups, `sub`). The bytes a rank sends over the thin link are metered apart (`across`):
in a ring collective all of them when its right neighbour is in another island, in a broadcast those to its
children in another island.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import UserError
from ..net import Cost, Islands, Link, p2p, parse_network, ring_allgather, ring_allreduce, tree_broadcast
from ..trace import NULL, Tracer
from . import collectives
from .context import default_network, default_seed
from .emulation import DeliveryQueue, LinkClock
from .engine import ENGINE, Future, Ready
from .handle import Handle
from .membership import MEMBERSHIP, PeerLost
from .meter import Meter
from .staging import Staging

_now = time.perf_counter


def backend_of(group) -> str:
    """"gloo" or "nccl": the backend of `group` (an elastic generation's own group is gloo)."""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, AttributeError):
        return "gloo"


class _Work(Future):
    """A raw torch.distributed work as a future (a size exchange folded into the next operation's cost); its
    failure, once the launcher announced a loss in the membership after `generation`, is that `PeerLost`."""

    def __init__(self, work, generation: int | None):
        self.work = work
        self.generation = MEMBERSHIP.generation if generation is None else generation

    def result(self):
        try:
            self.work.wait()
        except RuntimeError as e:
            lost = MEMBERSHIP.explain(e, self.generation)
            if lost is None:
                raise
            raise lost from e

    def is_completed(self) -> bool:
        return self.work.is_completed()


@functools.cache
def _subgroup(world: int, ranks: tuple, backend: str):
    return dist.new_group(list(ranks), backend=backend)


def subgroup(ranks) -> object:
    """The process group of these global ranks, made once per process (every rank of the job must ask for the same
    groups in the same order, as for `dist.new_group`; later asks are free)."""
    return _subgroup(dist.get_world_size(), tuple(ranks), dist.get_backend())


def _islands(link) -> Islands | None:
    """A two-tier network's islands (checked against the world), or None for one link."""
    if not isinstance(link, Islands):
        return None
    if not dist.is_initialized():
        raise UserError("two-tier networks (islands:...) need torch.distributed's world: an elastic job runs on "
                        "one link")
    link.check_workers(dist.get_world_size(), "the world size")
    return link


def _buffers_device(device, nccl: bool) -> torch.device:
    """Where a group's buffers (headers included) live: `device` (the Trainer's: its model's), else the CUDA
    device current at construction under NCCL (read on the constructing thread: the engine's threads have their
    own current device), else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    return torch.device(device)


class Transport:
    """Collectives and point-to-point ops on one process group, with a byte meter and network emulation (see the
    module's doc).

    Args:
        group: the process group (default: torch.distributed's world, which must be initialised).
        network: the network to emulate (a profile name, "custom:...", "islands:...", or a `Link`; default:
            the one the launcher or `tw.init` set).
        seed: the seed of the emulation's randomness (default: the launcher's).
        tracer: a `Tracer` recording every operation; default none.
        meter: the byte `Meter` to count into (default: a new one).
        clock: the `LinkClock` that schedules this transport's messages (default: one for its link).
        allreduce: the all-reduce algorithm: "gloo" (its own) or one of `thinwire.comm.collectives.ALGORITHMS`
            ("ring", "tree", "hierarchical:K", "torus:K", ...).
        clocks: the link clocks shared with the transports of subgroups (`sub`), by tier.
        device: where collectives' buffers live (default: the CPU, or the current GPU on NCCL).
    """

    def __init__(self, group=None, network: "str | Link | None" = None, seed: int | None = None,
                 tracer: Tracer | None = None, meter: Meter | None = None, clock: LinkClock | None = None,
                 allreduce: str = "gloo", clocks: dict | None = None, device: "torch.device | str | None" = None):
        if group is None and (not dist.is_available() or not dist.is_initialized()):
            raise UserError("torch.distributed is not initialised: start workers with thinwire.launch, "
                            "or call thinwire.init() under torchrun")
        self.link = parse_network(network) if network is not None else default_network()
        self.islands = _islands(self.link)
        # a group of torch.distributed's world, or one of its own (an elastic generation's: thinwire.comm.elastic);
        # ranks are addressed within the group (group_src / group_dst), so both work. Its membership generation
        # (its waits watch later losses): the world's is the launcher's first, 0; an elastic generation's or a
        # loss's survivors' group is set by `regroup`. None (a subgroup): the newest announced when an op is issued
        self._adopt(group if group is not None else dist.group.WORLD, 0 if group is None else None)
        self.meter = meter or Meter()
        self._seed = default_seed() if seed is None else seed
        self.clocks = {} if clocks is None else clocks
        self.path = self.islands.path(self.members) if self.islands is not None else self.link
        self.clock = clock or self.clock_of(self.path)
        self.clocks.setdefault(self._tier(self.path), self.clock)
        self.collective_link = self.path.handshaking()  # gloo's collectives: a round trip per step
        self.tracer = tracer or NULL
        collectives.parse(allreduce, self.world_size)
        self.allreduce = allreduce  # "gloo" (native) or an algorithm of thinwire.comm.collectives
        self.delivery = DeliveryQueue()      # this group's collectives not yet on the link, in issue order
        self._switch = threading.RLock()     # held by `regroup`, and by each resumption of a program (`_bound`)
        self._epoch = 0                      # groups switched so far
        nccl = backend_of(self.group) == "nccl"
        self.device = _buffers_device(device, nccl)
        self.staging = Staging(nccl)      # point-to-point ops through host buffers where gloo needs them

    # -- links -----------------------------------------------------------------------------------------
    def _tier(self, link: Link) -> str:
        return "link" if self.islands is None else "inside" if link == self.islands.inside else "across"

    def clock_of(self, link: Link) -> LinkClock:
        """This worker's queue on `link` (one per link, shared with the transports of its subgroups)."""
        tier = self._tier(link)
        if tier not in self.clocks:
            self.clocks[tier] = LinkClock(link, dist.get_rank() if dist.is_initialized() else self.rank, self._seed)
        return self.clocks[tier]

    def link_to(self, peer: int) -> Link:
        """The link a message between this rank and group rank `peer` crosses."""
        if self.islands is None:
            return self.link
        return self.islands.between(self.global_of(self.rank), self.global_of(peer))

    def sub(self, group) -> "Transport":
        """A transport on `group` (a subgroup of this one's ranks) on the same network, meter, link queues,
        tracer and all-reduce algorithm."""
        return Transport(group=group, network=self.link, seed=self._seed, tracer=self.tracer, meter=self.meter,
                         allreduce=self.allreduce, clocks=self.clocks, device=self.device)

    def _ring_sent(self, cost: Cost) -> float:
        return cost.sent if self._ring_across else 0.0

    def _adopt(self, group, generation: int | None) -> None:
        self.group, self.generation = group, generation
        self.rank, self.world_size = group.rank(), group.size()
        self.members = [self.global_of(r) for r in range(self.world_size)]
        # a ring collective over this group: this rank's bytes cross the thin link when its right neighbour does
        self._ring_across = self.islands is not None and self.islands.ring_crossing(self.members, self.rank)

    def regroup(self, group, generation: int | None = None) -> None:
        """Go on with `group` (the survivors of a lost worker; an elastic job's next generation): ranks
        renumbered, the old group's operations in flight abandoned."""
        with self._switch:              # no program of the old group is between two of its operations
            self._epoch += 1
            self._adopt(group, generation)
            self.delivery.clear()

    # -- programs --------------------------------------------------------------------------------------
    def run(self, program, label: str = "exchange", background: bool = False, serial: bool = False):
        """Submit a program (a generator of futures, see `thinwire.comm.engine`) to the engine; a `Task`.
        `background`: never on the caller's thread (compression off the training thread); `serial`: one in
        flight at a time (delivered before the next program starts)."""
        return ENGINE.submit(self._bound(program), background=background, serial=serial,
                             accounting=(self.meter, self.tracer, label))

    def _bound(self, program):
        """(program) `program` bound to the group it was submitted on: once `regroup` switched groups, it is not
        resumed (it would issue its next operations on the new group, where no peer matches them) but fails with
        the loss. Each resumption (issuing operations, never blocking on them) holds the switch's lock."""
        epoch = self._epoch
        value, error = None, None
        while True:
            with self._switch:
                if self._epoch != epoch and error is None:
                    error = MEMBERSHIP.lost(0) or PeerLost(self._epoch, [], [])
                try:
                    fut = program.throw(error) if error is not None else program.send(value)
                except StopIteration as stop:
                    return stop.value
            try:
                value, error = (yield fut), None
            except BaseException as e:  # noqa: BLE001 - the program sees its wait's error
                value, error = None, e

    def _op(self, program, kind: str, async_op: bool):
        # never serial: a point-to-point send completes only once its peer posted the receive, which the
        # peer's engine would hold back behind the send it issued first
        fut = self.run(program, label=kind, background=False, serial=False).unwrap()
        return fut if async_op else fut.wait()

    def global_of(self, group_rank: int) -> int:
        """The rank in torch.distributed's world of group rank `group_rank`; in a group of its own (an elastic
        generation's, outside any world) the group rank."""
        if self.group is dist.group.WORLD:
            return group_rank
        try:
            return dist.get_global_rank(self.group, group_rank)
        except (ValueError, RuntimeError):
            return group_rank

    # -- collectives -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Sum (or mean, or max/min) `tensor` across ranks, in place. Costed as a ring all-reduce."""
        return self._op(self.all_reduce_program(tensor, op), "all_reduce", async_op)

    def all_reduce_program(self, tensor: torch.Tensor, op: str = "sum"):
        """(program) `all_reduce`: returns its future; a point-to-point algorithm runs its rounds here."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise UserError(f"unknown reduce op {op!r}; valid: {', '.join(ops)}")
        if self.allreduce != "gloo":  # a point-to-point algorithm, costed message by message
            yield from collectives.all_reduce_program(self, tensor, op, self.allreduce)
            return Ready(tensor)
        issued = _now()
        works = []
        if self.world_size > 1:
            works = [dist.all_reduce(tensor, op=ops[op], group=self.group, async_op=True)]
        cost = ring_allreduce(self.collective_link, self.world_size, tensor.nbytes)
        post = (lambda t: t.div_(self.world_size)) if op == "mean" and self.world_size > 1 else None
        return Handle(self, "all_reduce", works, cost, tensor, post, issued, across=self._ring_sent(cost))

    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False):
        """Gather a 1-D view of `tensor` from every rank; sizes may differ per rank (gloo's all_gather
        refuses uneven sizes, so blocks are padded to the largest; padding is counted as sent).
        `sizes`, when every rank already knows them, saves the size exchange. Returns a list by rank."""
        return self._op(self.all_gather_program(tensor, sizes), "all_gather", async_op)

    def all_gather_program(self, tensor: torch.Tensor, sizes: Sequence[int] | None = None):
        """(program) `all_gather`: the size exchange (when sizes are unknown) is a round of its own."""
        issued = _now()
        flat = tensor.reshape(-1)
        n = self.world_size
        cost_extra = Cost(0.0, 0.0, 0.0, 0.0)
        if sizes is None and n > 1:
            mine = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
            got = [torch.empty_like(mine) for _ in range(n)]
            yield _Work(dist.all_gather(got, mine, group=self.group, async_op=True), self.generation)
            sizes = torch.cat(got).tolist()       # host: once per gather (every rank's size)
            cost_extra = ring_allgather(self.collective_link, n, 8)
        elif sizes is None:
            sizes = [flat.numel()]
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or sizes[self.rank] != flat.numel():
            raise ValueError(f"all_gather sizes {sizes} do not match this rank's {flat.numel()} elements")
        largest = max(sizes)
        if n == 1:
            return Handle(self, "all_gather", [], cost_extra, [flat.clone()], None, issued)
        block = flat if flat.numel() == largest else torch.cat([flat, flat.new_zeros(largest - flat.numel())])
        out = [block.new_empty(largest) for _ in range(n)]
        works = [dist.all_gather(out, block, group=self.group, async_op=True)]
        cost = ring_allgather(self.collective_link, n, largest * flat.element_size()) + cost_extra
        post = lambda blocks: [b[:s] for b, s in zip(blocks, sizes)]
        return Handle(self, "all_gather", works, cost, out, post, issued, across=self._ring_sent(cost))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast from group rank `src`, in place. Costed as a binomial tree."""
        def program():
            issued = _now()
            works = []
            if self.world_size > 1:
                works = [dist.broadcast(tensor, group=self.group, async_op=True, group_src=src)]
            cost = tree_broadcast(self.collective_link, self.world_size, tensor.nbytes, self.rank, src)
            tree = 0.0 if self.islands is None else self.islands.tree_crossings(self.members, self.rank, src)
            return Handle(self, "broadcast", works, cost, tensor, None, issued, across=tensor.nbytes * tree)
            yield  # noqa: unreachable - makes this a program
        return self._op(program(), "broadcast", async_op)

    def barrier(self) -> None:
        if self.world_size > 1:
            def program():
                yield _Work(dist.barrier(group=self.group, async_op=True), self.generation)
            self._op(program(), "barrier", False)

    # -- point to point (device tensors under gloo through host buffers: `thinwire.comm.staging`) -------
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: int = 0):
        """Send to group rank `dst`. The sender's link pushes the bytes out from the moment the send is issued,
        behind what it is already sending; the sender is done once they are out. On an emulated link the
        message carries that moment (8 bytes, not counted as traffic) so the receiver cannot have the data
        before it (`thinwire.comm.emulation`). A device tensor under gloo is copied to a host buffer first."""
        def program():
            issued = _now()
            link = self.link_to(dst)
            clock = self.clock_of(link)
            cost = replace(p2p(link, tensor.nbytes), received=0.0)
            data, out = tensor.contiguous(), None
            if self.link.emulated:      # (on a two-tier network every message carries the stamp)
                out = clock.schedule(issued, cost, tx=True, rx=False, latency=False)
            if self.staging.staged(data):
                nbytes = data.nbytes
                wire = self.staging.host_buffer(nbytes + (8 if out is not None else 0), data)
                wire[:nbytes].copy_(data.reshape(-1).view(torch.uint8))     # waits for the data to be computed
                if out is not None:
                    wire[nbytes:] = torch.tensor([out], dtype=torch.float64, device="cpu").view(torch.uint8)
                data = wire
            elif out is not None:
                stamp = torch.tensor([out], dtype=torch.float64, device=data.device).view(torch.uint8)
                data = torch.cat([data.reshape(-1).view(torch.uint8), stamp])
            work = dist.isend(data, group=self.group, tag=tag, group_dst=dst)
            across = cost.sent if self._tier(link) == "across" else 0.0
            return Handle(self, "send", [work], cost, tensor, None, issued, rx=False, reserved=out, clock=clock,
                          across=across, keep=data)
            yield  # noqa: unreachable - makes this a program
        return self._op(program(), "send", async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: int = 0):
        """Receive from group rank `src` into `tensor`: delivered α + Nβ after the data is there, and (emulated)
        no earlier than α after the sender's link pushed its last byte out. Where the message comes into a
        buffer of its own (the sender's push-out time after the data; a host buffer for a device tensor under
        gloo), it is copied into `tensor` as soon as it is in, before the receive reports it `arrived`."""
        def program():
            issued = _now()
            nbytes = tensor.nbytes
            link = self.link_to(src)
            clock = self.clock_of(link)
            cost = replace(p2p(link, nbytes), sent=0.0)
            stamp = 8 if self.link.emulated else 0
            if not stamp and not self.staging.staged(tensor):
                work = dist.irecv(tensor, group=self.group, tag=tag, group_src=src)
                return Handle(self, "recv", [work], cost, tensor, None, issued, tx=False, clock=clock)
            # the data, then (emulated) the sender's push-out time
            buf = (self.staging.host_buffer(nbytes + stamp, tensor) if self.staging.staged(tensor) else
                   torch.empty(nbytes + stamp, dtype=torch.uint8, device=tensor.device))
            work = dist.irecv(buf, group=self.group, tag=tag, group_src=src)
            pushed_out = (lambda: float(buf[nbytes:].clone().view(torch.float64))) if stamp else None

            def land() -> None:   # (a pinned buffer: the copy to the device is queued, not waited for)
                tensor.reshape(-1).view(torch.uint8).copy_(buf[:nbytes], non_blocking=buf.is_pinned())
            return Handle(self, "recv", [work], cost, tensor, None, issued, tx=False,
                          not_before=pushed_out, clock=clock, land=land)
            yield  # noqa: unreachable - makes this a program
        return self._op(program(), "recv", async_op)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Future:
        return self.send(tensor, dst, async_op=True, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Future:
        return self.recv(tensor, src, async_op=True, tag=tag)

    # -- the control plane: blocking torch.distributed calls on this group, not metered, not emulated, not through
    #    the engine (start-up checks, a recovery's agreement and resynchronisation) -----------------------------
    def agree_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise max of `tensor` over the group, in place (the agreement of a start-up check or of a
        recovery's step); returns `tensor`."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def alike(self, values) -> list[bool]:
        """For each of `values` (numbers exact in a float64), whether every member of the group holds the same
        (one all-reduce of the values and their negations)."""
        v = torch.tensor([float(x) for x in values], dtype=torch.float64, device=self.device)
        both = self.agree_max(torch.cat([v, -v])).tolist()      # host: a start-up check or a recovery
        return [hi == -lo for hi, lo in zip(both[:len(v)], both[len(v):])]

    def share(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Every tensor of `tensors` from group rank `src`, in place, one broadcast each (a model's start)."""
        for t in tensors:
            dist.broadcast(t, group=self.group, group_src=src)

    def regroup_to(self, members: Sequence[int], generation: int | None = None) -> None:
        """`regroup` onto a new group of these global ranks (the survivors of a lost worker, membership
        `generation`), formed by the members alone: ranks outside it take no part. Every rank of the world: a
        plain group (torch names a locally synchronised group by its ranks alone, so a second one of the same
        ranks in a process would meet the first one's rendezvous keys)."""
        members = sorted(members)
        whole = members == list(range(dist.get_world_size()))
        self.regroup(dist.new_group(members, use_local_synchronization=not whole), generation)
