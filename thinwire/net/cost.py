"""α-β cost of the collectives (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A
Comprehensive Survey", arXiv 2003.06307, Table III and §IV-B), per rank: time, bytes sent, bytes received.

Every function takes the link, the number of ranks n and the message size in bytes, and returns a `Cost`: `latency`
(α), `transfer` (β: the time the link is busy) and the bytes this rank sends and receives under that algorithm; the
Transport emulates and counts with them, `thinwire.plan` predicts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .link import Link

COLLECTIVE_SLOTS = 2  # gloo runs a process group's collectives on its two worker threads (ProcessGroupGloo's default)


@dataclass(frozen=True)
class Cost:
    latency: float
    transfer: float
    sent: float
    received: float

    @property
    def time(self) -> float:
        return self.latency + self.transfer

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.latency + other.latency, self.transfer + other.transfer,
                    self.sent + other.sent, self.received + other.received)


ZERO = Cost(0.0, 0.0, 0.0, 0.0)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _tree_rounds(link: Link, n: int, nbytes: float) -> Cost:
    """⌈log2 n⌉ rounds of one full message each (binomial reduce or broadcast)."""
    r = _log2(n)
    return Cost(r * link.alpha, r * nbytes * link.beta, r * nbytes, r * nbytes)


def p2p(link: Link, nbytes: float) -> Cost:
    """One message: α + N β."""
    return Cost(link.alpha, nbytes * link.beta, nbytes, nbytes)


def ring_allreduce(link: Link, n: int, nbytes: float) -> Cost:
    """Ring: 2(n-1) α + 2(n-1)/n N β (Tang et al. Table III)."""
    if n <= 1:
        return ZERO
    moved = 2 * (n - 1) / n * nbytes
    return Cost(2 * (n - 1) * link.alpha, moved * link.beta, moved, moved)


def recursive_doubling_allreduce(link: Link, n: int, nbytes: float) -> Cost:
    """Recursive doubling: α log n + N β log n (Tang et al. Table III)."""
    return _tree_rounds(link, n, nbytes)


def recursive_halving_allreduce(link: Link, n: int, nbytes: float) -> Cost:
    """Rabenseifner's all-reduce (Thakur, Rabenseifner, Gropp 2005, "Optimization of Collective
    Communication Operations in MPICH", §4.4): reduce-scatter by
    recursive halving, then all-gather by recursive doubling, over p = 2^⌊log2 n⌋ ranks:
    2 log2(p) α + 2 (p−1)/p N β (bandwidth-optimal like the ring, logarithmic latency like doubling). With n not a
    power of two the n − p extra ranks first fold their vector into a partner and get the result back:
    + 2 (α + N β) on the critical path (thinwire.comm.collectives does this, as its recursive doubling)."""
    if n <= 1:
        return ZERO
    p = 1 << (n.bit_length() - 1)
    r = _log2(p)
    moved = 2 * (p - 1) / p * nbytes
    cost = Cost(2 * r * link.alpha, moved * link.beta, moved, moved)
    if p != n:
        cost = cost + Cost(2 * link.alpha, 2 * nbytes * link.beta, nbytes, nbytes)
    return cost


TREE_BLOCK_BYTES = 65536     # double binary tree: each half is cut into blocks of about this size ...
TREE_MAX_BLOCKS = 8          # ... and at most this many (each block is one message per tree edge)


def tree_blocks(nbytes: float) -> int:
    """Blocks per half of the double binary tree's pipeline for a message of `nbytes`."""
    return max(1, min(TREE_MAX_BLOCKS, math.ceil(nbytes / 2 / TREE_BLOCK_BYTES)))


