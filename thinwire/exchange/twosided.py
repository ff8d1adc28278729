"""`TwoSidedExchange`: the compressed all-reduce with error feedback on both sides, the worker's and the chunk
owner's (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
arXiv 2102.02888, Algorithm 1 and §4.1; the survey of Wang et al., "two-sided error feedback").

One `start(tensor, key, shapes)` on n ranks: each segment of the flat tensor (`segments`: a parameter of `shapes` of
at least 2^15 elements, or a run of smaller neighbours; without `shapes` the whole tensor) is cut into n chunks
(`tensor_split`: sizes differ by at most one element), chunk j of every segment owned by rank j, and every piece is
compressed on its own, with a scale of its own (DeepSpeed's compressed all-reduce takes one parameter at a time: a
large parameter's scale never mixes with another's; small ones share one call, as the compressor's fixed cost
per call would otherwise dominate on a CPU):

1. worker side: c = memory.compensate(x) (c = x + δ_w), each piece compressed (`compress(c_kj, (key, k, j))`),
   memory.update(c, the decoded pieces) (δ_w ← c − C(c));
2. the pieces of chunk j go to rank j, packed in one message (an all-to-all of point-to-point messages: n − 1
   messages of 1/n of the compressed tensor leave each rank);
3. server side, on rank j: the mean of the n decoded pieces of each parameter's chunk j, a = (1/n) Σ_i C(c_kj^i);
   s = a + δ_s (a second memory of the same kind, the owner's: `server`), compressed again piece by piece as
   `(key, "server", k, j)`, δ_s ← s − C(s);
4. an all-gather of the owners' payloads; every rank decodes all of them and puts the pieces back in place: the
   result, the same on every rank (a mean: no division left to do).

So 2(n − 1)/n of the compressed tensor leaves each rank, as a ring all-reduce sends of an uncompressed one. Any
compressor whose payload can be decoded alone can stand in for the 1 bit (`check_compressor`): the exchange decodes
another rank's payload of chunk j with its own context of chunk j (`Compressor.context`: what every rank knows).
A multi-round compressor ("custom": PowerSGD, the Count Sketch) cannot. With no compressor and no memory the
exchange is the plain all-reduce of `Exchange`. Bytes are the transport's: every message is metered as it leaves.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..comm.engine import Ready
from ..compress import Compressor, Payload
from ..errors import UserError
from . import wire
from .exchange import Exchange

TAG = 7300   # keeps this exchange's chunks apart from other point-to-point traffic
ALONE = 1 << 15   # a parameter this large is compressed with scales of its own (`segments`)


def check_compressor(compressor: Compressor, what: str) -> None:
    """A UserError (one line) where `compressor` cannot stand in for the 1 bit of a compressed all-reduce with
    two-sided error feedback: its payload must decode alone, one chunk at a time."""
    if compressor.aggregation == "custom":
        raise UserError(f"{what} compresses each chunk alone and decodes it on its owner; compressor "
                        f"{compressor.name!r} needs rounds summed over every rank: use onebit, signsgd, efsignsgd, "
                        f"topk, qsgd, int8, fp16 or fp8")


def segments(sizes: list[int], alone: int | None = None) -> list[int]:
    """The element counts of the pieces a flat tensor of parameters of `sizes` elements is compressed in: a
    parameter of at least `alone` elements on its own, each run of smaller neighbours together (biases and norms:
    fewer, larger calls to the compressor)."""
    alone = ALONE if alone is None else alone
    out, run = [], 0
    for k in sizes:
        if k >= alone:
            out += [run, k] if run else [k]
            run = 0
        else:
            run += k
    return out + [run] if run else out


def _split(tensors: list[torch.Tensor], like: list[Payload]) -> list[Payload]:
    """Another rank's tensors of several payloads packed one after the other, as payloads: `like` (this rank's
    payloads of the same pieces) gives each one's tensor count and context."""
    out, at = [], 0
    for p in like:
        k = len(p.tensors)
        out.append(Payload(tensors[at:at + k], p.ctx))
        at += k
    return out


