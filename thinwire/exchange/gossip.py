"""`NeighborExchange`: one tensor, compressed, to some ranks and from others (gossip), as a program on the engine.

`start(tensor, key, dsts, srcs)` returns a future at once (`thinwire.comm.engine`) of a dict {rank: tensor}: for
each rank of `srcs` the tensor it sent, decompressed, and under this rank's own number what the others receive
from it (its decompressed contribution: CHOCO-SGD's `q`). The flow is the `Exchange`'s with point-to-point messages
in place of the collective: compensate → compress → update (CHOCO passes no memory: its public copies are its
error feedback); the payload as ONE uint8 buffer (`exchange/wire.py`), its size (one int64) first unless the
compressor is `fixed_size`; `isend` to every rank of `dsts`, `irecv` from every rank of `srcs`; decompression when
the result is first asked for. No scale agreement (a neighbour's payload carries its own scale); compressors whose
rounds are summed over every rank (PowerSGD) or that ask for a sparse collective are refused. Nothing compressed
or remembered: the tensor itself travels, no header.

Deadlock-free as long as every rank submits its neighbour exchanges in the same order with matching `dsts` and
`srcs` (j is in i's `dsts` exactly when i is in j's `srcs`): all sends of a program are posted before it waits
for anything, and programs run in submission order.
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm.engine import Future
from ..compress import Payload
from ..errors import UserError
from . import wire
from .exchange import Exchange

TAG = 7200   # keeps gossip messages apart from the point-to-point collectives' (comm/collectives.py TAG)


class AllOf(Future):
    """The futures' results, once every one completed."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def result(self) -> list:
        return [f.result() for f in self.futures]

    def is_completed(self) -> bool:
        return all(f.is_completed() for f in self.futures)


class NeighborExchange(Exchange):
    """Send a (compressed) tensor to `dsts` and receive theirs from `srcs`; compressor and memory state (per
    key), step counters, `state_dict`/`rekey` as for the `Exchange` it extends."""

    def __init__(self, transport, compressor="none", memory="none", **options):
        super().__init__(transport, compressor, memory, **options)
        if self.collective == "custom" or self.sparse is not None:
            what = ("rounds summed over every rank" if self.collective == "custom"
                    else "a sparse collective over every rank")
            raise UserError(f"compressor {self.compressor.name!r} needs {what} and cannot be sent to neighbours; "
                            "use a payload compressor (e.g. topk, randomk, qsgd, int8, fp16, signsgd)")

    def start(self, tensor: torch.Tensor, key: Any = None, dsts=(), srcs=()):
        """{rank: tensor} for `srcs` and this rank (a future; see the module docstring)."""
        return self.transport.run(self.program(tensor, key, list(dsts), list(srcs)), label="gossip",
                                  background=self.background, serial=self.serial)

    def program(self, tensor: torch.Tensor, key: Any = None, dsts=(), srcs=()):
        """(program) What `start` submits."""
        tr, comp, me = self.transport, self.compressor, self.transport.rank
        x = tensor.detach()
        step = self._begin(x, key)
        if self.identity:
            send = x.contiguous()
            got = {s: torch.empty_like(send) for s in srcs}
            hs = [tr.isend(send, d, tag=TAG) for d in dsts] + [tr.irecv(got[s], s, tag=TAG) for s in srcs]
            return AllOf(hs).then(lambda _: {me: x, **got})
        with tr.tracer.span("compress", "compress"):
            c = self.memory.compensate(x, key)
            payload = comp.compress(c, key, step)
            own = comp.decompress(payload)
            if self._memory_updates:
                self.memory.update(c, key, own)
            buf = wire.pack(payload.tensors)
        hs = []
        if comp.fixed_size:
            sizes = {s: buf.numel() for s in srcs}
        else:   # sizes first: one int64 per neighbour, then the payloads
            mine = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
            heads = {s: torch.empty(1, dtype=torch.int64, device=buf.device) for s in srcs}
            hs += [tr.isend(mine, d, tag=TAG) for d in dsts]
            for h in [tr.irecv(heads[s], s, tag=TAG) for s in srcs]:
                yield h
            got = torch.cat([heads[s] for s in srcs]).tolist() if srcs else []   # host: once per exchange
            sizes = dict(zip(srcs, got))
        bufs = {s: torch.empty(sizes[s], dtype=torch.uint8, device=buf.device) for s in srcs}
        hs += [tr.isend(buf, d, tag=TAG) for d in dsts] + [tr.irecv(bufs[s], s, tag=TAG) for s in srcs]

        def finish(_):
            with tr.tracer.span("decompress", "compress"):
                out = {me: own.to(x.dtype).reshape(x.shape)}
                for s, ts in zip(srcs, wire.unpack_all([bufs[s] for s in srcs])):
                    out[s] = comp.decompress(Payload(ts, payload.ctx)).to(x.dtype).reshape(x.shape)
                return out
        return AllOf(hs).then(finish)