def double_binary_tree_allreduce(link: Link, n: int, nbytes: float, blocks: int | None = None) -> Cost:
    """Double binary trees (Sanders, Speck, Träff 2009, "Two-Tree Algorithms for Full Bandwidth
    Broadcast, Reduction and Scan"; NCCL ≥ 2.4): two complementary
    in-order binary trees of height d = ⌊log2 n⌋ (a leaf of one is an inner node of the other) each reduce then
    broadcast half of the data, pipelined in k blocks. Per phase each rank sends and receives about one block
    per tree per step (2 · N/2k bytes), so a phase takes d α + (k + d − 1) N/k β (the pipeline fills in d
    steps, then one block per step):  2 d α + 2 (k + d − 1)/k N β  in all (k = `tree_blocks(N)`), which tends
    to the "full bandwidth and logarithmic latency" 2 d α + 2 N β of the survey as k grows."""
    if n <= 1:
        return ZERO
    d = n.bit_length() - 1
    k = blocks or tree_blocks(nbytes)
    moved = 2 * nbytes
    return Cost(2 * d * link.alpha, 2 * (k + d - 1) / k * nbytes * link.beta, moved, moved)


def tree_allreduce(link: Link, n: int, nbytes: float) -> Cost:
    """Binary tree (reduce then broadcast): 2 α log n + 2 N β log n (Tang et al. Table III)."""
    return _tree_rounds(link, n, nbytes) + _tree_rounds(link, n, nbytes)


def ring_allgather(link: Link, n: int, nbytes_each: float) -> Cost:
    """Ring all-gather of n blocks of N bytes: (n-1) α + (n-1) N β; each rank forwards n-1 blocks."""
    if n <= 1:
        return ZERO
    moved = (n - 1) * nbytes_each
    return Cost((n - 1) * link.alpha, moved * link.beta, moved, moved)


def tree_broadcast(link: Link, n: int, nbytes: float, rank: int = 0, root: int = 0) -> Cost:
    """Binomial-tree broadcast: ⌈log2 n⌉ (α + N β) to complete; a rank sends to one child per round below it."""
    r = _log2(n)
    rel = (rank - root) % n
    children = sum(1 for k in range(r) if rel < 2 ** k and rel + 2 ** k < n)
    return Cost(r * link.alpha, r * nbytes * link.beta, children * nbytes, 0.0 if rel == 0 else nbytes)


