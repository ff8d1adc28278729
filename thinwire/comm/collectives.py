"""All-reduce algorithms built on the Transport's point-to-point ops, so they can be chosen and costed.

Every message goes through `Transport.isend`/`irecv`, so the meter counts each algorithm's real traffic and the
emulated link charges α + Nβ per message on this rank's queue: the emulated time of each algorithm follows its
own α-β formula (seed 000 Table III; `thinwire.net.cost`) without any formula being applied here.

    transport.allreduce = "ring"        # or: recursive_doubling, tree, hierarchical[:m], torus[:X], gloo
    transport.all_reduce(t, op="mean")  # dispatched here when not "gloo"

Each algorithm is a program (`thinwire.comm.engine`): it yields the messages of a round before the next, so
an asynchronous all-reduce returns at once and its rounds run on the engine's thread while the caller computes.

| name | steps | cost (thinwire.net.cost) | world sizes |
| --- | --- | --- | --- |
| `ring` | reduce-scatter + all-gather of n chunks | `ring_allreduce` | any |
| `recursive_doubling` | exchange full vectors with rank ⊕ 2^r | `recursive_doubling_allreduce` | any (with n not a power of two the extra ranks fold into partners first: ⌊log2 n⌋ + 2 rounds, above the formula's ⌈log2 n⌉) |
| `tree` | binomial reduce to rank 0, binomial broadcast | `tree_allreduce` | any |
| `hierarchical[:m]` | tree reduce in groups of m, ring among leaders, tree broadcast | `hierarchical_allreduce` | m divides n |
| `torus[:X]` | ring reduce-scatter on rows of X, ring all-reduce on columns, ring all-gather on rows | `torus_allreduce` | X divides n |

Results are bitwise identical on every rank (each element is combined by one rank and copied, or combined
symmetrically), and equal gloo's all-reduce to float tolerance (the summation order differs).
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..net.cost import grid_shape

ALGORITHMS = ("gloo", "ring", "recursive_doubling", "tree", "hierarchical", "torus")
TAG = 7100  # keeps collective messages apart from other point-to-point traffic (gossip)

_COMBINE = {"sum": torch.Tensor.add_, "mean": torch.Tensor.add_,
            "max": lambda a, b: torch.maximum(a, b, out=a), "min": lambda a, b: torch.minimum(a, b, out=a)}


def parse(spec: str, world_size: int) -> tuple[str, int | None]:
    """`"torus:2"` → ("torus", 2); validates the name and the shape against the world size."""
    if not isinstance(spec, str):
        raise UserError(f"allreduce must be a name; valid: {', '.join(ALGORITHMS)}")
    name, _, arg = spec.partition(":")
    if name not in ALGORITHMS:
        raise UserError(f"unknown all-reduce algorithm {spec!r}; valid: {', '.join(ALGORITHMS)} "
                        "(hierarchical:GROUP_SIZE, torus:WIDTH)")
    if arg and name not in ("hierarchical", "torus"):
        raise UserError(f"all-reduce algorithm {name!r} takes no argument; valid with one: hierarchical:M, torus:X")
    size = None
    if arg:
        try:
            size = int(arg)
        except ValueError:
            raise UserError(f"{name}:{arg}: expected an integer after the colon") from None
        if size < 1 or world_size % size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            what = "group size" if name == "hierarchical" else "torus width"
            raise UserError(f"{name}:{size}: the {what} must divide the world size {world_size}; "
                            f"valid: {', '.join(map(str, divisors))}")
    return name, size


def all_reduce_program(transport, tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring"):
    """(program) All-reduce `tensor` in place across `transport`'s group with `algorithm`."""
    if op not in _COMBINE:
        raise UserError(f"unknown reduce op {op!r}; valid: {', '.join(_COMBINE)}")
    name, size = parse(algorithm, transport.world_size)
    n = transport.world_size
    if n > 1:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        yield from _ALGOS[name](transport, flat, list(range(n)), transport.rank, _COMBINE[op], size)
        if op == "mean":
            flat.div_(n)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    return tensor


# -- building blocks over a list of group ranks (`members`); `me` is this rank's index in it -----------------
def _exchange(tp, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int):
    """(program) Send one tensor and receive another at the same time (either may be None or empty)."""
    handles = []
    if send is not None and send.numel():
        handles.append(tp.isend(send, dst, tag=TAG))
    if recv is not None and recv.numel():
        handles.append(tp.irecv(recv, src, tag=TAG))
    for h in handles:   # each real completion is timestamped as it happens: waiting in turn costs nothing
        yield h


