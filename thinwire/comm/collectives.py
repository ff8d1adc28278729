"""All-reduce algorithms built on the Transport's point-to-point ops, so they can be chosen and costed.

Every message goes through `Transport.isend`/`irecv`: the meter counts each algorithm's real traffic and the
emulated link charges α + Nβ per message, so each algorithm's emulated time follows its own α-β formula (Tang, Shi,
Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307,
Table III; `thinwire.net.cost`) with no formula applied here. `Transport(allreduce=NAME)` dispatches here when
NAME is not "gloo". Each algorithm is a program (`thinwire.comm.engine`): its rounds run on the engine's thread
while the caller computes.

| name | steps | cost (thinwire.net.cost) | world sizes |
| --- | --- | --- | --- |
| `ring` | reduce-scatter + all-gather of n chunks | `ring_allreduce` | any |
| `recursive_doubling` | exchange full vectors with rank ⊕ 2^r | `recursive_doubling_allreduce` | any (with n not a power of two the extra ranks fold into partners first: ⌊log2 n⌋ + 2 rounds, above the formula's ⌈log2 n⌉) |
| `recursive_halving` | reduce-scatter by recursive halving, all-gather by recursive doubling (Rabenseifner) | `recursive_halving_allreduce` | any (n not a power of two: the extra ranks fold into partners first, +2(α + Nβ), in the formula) |
| `tree` | binomial reduce to rank 0, binomial broadcast | `tree_allreduce` | any |
| `double_binary_tree` | two complementary in-order binary trees, each reduces then broadcasts half, pipelined in blocks | `double_binary_tree_allreduce` | any |
| `hierarchical[:m]` | tree reduce in groups of m, ring among leaders, tree broadcast | `hierarchical_allreduce` | m divides n |
| `torus[:X]` | ring reduce-scatter on rows of X, ring all-reduce on columns, ring all-gather on rows | `torus_allreduce` | X divides n |

Results are bitwise identical on every rank (each element is combined by one rank and copied, or combined
symmetrically), and equal gloo's all-reduce to float tolerance (the summation order differs).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ..errors import UserError
from ..net.cost import grid_shape, tree_blocks

ALGORITHMS = ("gloo", "ring", "recursive_doubling", "recursive_halving", "tree", "double_binary_tree",
              "hierarchical", "torus")
TAG = 7100  # keeps collective messages apart from other point-to-point traffic (gossip)
UP_TAGS, DOWN_TAGS = (7110, 7112), (7111, 7113)   # double binary tree: each tree's reduce and broadcast on its own tag

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
    """(program) All-reduce `tensor` in place across `transport`'s group with `algorithm` (`op` checked by the
    Transport that calls it)."""
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


def _ring_pass(tp, chunks, members, me, combine=None) -> None:
    """n-1 steps around the ring of `members`. With `combine`, a reduce-scatter: member `me` ends holding chunk
    (me + 1) % n reduced. Without, an all-gather: member `me` starts owning chunk (me + 1) % n and ends with all."""
    n = len(members)
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    first = me if combine else me + 1
    for s in range(n - 1):
        send, recv = chunks[(first - s) % n], chunks[(first - s - 1) % n]
        buf = torch.empty_like(recv) if combine else recv
        yield from _exchange(tp, send, right, buf, left)
        if combine:
            combine(recv, buf)


def _ring(tp, flat, members, me, combine, _size=None) -> None:
    """Ring all-reduce: 2(n-1) α + 2(n-1)/n N β (Tang et al. Table III)."""
    chunks = flat.tensor_split(len(members))
    yield from _ring_pass(tp, chunks, members, me, combine)
    yield from _ring_pass(tp, chunks, members, me)


def _power_of_two(core):
    """`core(tp, flat, members, me, combine, p)` runs over p = 2^⌊log2 n⌋ ranks: the n − p extra ranks first fold
    their vectors into ranks 0..n−p−1 and get the result back from them at the end."""
    def run(tp, flat, members, me, combine, _size=None):
        n = len(members)
        p = 1 << (n.bit_length() - 1)
        if me >= p:
            yield from _exchange(tp, flat, members[me - p], None, 0)
            yield from _exchange(tp, None, 0, flat, members[me - p])
            return
        if me < n - p:
            buf = torch.empty_like(flat)
            yield from _exchange(tp, None, 0, buf, members[me + p])
            combine(flat, buf)
        yield from core(tp, flat, members, me, combine, p)
        if me < n - p:
            yield from _exchange(tp, flat, members[me + p], None, 0)
    run.__name__, run.__doc__ = core.__name__, core.__doc__
    return run


@_power_of_two
def _recursive_doubling(tp, flat, members, me, combine, p) -> None:
    """Recursive doubling: log n rounds exchanging the full vector with me ⊕ 2^r (Tang et al. Table III)."""
    buf = torch.empty_like(flat)
    for r in range(p.bit_length() - 1):
        partner = members[me ^ (1 << r)]
        yield from _exchange(tp, flat, partner, buf, partner)
        combine(flat, buf)


@_power_of_two
def _recursive_halving(tp, flat, members, me, combine, p) -> None:
    """Rabenseifner's all-reduce (Thakur, Rabenseifner, Gropp 2005, "Optimization of Collective
    Communication Operations in MPICH", §4.4) over p = 2^⌊log2 n⌋
    ranks, the vector cut into p blocks: log p rounds of reduce-scatter by recursive halving (exchange half of
    the blocks still held with me ⊕ p/2, me ⊕ p/4, ..., keep the half on my side, add the partner's copy of
    it), after which rank me holds block me summed; then log p rounds of all-gather by recursive doubling.
    2 log p α + 2 (p−1)/p N β. Each block is summed by one rank and copied: identical on every rank."""
    at = [0, *accumulate(part.numel() for part in flat.tensor_split(p))]

    def blocks(lo: int, hi: int) -> torch.Tensor:
        return flat[at[lo]:at[hi]]
    lo, hi, mask = 0, p, p >> 1
    while mask:                                 # reduce-scatter: [lo, hi) holds 2·mask blocks
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        mine = blocks(*keep)
        buf = torch.empty_like(mine)
        partner = members[me ^ mask]
        yield from _exchange(tp, blocks(*give), partner, buf, partner)
        combine(mine, buf)
        (lo, hi), mask = keep, mask >> 1
    mask = 1
    while mask < p:                             # all-gather: [lo, hi) holds mask blocks, summed
        other = (lo - mask, lo) if me & mask else (hi, hi + mask)
        partner = members[me ^ mask]
        yield from _exchange(tp, blocks(lo, hi), partner, blocks(*other), partner)
        lo, hi, mask = min(lo, other[0]), max(hi, other[1]), mask << 1


def inorder_tree(n: int, position) -> list[tuple[int | None, list[int]]]:
    """(parent, children) of each of n members in the in-order binary tree on positions 1..n (`position(i)`:
    member i's position): position x with lowest set bit h has children x − h/2 and the first of x + h/2,
    x + h/4, ... that is ≤ n; odd positions are leaves; the root is the largest power of two ≤ n; height
    ⌊log2 n⌋ (Sanders, Speck, Träff 2009 §3)."""
    member = {position(i): i for i in range(n)}
    parent, children = [None] * n, [[] for _ in range(n)]
    for x in range(1, n + 1):
        step = (x & -x) // 2
        kids = [x - step] if step else []
        while step and x + step > n:
            step //= 2
        if step:
            kids.append(x + step)
        children[member[x]] = [member[c] for c in kids]
        for c in kids:
            parent[member[c]] = member[x]
    return list(zip(parent, children))


def double_trees(n: int) -> list[list[tuple[int | None, list[int]]]]:
    """The two complementary trees of the double binary tree (Sanders, Speck, Träff 2009 §3; NCCL ≥ 2.4): tree 0
    puts member i at position i + 1 (even members are its leaves); tree 1 mirrors it (n even: position n − i)
    or shifts it by one (n odd), so the inner nodes of one tree are leaves of the other."""
    second = (lambda i: n - i) if n % 2 == 0 else (lambda i: (i + 1) % n + 1)
    return [inorder_tree(n, lambda i: i + 1), inorder_tree(n, second)]


def _double_binary_tree(tp, flat, members, me, combine, _size=None) -> None:
    """Double binary tree all-reduce (Sanders, Speck, Träff 2009, "Two-Tree Algorithms for Full Bandwidth
    Broadcast, Reduction and Scan"): the vector's halves are reduced up and broadcast down two complementary binary
    trees, each half in k pipelined blocks: 2 d α + 2 (k + d − 1)/k N β (`net.cost.double_binary_tree_allreduce`).
    A rank is an inner node of at most one tree: its blocks of the other go up at once, and in its own it passes
    block j up as soon as its children's are in and added (no wait of one tree holds the other back), then down
    once the root holds the sums. Each block is summed once (at its root) and copied: identical on every rank."""
    k = tree_blocks(flat.nbytes)
    parts = [half.tensor_split(k) for half in flat.tensor_split(2)]
    links = [tree[me] for tree in double_trees(len(members))]     # per tree: (parent, children) of this rank
    blocks = [[j for j in range(k) if parts[t][j].numel()] for t in (0, 1)]
    inner = [t for t in (0, 1) if links[t][1]]          # at most one
    got = {(t, j, c): torch.empty_like(parts[t][j]) for t in inner for j in blocks[t] for c in links[t][1]}
    got = {key: (tp.irecv(buf, members[key[2]], tag=UP_TAGS[key[0]]), buf) for key, buf in got.items()}
    sends = [tp.isend(parts[t][j], members[links[t][0]], tag=UP_TAGS[t])            # where a leaf: all at once
             for t in (0, 1) if t not in inner and links[t][0] is not None for j in blocks[t]]
    for t in inner:                                     # reduce along this rank's own tree, block by block
        parent, children = links[t]
        for j in blocks[t]:
            for c in children:
                h, buf = got[t, j, c]
                yield h
                combine(parts[t][j], buf)
            if parent is not None:
                sends.append(tp.isend(parts[t][j], members[parent], tag=UP_TAGS[t]))
    for h in sends:                                     # the blocks sent up are received into next
        yield h
    recvs = {(t, j): tp.irecv(parts[t][j], members[links[t][0]], tag=DOWN_TAGS[t])
             for t in (0, 1) if links[t][0] is not None for j in blocks[t]}
    sends = []
    for t in inner:                                     # broadcast along this rank's own tree
        parent, children = links[t]
        for j in blocks[t]:
            if parent is not None:
                yield recvs.pop((t, j))
            sends += [tp.isend(parts[t][j], members[c], tag=DOWN_TAGS[t]) for c in children]
    for h in [*recvs.values(), *sends]:
        yield h


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
    mask = 1 << (n - 1).bit_length()            # the smallest power of two >= n
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
    """Binary (binomial) tree: reduce then broadcast, 2 α log n + 2 N β log n (Tang et al. Table III)."""
    yield from _tree_reduce(tp, flat, members, me, combine)
    yield from _tree_broadcast(tp, flat, members, me)


def _hierarchical(tp, flat, members, me, combine, group_size=None) -> None:
    """Hierarchical (Jia et al. 2018, arXiv 1807.11205): intra-group reduce to the leader, ring all-reduce among the
    leaders, intra-group broadcast. Groups are runs of m consecutive ranks (one machine each, say)."""
    m = group_size or grid_shape(len(members))[1]
    g, i = divmod(me, m)
    group = members[g * m:(g + 1) * m]
    yield from _tree_reduce(tp, flat, group, i, combine)
    if i == 0:
        yield from _ring(tp, flat, members[::m], g, combine)
    yield from _tree_broadcast(tp, flat, group, i)


def _torus(tp, flat, members, me, combine, width=None) -> None:
    """2-D torus (Mikami et al. 2018, arXiv 1811.05233) on an X×Y grid, rank = row·X + column: reduce-scatter along
    the row, all-reduce the owned chunk along the column, all-gather along the row."""
    x, _ = grid_shape(len(members), width)
    row, col = divmod(me, x)
    row_members = members[row * x:(row + 1) * x]
    col_members = members[col::x]
    chunks = flat.tensor_split(x)
    yield from _ring_pass(tp, chunks, row_members, col, combine)
    yield from _ring(tp, chunks[(col + 1) % x], col_members, row, combine)
    yield from _ring_pass(tp, chunks, row_members, col)


_ALGOS = {"ring": _ring, "recursive_doubling": _recursive_doubling, "recursive_halving": _recursive_halving,
          "tree": _tree, "double_binary_tree": _double_binary_tree, "hierarchical": _hierarchical, "torus": _torus}