def grid_shape(n: int, width: int | None = None) -> tuple[int, int]:
    """(width X, height Y) of an X×Y grid of n ranks: `width` if given, else the most square one (X ≥ Y)."""
    if width is None:
        width = next(x for x in range(math.isqrt(n), n + 1) if n % x == 0) if n > 1 else 1
        width = max(width, n // width)
    return width, n // width


def hierarchical_allreduce(link: Link, n: int, nbytes: float, group_size: int | None = None) -> Cost:
    """Hierarchical (Jia et al. 2018, "Highly Scalable Deep Learning Training System with Mixed-Precision",
    arXiv 1807.11205): binomial reduce inside groups of m, ring all-reduce among the g = n/m
    leaders, binomial broadcast inside groups: 2⌈log2 m⌉(α + Nβ) + 2(g-1)α + 2(g-1)/g Nβ (critical path)."""
    m = group_size or grid_shape(n)[1]
    return _tree_rounds(link, m, nbytes) + ring_allreduce(link, n // m, nbytes) + _tree_rounds(link, m, nbytes)


def torus_allreduce(link: Link, n: int, nbytes: float, width: int | None = None) -> Cost:
    """2-D torus (Mikami et al. 2018, "Massively Distributed SGD: ImageNet/ResNet-50 Training in a Flash",
    arXiv 1811.05233) on an X×Y grid: ring reduce-scatter along rows, ring all-reduce of
    the N/X share along columns, ring all-gather along rows:
    2(X-1)α + 2(Y-1)α + 2(X-1)/X Nβ + 2(Y-1)/Y (N/X)β."""
    x, y = grid_shape(n, width)
    row = ring_allreduce(link, x, nbytes)  # reduce-scatter + all-gather along a row = one ring all-reduce
    return row + ring_allreduce(link, y, nbytes / x)


ALLREDUCE = {
    "ring": ring_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "recursive_halving": recursive_halving_allreduce,
    "tree": tree_allreduce,
    "double_binary_tree": double_binary_tree_allreduce,
    "hierarchical": hierarchical_allreduce,
    "torus": torus_allreduce,
}


# -- sparse collectives (thinwire/exchange/sparse.py): k (index, value) pairs per rank, `pair` bytes each ----------
def gtopk_allreduce(link: Link, n: int, k: float, pair: float = 8) -> Cost:
    """gTop-k (Shi et al. 2019, arXiv 1901.04359; Tang et al. §VI-B): 2α log n + 4kβ log n in 4-byte words, i.e. per
    round two messages (α each: the set's size, then the set) and k pairs each way (2·k·pair bytes of link time per
    round).

    n not a power of two: the doubling runs over p = 2^⌊log2 n⌋ ranks, the n − p extra ranks fold their k pairs
    into a partner first (two messages) and get the result back with a ⌈k/8⌉-byte survival mask (two more):
    (4 + 2 log p)α + (2 + 2 log p)k·pair β + ⌈k/8⌉β on the critical path; sent/received: a partner's."""
    p = 1 << (n.bit_length() - 1) if n > 1 else 1
    r = _log2(p)
    rounds = Cost(2 * r * link.alpha, 2 * r * k * pair * link.beta, r * k * pair, r * k * pair)
    if p == n:
        return rounds
    back = k * pair + math.ceil(k / 8)
    return rounds + Cost(4 * link.alpha, (k * pair + back) * link.beta, back, k * pair)


def shared_topk_allreduce(link: Link, n: int, k: float, index_bytes: float = 4, value_bytes: float = 4) -> Cost:
    """Shared-index top-k (CLT-k): broadcast of the leader's k indices (binomial tree) + ring all-reduce of k
    values: 2⌈log2 n⌉α + ⌈log2 n⌉ k·i β + 2(n−1)α + 2(n−1)/n k·v β (critical path)."""
    r = _log2(n)
    bcast = Cost(2 * r * link.alpha, r * k * index_bytes * link.beta, k * index_bytes, k * index_bytes)
    return bcast + ring_allreduce(link, n, k * value_bytes)


def sparse_group_size(n: int) -> int:
    """Ranks per group of hierarchical top-k: the largest divisor of n that is at most √n, or ⌈√n⌉ (a shorter
    last group) when that divisor is 1 and n > 2 (3 ranks: 2 + 1; 5: 3 + 2; 7: 3 + 3 + 1)."""
    m = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0) if n > 0 else 1
    return math.isqrt(n - 1) + 1 if m == 1 and n > 2 else m


def hierarchical_topk(link: Link, n: int, k: float, numel: float, group_size: int | None = None,
                      pair: float = 8, value_bytes: float = 4) -> Cost:
    """Hierarchical top-k: ring all-reduce of the dense tensor inside groups of m, all-gather of the g = n/m
    leaders' k pairs, binomial broadcast of the g gathered sets inside each group (critical path: a full group
    of m when the last one is shorter)."""
    m = min(n, group_size or sparse_group_size(n))
    g = -(-n // m)
    return (ring_allreduce(link, m, numel * value_bytes) + ring_allgather(link, g, k * pair)
            + _tree_rounds(link, m, g * k * pair))


def sparse_collective(name: str, link: Link, n: int, k: float, numel: float, pair: float = 8) -> Cost:
    """α-β cost of aggregating k-sparse tensors of `numel` elements with the named sparse collective. Top-k by
    all-gather: every rank receives the n−1 others' k pairs, (n−1)α + (n−1)k·pair β (Tang et al. §VI-B:
    "α log n + 2(n−1)kβ" with a tree's latency; gloo's all-gather is a ring)."""
    if name == "allgather":
        return ring_allgather(link, n, k * pair)
    if name == "gtopk":
        return gtopk_allreduce(link, n, k, pair)
    if name == "shared":
        return shared_topk_allreduce(link, n, k, pair / 2, pair / 2)
    if name == "hierarchical":
        return hierarchical_topk(link, n, k, numel, pair=pair)
    raise KeyError(name)
