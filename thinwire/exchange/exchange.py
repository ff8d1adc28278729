"""`Exchange`: the averaged value of one tensor across ranks, through a compressor and its memory."""
from __future__ import annotations

from typing import Any

import torch

from ..comm import Handle, Transport
from ..compress import Compressor, Memory, compressors, memories
from ..errors import UserError


class _Done:
    """A finished exchange (a result computed without waiting on the wire)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value

    def is_completed(self):
        return True


class Exchange:
    """Average tensors across the ranks of `transport`, compressed.

    `start(tensor, key)` launches the exchange and returns a handle whose `wait()` gives the mean over ranks
    of the (decompressed) contributions, same shape as `tensor`. `key` names the tensor (a parameter, a bucket
    or the whole model) so per-tensor state (residuals, PowerSGD's Q, shared random seeds) follows it.
    """

    def __init__(self, transport: Transport, compressor: "str | Compressor" = "none",
                 memory: "str | Memory" = "none", **params):
        self.transport = transport
        self.compressor = compressors.get(compressor) if isinstance(compressor, str) else compressor
        self.memory = memories.get(memory) if isinstance(memory, str) else memory
        if params:
            raise UserError(f"unexpected exchange parameters: {sorted(params)}")
        if self.compressor.aggregation != "allreduce" or self.compressor.name != "none":
            raise UserError(f"compressor {self.compressor.name!r} is not supported by this exchange yet")
        self.step = 0

    def start(self, tensor: torch.Tensor, key: Any = None):
        out = tensor.detach().clone()
        return self.transport.all_reduce(out, op="mean", async_op=True)

    def aggregate(self, tensor: torch.Tensor, key: Any = None) -> torch.Tensor:
        return self.start(tensor, key).wait()

    def state_dict(self) -> dict:
        return {"step": self.step, "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
