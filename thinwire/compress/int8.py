"""`int8`: uniform 8-bit quantization scaled by the max-abs (GRACE's uniform variant of Dettmers 2016, "8-Bit
Approximations for Parallelism in Deep Learning", arXiv 1511.04561):
q = round(127 g / max|g|) (or the unbiased stochastic rounding), D(q) = q max|g| / 127."""
from __future__ import annotations

import torch

from . import compressors
from .base import Payload, reused
from .finite import check_scale
from .kernels import fresh, fused
from .rounding import Stochastic, stochastic_codes

LEVELS = 127


def maxabs(flat: torch.Tensor, empty: int = 1) -> torch.Tensor:
    """max |flat| as a one-element fp32 tensor (one min-max pass); `empty` zeros for an empty tensor."""
    if flat.numel() == 0:
        return torch.zeros(empty, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return torch.maximum(-lo, hi).float().reshape(1)


def widened(total: int) -> torch.dtype:
    """The narrowest signed integer type holding every value in [-total, total]: for a sum of world_size levels
    in [-s, s], total = world_size * s (the type `sum_payload` gives and `sum_dtypes` declares)."""
    return torch.int8 if total <= 127 else torch.int16 if total <= 32767 else torch.int32


@fused
def _levels(flat: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """round(x · 127/s) as int8: one pass, compiled on a GPU (on the CPU `Int8.compress` works in place)."""
    return torch.round(flat.float() * inv).to(torch.int8)


@fused
def _dequantize(q: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """q · s/127 in fp32: one pass, compiled on a GPU."""
    return q.to(torch.float32) * step


class ScaledLevels(Stochastic):
    """Integer levels times fp32 scales (int8, qsgd, terngrad), linear: summed, the levels add (widened by
    `sum_payload`) under scales the ranks agree on first; gathered, each rank sends its codes and own scales. The
    exchange takes the class's natural collective unless the other sends fewer bytes (`pick_by_bytes`), or the
    one its `collective` names (`thinwire.exchange.choose`)."""

    fixed_size = True         # the payload size depends only on the shape
    pick_by_bytes = True

    def context(self, shape, dtype, key=None, step=0):
        # qsgd's and terngrad's ctx, not agreed (the scale travels in the payload) and not summed (`sum_payload`)
        return {"shape": torch.Size(shape), "dtype": dtype, "numel": torch.Size(shape).numel(), "summed": False}

    def _payload(self, codes: torch.Tensor, scale: torch.Tensor, tensor: torch.Tensor, agreed, known: dict) -> Payload:
        """The payload of `codes` under `scale`: its own scale travels with them; an agreed one goes in ctx as
        `known` instead (every rank knows it: ctx never holds one rank's own data)."""
        ctx = self.context(tensor.shape, tensor.dtype)
        return Payload([codes, scale], ctx=ctx) if agreed is None else Payload([codes], ctx={**ctx, **known})

    def nominal_bits(self, numel):
        """Packed (`packed_bits`: the codes and the scales); summed, `sum_dtypes`."""
        return self.packed_bits(numel)

    def packed_bits(self, numel: int) -> float:
        """Bits per element of a packed payload (codes and scales); every subclass defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define packed_bits")


@compressors.register("int8")
class Int8(ScaledLevels):
    """8 bits per element plus one fp32 scale. "allgather": each rank sends its int8 levels and its own scale
    ((n−1)·8 bits per element leave each rank on a ring). "allreduce": the ranks agree on the largest max-abs and
    the levels are summed in a widened integer type; the sum of two ranks already needs int16, which gloo sums as
    int32 (2(n−1)/n·32 bits per element). The exchange's `collective="auto"` (default): all-gather, all-reduce
    where that sends fewer bytes (from 8 ranks on a ring: `thinwire.exchange.choose`)."""

    unbiased = False
    aggregation = "allgather"
    x_memcpy = 4.0

    def __init__(self, stochastic: bool = False, seed: int = 0):
        super().__init__(seed)
        self.stochastic = bool(stochastic)
        self.unbiased = self.stochastic
        self.randomness = "local" if self.stochastic else "none"
        self._scratch = torch.empty(0, device="cpu")     # regrown on the gradient's device

    def agree(self, tensor, key=None, step=0):
        return maxabs(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        scale = maxabs(flat) if agreed is None else agreed.float().reshape(1)
        check_scale(scale, self.name, key, flat)
        inv = torch.where(scale > 0, LEVELS / scale.double(), 0.0).float()      # (127/s in float64, as a number was)
        if self.stochastic:
            q = stochastic_codes(flat, inv, LEVELS, self.uniforms).sub_(LEVELS).view(torch.int8)
        elif flat.device.type != "cpu":
            q = _levels(flat, inv.reshape(()))
        else:
            flat = flat.float()
            self._scratch, out = reused(self._scratch, flat.numel(), flat.device)
            q = torch.mul(flat, inv.reshape(()), out=out).round_().to(torch.int8)
        return self._payload(q, scale, tensor, agreed, {"scale": scale.reshape(())})

    def sum_payload(self, payload, world_size):
        return Payload([payload.tensors[0].to(widened(LEVELS * world_size))], ctx=payload.ctx)

    def context(self, shape, dtype, key=None, step=0):
        return {"shape": torch.Size(shape), "dtype": dtype}      # not agreed: the scale travels in the payload

    def decompress(self, payload):
        ctx = payload.ctx
        if len(payload.tensors) > 1:      # the payload's scale, kept on the device: s / LEVELS in float64, as a number
            step = (payload.tensors[1].reshape(()).double() / LEVELS).to(torch.float32)
        else:
            step = (ctx["scale"].double() / LEVELS).to(torch.float32)          # (the agreed scale, on the device)
        q = payload.tensors[0]
        if q.device.type != "cpu":
            return _dequantize(q, step.reshape(())).to(ctx["dtype"]).view(ctx["shape"])
        out = fresh(q.shape, torch.float32, q.device).copy_(q).mul_(step)     # (a fresh output on huge pages)
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def packed_bits(self, numel):
        return 8.0 + 32.0 / max(numel, 1)       # 8 bits per element and the scale

    def sum_dtypes(self, numel, world_size):
        return [(widened(LEVELS * world_size), 1, 1), (torch.float32, 1, max(numel, 1))]   # levels + the agreed max-abs
