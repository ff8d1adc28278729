"""`int8`: uniform 8-bit quantization scaled by the max-abs (seed 002 §5.1; GRACE's uniform variant of [54]):
q = round(127 g / max|g|) (or the unbiased stochastic rounding), D(q) = q max|g| / 127."""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Compressor, Payload, summed_itemsize
from .finite import check_scale
from .rounding import Uniforms, stochastic_codes

LEVELS = 127


def _maxabs(flat: torch.Tensor) -> torch.Tensor:
    if flat.numel() == 0:
        return torch.zeros(1, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return torch.maximum(-lo, hi).float().reshape(1)


def widened(total: int) -> torch.dtype:
    """The narrowest signed integer type holding every value in [-total, total]."""
    return torch.int8 if total <= 127 else torch.int16 if total <= 32767 else torch.int32


def widen(levels: torch.Tensor, total: int) -> torch.Tensor:
    """Integer `levels` in the narrowest signed type holding every value in [-total, total]: for a sum of
    world_size levels in [-s, s], total = world_size * s (this type, as gloo sums it, is what all-reduce puts on
    the wire: `summed_level_bits`)."""
    return levels.to(widened(total))


def summed_level_bits(total: int) -> int:
    """Bits per level on the wire when levels summing to at most `total` are all-reduced (gloo: int16 as int32)."""
    return 8 * summed_itemsize(widened(total))


@compressors.register("int8")
class Int8(Compressor):
    """8 bits per element plus one fp32 scale. "allgather": each rank sends its int8 levels and its own scale
    ((n−1)·8 bits per element leave each rank on a ring). "allreduce": the ranks agree on the largest max-abs and
    the levels are summed in a widened integer type; the sum of two ranks already needs int16, which gloo sums as
    int32 (2(n−1)/n·32 bits per element). "auto" (default): all-gather, all-reduce where that sends fewer bytes
    (from 8 ranks on a ring: `pick_collective`)."""

    unbiased = False
    linear = True
    randomness = "none"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape
    pick_by_bytes = True

    def __init__(self, stochastic: bool = False, aggregation: str = "auto", seed: int = 0):
        if aggregation not in ("auto", "allreduce", "allgather"):
            raise UserError(f"int8: aggregation must be one of auto, allreduce, allgather; got {aggregation!r}")
        self.stochastic = bool(stochastic)
        self.aggregation = "allgather" if aggregation == "auto" else aggregation
        self.pick_by_bytes = aggregation == "auto"
        self.unbiased = self.stochastic
        self.randomness = "local" if self.stochastic else "none"
        self.uniforms = Uniforms(seed)
        self._scratch = torch.empty(0, device="cpu")     # regrown on the gradient's device

    def agree(self, tensor, key=None, step=0):
        return _maxabs(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        scale = _maxabs(flat) if agreed is None else agreed.float().reshape(1)
        check_scale(scale, self.name, key, flat)
        s = float(scale)
        inv = LEVELS / s if s > 0 else 0.0
        if self.stochastic:
            q = stochastic_codes(flat, inv, LEVELS, self.uniforms).sub_(LEVELS).view(torch.int8)
        else:
            if flat.dtype != torch.float32:
                flat = flat.float()
            if self._scratch.numel() < flat.numel() or self._scratch.device != flat.device:       # a reused temporary: fresh 4n-byte tensors page-fault
                self._scratch = torch.empty(flat.numel(), device=flat.device)
            q = torch.mul(flat, inv, out=self._scratch[: flat.numel()]).round_().to(torch.int8)
        tensors = [q] if agreed is not None else [q, scale]
        ctx = {"shape": tensor.shape, "dtype": tensor.dtype}
        if agreed is not None:
            ctx["scale"] = s          # agreed: every rank knows it (ctx never holds one rank's own data)
        return Payload(tensors, ctx=ctx)

    def sum_payload(self, payload, world_size):
        return Payload([widen(payload.tensors[0], LEVELS * world_size)], ctx=payload.ctx)

    def context(self, shape, dtype, key=None, step=0):
        return {"shape": torch.Size(shape), "dtype": dtype}      # not agreed: the scale travels in the payload

    def decompress(self, payload):
        ctx = payload.ctx
        if len(payload.tensors) > 1:      # the payload's scale, kept on the device: s / LEVELS in float64, as a number
            step = (payload.tensors[1].reshape(()).double() / LEVELS).to(torch.float32)
        else:
            step = ctx["scale"] / LEVELS
        out = payload.tensors[0].to(torch.float32).mul_(step)
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def nominal_bits(self, numel, world_size=None):
        """Packed: 8 bits per element and the scale; at `world_size` ranks: what the exchange sends there."""
        if world_size is not None:
            return self.wire_bits(numel, world_size)[1]
        return 8.0 + 32.0 / max(numel, 1)

    def summed_bits(self, numel, world_size):
        return summed_level_bits(LEVELS * world_size) + 32.0 / max(numel, 1)     # levels + the agreed max-abs

    def state_dict(self):
        return {"uniforms": self.uniforms.state_dict()}

    def load_state_dict(self, state):
        self.uniforms.load_state_dict(state["uniforms"])
