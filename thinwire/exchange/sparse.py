"""Sparse collectives: aggregate top-k-family contributions without the all-gather's O(n·k) build-up.

Each takes this rank's compensated tensor c and returns (sum over ranks, this rank's share `sent`), so the
exchange feeds `c − sent` to the residual memory: summed over ranks, sent is exactly what was aggregated. Every
byte goes through the Transport (point to point, all-reduce, broadcast): metered and emulated.

- `gtopk` (gTop-k: Shi et al. 2019, "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification
  for Low Bandwidth Networks", arXiv 1901.04359): recursive doubling over log2 n rounds; in round j a rank swaps
  its (index, value) set with rank ^ 2^j, both sum duplicates and re-select the top k of the same merged set
  (index-sorted, so both partners compute the identical result). A rank's own contribution to an index survives
  iff that index stayed in its set through every round; what was dropped returns to its residual. Any n: with p
  the largest power of two ≤ n, each extra rank p + i first folds its set into rank i, the p ranks run the
  doubling, and rank i returns the result to p + i with a bit mask of which of its entries survived (the fold of
  MPI's recursive-doubling all-reduce).
- `shared` (CLT-k, ScaleCom): the leader (step mod n) broadcasts its top-k indices; every rank all-reduces its
  own values at those indices (k dense values); sent = c at the leader's indices.
- `hierarchical` (HiTopKComm): dense all-reduce inside groups of m consecutive ranks (the last group smaller when
  m does not divide n), the group leaders compress the group sum and all-gather their payloads, each leader
  broadcasts them into its group. A member's share is its own c on the group's selection plus 1/m of the group's
  compression error (so shares sum to the aggregate for quantising sparsifiers too).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Transport
from ..compress import Payload, bitpack
from ..errors import UserError
from ..net.cost import sparse_group_size
from . import wire

SPARSE_COLLECTIVES = ("allgather", "gtopk", "shared", "hierarchical")


def check(name: str, compressor=None) -> str:
    """A sparse collective's name, checked (at construction): known, and for one that replaces the all-gather, a
    top-k-family `compressor` (`Compressor.is_sparse`); a UserError naming what is valid otherwise."""
    if name not in SPARSE_COLLECTIVES:
        raise UserError(f"unknown sparse collective {name!r}; valid: {', '.join(SPARSE_COLLECTIVES)}")
    if name == "allgather" or compressor is None:
        return name
    if not compressor.is_sparse:
        raise UserError(f"sparse collective {name!r} needs a top-k-family compressor, not "
                        f"{compressor.name!r}; valid: topk, dgc, gaussiank, threshold, "
                        f"stc, qsparse (or --sparse-collective allgather)")
    return name


def contribution(compressor, c: torch.Tensor, key, step) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sparse contribution D(C(c)) as sorted int64 indices and values (its nonzeros)."""
    d = compressor.decompress(compressor.compress(c, key, step)).reshape(-1).to(c.dtype)
    idx = torch.nonzero(d).reshape(-1)
    return idx, d[idx]