class TwoSidedExchange(Exchange):
    """The mean over ranks of a tensor through the compressed all-reduce of the module docstring; the worker's
    error feedback is the exchange's `memory`, the chunk owner's a fresh copy of it (`server`)."""

    def __init__(self, transport, compressor="none", memory="none", **options):
        super().__init__(transport, compressor, memory, **options)
        check_compressor(self.compressor, "the compressed all-reduce")
        self.server = copy.deepcopy(self.memory)
        self.server.setup(transport.world_size)

    def program(self, tensor: torch.Tensor, key: Any = None, shapes=None, inplace: bool = False):
        """(program) What `start` submits. `shapes`: the parameters the flat tensor is made of (its `segments`)."""
        if self.identity:
            return (yield from super().program(tensor, key, shapes, inplace))
        x = tensor.detach()
        if x.numel() == 0:
            return Ready(x.clone())
        step = self._begin(x, key)
        tr, comp, n, me = self.transport, self.compressor, self.world_size, self.transport.rank
        sizes = segments([torch.Size(s).numel() for s in shapes] if shapes else [x.numel()])
        with tr.tracer.span("compress", "compress"):
            c = self.memory.compensate(x.reshape(-1), key)
            pieces = [part.tensor_split(n) for part in c.split(sizes)]       # [segment][owner]
            sent = [[comp.compress(ch, (key, k, j), step) for j, ch in enumerate(chunks)]
                    for k, chunks in enumerate(pieces)]
            if self._memory_updates:
                self.memory.update(c, key, torch.cat([comp.decompress(p).reshape(-1) for row in sent for p in row]))
            bufs = [wire.pack([t for row in sent for t in row[j].tensors]) for j in range(n)]
        got = yield from self._scatter(bufs)
        with tr.tracer.span("compress", "compress"):
            mine = [row[me] for row in sent]
            totals = [None] * len(mine)
            for ts in wire.unpack_all(got):     # rank order: every owner sums alike
                for k, payload in enumerate(_split(ts, mine)):
                    part = comp.decompress(payload).reshape(-1)
                    totals[k] = part.clone() if totals[k] is None else totals[k].add_(part)
            s = self.server.compensate(torch.cat(totals) / n, key)
            replies = [comp.compress(part, (key, "server", k, me), step)
                       for k, part in enumerate(s.split([p.numel() for p in totals]))]
            if self._memory_updates:
                self.server.update(s, key, torch.cat([comp.decompress(p).reshape(-1) for p in replies]))
            out = wire.pack([t for p in replies for t in p.tensors])
        fut = yield from tr.all_gather_program(out, sizes=[b.numel() for b in bufs] if comp.fixed_size else None)

        def finish(blocks):
            with tr.tracer.span("decompress", "compress"):
                parts = [[None] * n for _ in pieces]
                for j, ts in enumerate(wire.unpack_all(blocks)):
                    like = [Payload(p.tensors, comp.context(pieces[k][j].shape, x.dtype, (key, "server", k, j), step))
                            for k, p in enumerate(replies)]
                    for k, payload in enumerate(_split(ts, like)):
                        parts[k][j] = comp.decompress(payload).reshape(-1)
                return torch.cat([p for row in parts for p in row]).to(x.dtype).reshape(x.shape)
        return fut.then(finish)

    def _scatter(self, bufs: list[torch.Tensor]):
        """(program) Chunk j's buffer to rank j, in exchange for every rank's buffer of this rank's chunk (by rank;
        this rank's own kept); each size first where the compressor's payload size is not fixed."""
        tr, me = self.transport, self.transport.rank
        peers = [r for r in range(self.world_size) if r != me]
        if self.compressor.fixed_size:
            sizes = {r: bufs[me].numel() for r in peers}
        else:
            heads = {r: torch.empty(1, dtype=torch.int64, device=bufs[me].device) for r in peers}
            sent = [tr.isend(torch.tensor([bufs[r].numel()], dtype=torch.int64, device=bufs[r].device), r, tag=TAG)
                    for r in peers]
            for h in [tr.irecv(heads[r], r, tag=TAG) for r in peers] + sent:
                yield h
            sizes = dict(zip(peers, torch.cat([heads[r] for r in peers]).tolist())) if peers else {}   # host: once
        got = {r: torch.empty(sizes[r], dtype=torch.uint8, device=bufs[me].device) for r in peers}
        handles = [tr.isend(bufs[r], r, tag=TAG) for r in peers] + [tr.irecv(got[r], r, tag=TAG) for r in peers]
        for h in handles:
            yield h
        got[me] = bufs[me]
        return [got[r] for r in range(self.world_size)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "server": self.server.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.server.load_state_dict(state["server"])
