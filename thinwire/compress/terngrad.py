"""`terngrad`: TernGrad (seed 002 §5.2.1, [63]): C(g_i) = s sign(g_i) b_i, b_i ~ Bernoulli(|g_i| / s), after clipping
g to +-c sigma (c = 2.5, sigma the tensor's standard deviation), so s = min(max|g|, c sigma). Ternary values travel
as 2-bit codes (4 per byte) plus one fp32 scale per tensor.

"allreduce" ("scaler sharing"): the ranks agree on the max of their scales, and the ternary values are summed in
an integer type wide enough for world_size of them (that type crosses the wire: 8 bits up to 127 ranks).
"allgather": each rank sends its packed codes and its own scale. "auto" (default): all-reduce unless the
all-gather sends fewer bytes at the world size (2-bit codes: gathered up to 7 ranks on a ring; `pick_collective`).

Bias: E[C(g)] is the *clipped* gradient clamp(g, −cσ, cσ), not g (TernGrad's own clipping, [63] §3.2): the
compressor is unbiased only with `clip=0`, and says so (`unbiased` is `clip == 0`). Clipping trades that bias
on the few outliers for a smaller scale s and so a smaller variance s·|g_i| − g_i² on every other element.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Compressor, Payload
from .bitpack import decode, pack, unpack
from .finite import check_scale
from .int8 import summed_level_bits, widen
from .rounding import Uniforms, stochastic_codes


@compressors.register("terngrad")
class TernGrad(Compressor):
    unbiased = False          # unbiased for the clipped gradient only: True with clip=0 (see the module docstring)
    linear = True
    randomness = "local"
    aggregation = "allreduce"
    fixed_size = True         # the payload size depends only on the shape
    pick_by_bytes = True

    def __init__(self, clip: float = 2.5, aggregation: str = "auto", seed: int = 0):
        if clip < 0:
            raise UserError(f"terngrad: clip (in standard deviations, 0 for none) must be >= 0, got {clip}")
        if aggregation not in ("auto", "allreduce", "allgather"):
            raise UserError(f"terngrad: aggregation must be one of auto, allreduce, allgather; got {aggregation!r}")
        self.clip = float(clip)
        self.unbiased = self.clip == 0
        self.aggregation = "allreduce" if aggregation == "auto" else aggregation
        self.pick_by_bytes = aggregation == "auto"
        self.uniforms = Uniforms(seed)

    def _scale(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() == 0:
            return torch.zeros(1, device=flat.device)
        lo, hi = torch.aminmax(flat)
        scale = torch.maximum(-lo, hi).float()
        n = flat.numel()
        if self.clip > 0 and n > 1:
            f = flat if flat.dtype == torch.float32 else flat.float()
            total, squares = f.sum().double(), torch.dot(f, f).double()   # two fast reductions (torch.std is slow)
            sigma = ((squares - total * total / n).clamp(min=0) / (n - 1)).sqrt().float()
            if bool(torch.isfinite(sigma)):      # (sums of squares of huge values overflow: then no clipping)
                scale = torch.minimum(scale, self.clip * sigma)
        return scale.reshape(1)

    def agree(self, tensor, key=None, step=0):
        return self._scale(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        scale = self._scale(flat) if agreed is None else agreed.float().reshape(1)
        check_scale(scale, self.name, key, flat)
        s = float(scale)
        codes = stochastic_codes(flat, 1.0 / s if s > 0 else 0.0, 1, self.uniforms, clip=True)
        packed = pack(codes, 2, inplace=True)
        ctx = {"shape": tensor.shape, "dtype": tensor.dtype, "numel": flat.numel(), "summed": False}
        if agreed is not None:
            ctx["scale"] = s          # agreed: every rank knows it (ctx never holds one rank's own data)
        return Payload([packed] if agreed is not None else [packed, scale], ctx=ctx)

    def sum_payload(self, payload, world_size):
        ctx = dict(payload.ctx, summed=True)
        codes = unpack(payload.tensors[0], 2, ctx["numel"])
        return Payload([widen(codes, max(2, world_size)).sub_(1)], ctx=ctx)

    def context(self, shape, dtype, key=None, step=0):
        # not agreed (the scale travels in the payload) and not summed
        return {"shape": torch.Size(shape), "dtype": dtype, "numel": torch.Size(shape).numel(), "summed": False}

    def decompress(self, payload):
        ctx = payload.ctx
        s = payload.tensors[1].reshape(()) if len(payload.tensors) > 1 else ctx["scale"]   # (kept on the device)
        if ctx["summed"]:
            out = payload.tensors[0].to(torch.float32).mul_(s)
        else:
            out = decode(payload.tensors[0], 2, ctx["numel"], (-1.0, 0.0, 1.0, 0.0), scale=s)   # (code - 1) s, by table
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def nominal_bits(self, numel, world_size=None):
        """Packed: 2-bit codes and the scale; at `world_size` ranks: what the exchange sends there."""
        if world_size is not None:
            return self.wire_bits(numel, world_size)[1]
        return 2.0 + 32.0 / max(numel, 1)

    def summed_bits(self, numel, world_size):
        return summed_level_bits(max(2, world_size)) + 32.0 / max(numel, 1)    # levels + the agreed scale

    def state_dict(self):
        return {"uniforms": self.uniforms.state_dict()}

    def load_state_dict(self, state):
        self.uniforms.load_state_dict(state["uniforms"])