def top(idx: torch.Tensor, vals: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest |vals| of an index-sorted set, returned index-sorted (deterministic: stable sort)."""
    if idx.numel() <= k:
        return idx, vals
    keep = torch.sort(vals.abs(), descending=True, stable=True).indices[:k]
    keep = torch.sort(keep).values
    return idx[keep], vals[keep]


def merge(ia, va, ib, vb):
    """Union of two index sets, values of equal indices summed; index-sorted."""
    idx, inv = torch.unique(torch.cat([ia, ib]), sorted=True, return_inverse=True)
    vals = torch.zeros(idx.numel(), dtype=va.dtype, device=va.device).index_add_(0, inv, torch.cat([va, vb]))
    return idx, vals


def swap(tr, partner: int, buf: torch.Tensor):
    """(program) Exchange a uint8 buffer with `partner` (its size first, so sizes may differ)."""
    mine = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
    theirs = torch.empty_like(mine)
    h = tr.isend(mine, partner)
    yield tr.irecv(theirs, partner)
    yield h
    out = torch.empty(int(theirs[0]), dtype=torch.uint8, device=buf.device)
    h = tr.isend(buf, partner)
    yield tr.irecv(out, partner)
    yield h
    return out


def send_buf(tr, dst: int, buf: torch.Tensor):
    """(program) One-way: a uint8 buffer to `dst`, its size first."""
    yield tr.isend(torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device), dst)
    yield tr.isend(buf, dst)


def recv_buf(tr, src: int):
    """(program) The buffer `send_buf` sends."""
    size = torch.empty(1, dtype=torch.int64, device=tr.device)
    yield tr.irecv(size, src)
    out = torch.empty(int(size[0]), dtype=torch.uint8, device=tr.device)
    yield tr.irecv(out, src)
    return out


def broadcast_buf(tr, buf: torch.Tensor | None, src: int, dtype, device):
    """(program) A 1-D buffer broadcast from `src` (its size first), so the others pass None: the buffer."""
    size = torch.tensor([0 if buf is None else buf.numel()], dtype=torch.int64, device=device)
    yield tr.broadcast(size, src=src, async_op=True)
    if buf is None:
        buf = torch.empty(int(size[0]), dtype=dtype, device=device)
    yield tr.broadcast(buf, src=src, async_op=True)
    return buf


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 bytes, 8 flags per byte (little-endian bit order: `bitpack` with 1-bit codes)."""
    return bitpack.pack(mask.to(torch.uint8), 1)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n flags `pack_bits` packed."""
    return bitpack.unpack(packed, 1, n).bool()


def _set(idx, vals, extra: list) -> torch.Tensor:
    return wire.pack([idx.to(torch.int32), vals, *extra])


def _dense(idx, vals, like: torch.Tensor) -> torch.Tensor:
    """Zeros of `like`'s shape and dtype, with `vals` at the flat indices (or mask) `idx`."""
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[idx] = vals
    return out.view(like.shape)


def gtopk(tr, compressor, c, key, step):
    """(program) gTop-k by recursive doubling over the largest power of two p ≤ n, extra ranks folded in and out."""
    flat = c.reshape(-1)
    idx, vals = contribution(compressor, flat, key, step)
    k = idx.numel()
    own_idx, own_vals = idx, vals
    n, rank = tr.world_size, tr.rank
    p = 1 << (n.bit_length() - 1)
    if rank >= p:                                        # extra rank: fold into rank − p, get the result back
        yield from send_buf(tr, rank - p, _set(idx, vals, [torch.tensor([k], device=vals.device)]))
        got = wire.unpack((yield from recv_buf(tr, rank - p)))
        idx, vals, alive = got[0].long(), got[1], unpack_bits(got[2], own_idx.numel())
    else:
        alive = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)   # which of my own entries are still in my set
        extra = rank + p if rank + p < n else None
        if extra is not None:                            # fold: merge the extra rank's set, re-select
            got = wire.unpack((yield from recv_buf(tr, extra)))
            e_idx, k = got[0].long(), max(k, int(got[2][0]))
            idx, vals = top(*merge(idx, vals, e_idx, got[1]), k)
            alive &= torch.isin(own_idx, idx)
            e_alive = torch.isin(e_idx, idx)
        for j in range(p.bit_length() - 1):              # round j: the partner is rank ^ 2^j
            mine = _set(idx, vals, [torch.tensor([k], device=vals.device)])
            got = wire.unpack((yield from swap(tr, rank ^ (1 << j), mine)))
            k = max(k, int(got[2][0]))                   # symmetric: both partners use the same k
            idx, vals = top(*merge(idx, vals, got[0].long(), got[1]), k)
            alive &= torch.isin(own_idx, idx)
            if extra is not None:
                e_alive &= torch.isin(e_idx, idx)
        if extra is not None:                            # the result, and which of its entries survived
            yield from send_buf(tr, extra, _set(idx, vals, [pack_bits(e_alive)]))
    return _dense(idx, vals, c), _dense(own_idx[alive], own_vals[alive], c)


