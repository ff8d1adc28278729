"""Every thinwire compressor as a PyTorch DDP communication hook, in one line:

    model = DistributedDataParallel(net)
    model.register_comm_hook(*tw.ddp_hook("topk", memory="residual", ratio=0.01))

`ddp_hook` returns `(state, hook)`, the two arguments `register_comm_hook` takes. The hook runs one
`Exchange` per DDP bucket (key = the bucket's index and size; the bucket's parameter shapes are passed on, so
PowerSGD compresses each weight matrix and sends biases uncompressed), through a thinwire `Transport` on DDP's
process group, so bytes are metered (`state.meter`) and the emulated network applies. The hook returns an
already-completed future: the exchange runs when DDP hands over the bucket, so thinwire's emulated delays are
really spent inside backward (overlapped with the remaining backward work only as far as DDP's own bucket
order allows). DDP rebuilds its buckets after the first iteration; their new keys start with fresh memory.
"""
from __future__ import annotations

import torch

from ..compress import compressors, memories
from ..errors import UserError
from .exchange import Exchange


class HookState:
    """What the hook keeps between calls: its Exchange (built on first use, on DDP's process group)."""

    def __init__(self, compressor, memory, process_group=None, network=None, collective="auto",
                 check_finite=True):
        self.compressor, self.memory = compressor, memory
        self.process_group, self.network = process_group, network
        self.collective, self.check_finite = collective, check_finite
        self.exchange: Exchange | None = None

    def get_exchange(self) -> Exchange:
        if self.exchange is None:
            from ..comm import Transport
            transport = Transport(group=self.process_group, network=self.network)
            self.exchange = Exchange(transport, self.compressor, self.memory, collective=self.collective,
                                     check_finite=self.check_finite)
        return self.exchange

    @property
    def meter(self):
        return self.get_exchange().transport.meter

    def state_dict(self) -> dict:
        return self.get_exchange().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.get_exchange().load_state_dict(state)


def thinwire_hook(state, bucket):
    """DDP comm hook: the mean of the bucket over ranks, through the state's compressor and memory."""
    buf = bucket.buffer()
    shapes = [tuple(p.shape) for p in bucket.parameters()]
    if sum(int(torch.Size(s).numel()) for s in shapes) != buf.numel():
        shapes = None
    mean = state.get_exchange().aggregate(buf, key=("bucket", bucket.index(), buf.numel()), shapes=shapes)
    fut = torch.futures.Future()
    fut.set_result(mean)
    return fut


# DDP checks the hook's annotations as objects (this module's are strings under `from __future__`)
thinwire_hook.__annotations__ = {"return": torch.futures.Future[torch.Tensor]}


def ddp_hook(compressor="none", memory="none", process_group=None, network=None, collective: str = "auto",
             check_finite: bool = True, **params):
    """`(state, hook)` for `DistributedDataParallel.register_comm_hook`; `params` go to the compressor and the
    memory by name (e.g. `ratio=0.01`, `rank=4`, `momentum=0.9`); an unknown one is a UserError."""
    comp_params, mem_params = {}, {}
    for key, value in params.items():
        takers = []
        if isinstance(compressor, str) and compressors.accepts(compressor, key):
            comp_params[key] = value
            takers.append("compressor")
        if isinstance(memory, str) and memories.accepts(memory, key):
            mem_params[key] = value
            takers.append("memory")
        if not takers:
            valid = sorted(set((compressors.parameters(compressor) if isinstance(compressor, str) else {}))
                           | set((memories.parameters(memory) if isinstance(memory, str) else {})))
            raise UserError(f"unknown parameter {key!r} for compressor {compressor!r}, memory {memory!r}; "
                            f"valid: {', '.join(valid) or 'none'}")
    comp = compressors.get(compressor, **comp_params)
    mem = memories.get(memory, **mem_params)
    state = HookState(comp, mem, process_group, network, collective, check_finite)
    # fail at construction, not at the first backward, on a collective the algebra does not allow
    from .exchange import allowed_collectives
    if collective != "auto" and collective not in allowed_collectives(comp):
        raise UserError(f"compressor {comp.name!r} cannot use collective {collective!r}; "
                        f"valid: {', '.join(allowed_collectives(comp))}")
    return state, thinwire_hook