def _ring_reduce_scatter(tp, flat, members, me, combine) -> list[torch.Tensor]:
    """After n-1 steps, member `me` holds the reduced chunk (me + 1) % n. Returns the chunk views."""
    n = len(members)
    chunks = list(flat.tensor_split(n))
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    for s in range(n - 1):
        send_i, recv_i = (me - s) % n, (me - s - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        yield from _exchange(tp, chunks[send_i], right, buf, left)
        combine(chunks[recv_i], buf)
    return chunks


def _ring_all_gather(tp, chunks, members, me) -> None:
    """Member `me` starts owning chunk (me + 1) % n; after n-1 steps every member has every chunk."""
    n = len(members)
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    for s in range(n - 1):
        send_i, recv_i = (me + 1 - s) % n, (me - s) % n
        yield from _exchange(tp, chunks[send_i], right, chunks[recv_i], left)


def _ring(tp, flat, members, me, combine, _size=None) -> None:
    """Ring all-reduce: 2(n-1) α + 2(n-1)/n N β (seed 000 Table III)."""
    if len(members) > 1:
        chunks = yield from _ring_reduce_scatter(tp, flat, members, me, combine)
        yield from _ring_all_gather(tp, chunks, members, me)


def _recursive_doubling(tp, flat, members, me, combine, _size=None) -> None:
    """Recursive doubling: log n rounds exchanging the full vector with me ⊕ 2^r (seed 000 Table III).
    With n not a power of two, the last n - p ranks first fold into ranks 0..n-p-1 and get the result back."""
    n = len(members)
    p = 1 << (n.bit_length() - 1)
    if me >= p:
        yield from _exchange(tp, flat, members[me - p], None, 0)
        yield from _exchange(tp, None, 0, flat, members[me - p])
        return
    buf = torch.empty_like(flat)
    if me < n - p:
        yield from _exchange(tp, None, 0, buf, members[me + p])
        combine(flat, buf)
    mask = 1
    while mask < p:
        partner = members[me ^ mask]
        yield from _exchange(tp, flat, partner, buf, partner)
        combine(flat, buf)
        mask <<= 1
    if me < n - p:
        yield from _exchange(tp, flat, members[me + p], None, 0)


def _tree_reduce(tp, flat, members, me, combine) -> None:
    """Binomial-tree reduce to members[0]: ⌈log2 n⌉ rounds of α + Nβ on the critical path."""
    n = len(members)
    buf = None
    mask = 1
    while mask < n:
        if me & mask:
            yield from _exchange(tp, flat, members[me - mask], None, 0)
            return
        if me + mask < n:
            buf = torch.empty_like(flat) if buf is None else buf
            yield from _exchange(tp, None, 0, buf, members[me + mask])
            combine(flat, buf)
        mask <<= 1


def _tree_broadcast(tp, flat, members, me) -> None:
    """Binomial-tree broadcast from members[0]: ⌈log2 n⌉ rounds."""
    n = len(members)
    mask = 1
    while mask < n:
        mask <<= 1
    if me:
        low = me & -me
        yield from _exchange(tp, None, 0, flat, members[me - low])
        mask = low
    mask >>= 1
    while mask:
        if me + mask < n:
            yield from _exchange(tp, flat, members[me + mask], None, 0)
        mask >>= 1


def _tree(tp, flat, members, me, combine, _size=None) -> None:
    """Binary (binomial) tree: reduce then broadcast, 2 α log n + 2 N β log n (seed 000 Table III)."""
    yield from _tree_reduce(tp, flat, members, me, combine)
    yield from _tree_broadcast(tp, flat, members, me)


def _hierarchical(tp, flat, members, me, combine, group_size=None) -> None:
    """Hierarchical (seed 000 §IV-B, [23]): intra-group reduce to the leader, ring all-reduce among the
    leaders, intra-group broadcast. Groups are runs of m consecutive ranks (one machine each, say)."""
    m = group_size or grid_shape(len(members))[1]
    g, i = divmod(me, m)
    group = members[g * m:(g + 1) * m]
    yield from _tree_reduce(tp, flat, group, i, combine)
    if i == 0:
        yield from _ring(tp, flat, members[::m], g, combine)
    yield from _tree_broadcast(tp, flat, group, i)


def _torus(tp, flat, members, me, combine, width=None) -> None:
    """2-D torus (seed 000 §IV-B, [151][152]) on an X×Y grid, rank = row·X + column: reduce-scatter along
    the row, all-reduce the owned chunk along the column, all-gather along the row."""
    x, _ = grid_shape(len(members), width)
    row, col = divmod(me, x)
    row_members = members[row * x:(row + 1) * x]
    col_members = members[col::x]
    chunks = yield from _ring_reduce_scatter(tp, flat, row_members, col, combine)
    yield from _ring(tp, chunks[(col + 1) % x], col_members, row, combine)
    yield from _ring_all_gather(tp, chunks, row_members, col)


_ALGOS = {"ring": _ring, "recursive_doubling": _recursive_doubling, "tree": _tree,
          "hierarchical": _hierarchical, "torus": _torus}