def shared(tr, compressor, c, key, step):
    """(program) Shared-index top-k: the leader's indices, everyone's values at them, one dense all-reduce of k values."""
    flat = c.reshape(-1)
    leader = step % tr.world_size
    ids = contribution(compressor, flat, key, step)[0].to(torch.int32) if tr.rank == leader else None
    ids = (yield from broadcast_buf(tr, ids, leader, torch.int32, c.device)).long()
    vals = flat[ids]                 # (a copy: the all-reduce below sums it in place)
    sent = _dense(ids, vals, c)
    yield (yield from tr.all_reduce_program(vals, op="sum"))
    return _dense(ids, vals, c), sent


class Hierarchical:
    """Groups of m consecutive ranks, m = `sparse_group_size(n)` (about √n; the last group may be shorter)."""

    def __init__(self, tr):
        n = tr.world_size
        m = sparse_group_size(n)
        self.m = min(m, n - tr.rank // m * m)            # my group's size (the last may be shorter)
        glob = [tr.global_of(r) for r in range(n)]
        # made once, here: every rank creates every group (then the leaders'), in the same order
        groups = [dist.new_group(glob[g * m:(g + 1) * m]) for g in range(-(-n // m))]
        leaders = dist.new_group(glob[::m])
        share = dict(meter=tr.meter, clock=tr.clock, tracer=tr.tracer, network=tr.link, device=tr.device)
        self.group = Transport(group=groups[tr.rank // m], **share)
        self.contexts: dict = {}
        self.leaders = Transport(group=leaders, **share) if tr.rank % m == 0 else None

    def _ctx(self, compressor, c, key, step):
        """The payload context every rank knows (shape, dtype): from compressing zeros of c's shape, once."""
        k = (tuple(c.shape), c.dtype)
        if k not in self.contexts:
            self.contexts[k] = compressor.compress(torch.zeros_like(c), key, step).ctx
        return self.contexts[k]

    def __call__(self, tr, compressor, c, key, step):
        """(program) Dense inside the group, sparse between the leaders, broadcast back."""
        flat = c.reshape(-1)
        s = flat.clone()
        yield (yield from self.group.all_reduce_program(s, op="sum"))   # dense reduce inside the group
        blob = None
        if self.leaders is not None:
            payload = compressor.compress(s.view(c.shape), key, step)
            buf = wire.pack(payload.tensors)
            bufs = yield (yield from self.leaders.all_gather_program(buf))   # sparse exchange between leaders
            head = [len(bufs), self.leaders.rank, *[b.numel() for b in bufs]]
            blob = wire.pack([torch.tensor(head, dtype=torch.int64, device=c.device), *bufs])
        blob = yield from broadcast_buf(self.group, blob, 0, torch.uint8, c.device)   # the leader's bytes to all
        parts = wire.unpack(blob)
        count, mine = parts[0].tolist()[:2]          # host: once per exchange (how many payloads, which is mine)
        ctx = self._ctx(compressor, c, key, step)
        payloads = [Payload(ts, ctx) for ts in wire.unpack_all(parts[1:1 + count])]
        total = compressor.aggregate(payloads).reshape(-1).to(c.dtype)
        dg = compressor.decompress(payloads[mine]).reshape(-1).to(c.dtype)
        sel = dg != 0
        return total.view(c.shape), _dense(sel, flat[sel] + (dg[sel] - s[sel]) / self.m, c)


class SparseCollective:
    """The chosen sparse collective (one `check` passed) bound to a transport and a compressor: the program
    `program(c, key, step)` returns (total, sent)."""

    def __init__(self, name: str, transport, compressor):
        self.transport, self.compressor = transport, compressor
        self._impl = {"gtopk": gtopk, "shared": shared}.get(name) or Hierarchical(transport)

    def program(self, c: torch.Tensor, key, step: int):
        if self.transport.world_size == 1:
            d = self.compressor.decompress(self.compressor.compress(c, key, step)).to(c.dtype).view(c.shape)
            return d, d
        return (yield from self._impl(self.transport, self.compressor, c, key, step))
