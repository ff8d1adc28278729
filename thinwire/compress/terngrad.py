"""`terngrad`: TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li 2017, "TernGrad: Ternary Gradients to Reduce
Communication in Distributed Deep Learning", arXiv 1705.07878): C(g_i) = s sign(g_i) b_i, b_i ~ Bernoulli(|g_i| / s),
after clipping g to +-c sigma (c = 2.5, sigma the tensor's standard deviation), so s = min(max|g|, c sigma). Ternary
values travel as 2-bit codes (4 per byte) plus one fp32 scale per tensor.

"allreduce" ("scaler sharing"): the ranks agree on the max of their scales and sum the ternary values in an integer
type wide enough for world_size of them (8 bits up to 127 ranks); "allgather": each rank's codes and own scale
(chosen up to 7 ranks on a ring: `thinwire.exchange.choose`). E[C(g)] is the *clipped* gradient clamp(g, −cσ, cσ)
(Wen et al. §3.2), so `unbiased` is `clip == 0`: clipping trades that bias on the few outliers for a smaller scale
s, so a smaller variance s·|g_i| − g_i² on every other element.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Payload
from .bitpack import decode, unpack
from .finite import check_scale
from .int8 import ScaledLevels, maxabs, widened
from .rounding import stochastic_codes


@compressors.register("terngrad")
class TernGrad(ScaledLevels):
    unbiased = False          # unbiased for the clipped gradient only: True with clip=0 (see the module docstring)
    randomness = "local"
    x_memcpy = 7.0

    def __init__(self, clip: float = 2.5, seed: int = 0):
        if clip < 0:
            raise UserError(f"terngrad: clip (in standard deviations, 0 for none) must be >= 0, got {clip}")
        super().__init__(seed)
        self.clip = float(clip)
        self.unbiased = self.clip == 0

    def _scale(self, flat: torch.Tensor) -> torch.Tensor:
        scale = maxabs(flat)
        n = flat.numel()
        if self.clip > 0 and n > 1:
            f = flat if flat.dtype == torch.float32 else flat.float()
            total, squares = f.sum().double(), torch.dot(f, f).double()   # two fast reductions (torch.std is slow)
            sigma = ((squares - total * total / n).clamp(min=0) / (n - 1)).sqrt().float()
            # (sums of squares of huge values overflow: then no clipping; decided on the device)
            scale = torch.where(torch.isfinite(sigma), torch.minimum(scale, self.clip * sigma), scale)
        return scale

    def agree(self, tensor, key=None, step=0):
        return self._scale(tensor.reshape(-1))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        scale = self._scale(flat) if agreed is None else agreed.float().reshape(1)
        check_scale(scale, self.name, key, flat)
        inv = torch.where(scale > 0, 1.0 / scale.double(), 0.0).float()          # (1/s in float64, as a number was)
        packed = stochastic_codes(flat, inv, 1, self.uniforms, clip=True, bits=2)
        return self._payload(packed, scale, tensor, agreed, {"scale": scale.reshape(())})

    def sum_payload(self, payload, world_size):
        ctx = dict(payload.ctx, summed=True)
        codes = unpack(payload.tensors[0], 2, ctx["numel"])
        return Payload([codes.to(widened(max(2, world_size))).sub_(1)], ctx=ctx)

    def decompress(self, payload):
        ctx = payload.ctx
        s = payload.tensors[1].reshape(()) if len(payload.tensors) > 1 else ctx["scale"]   # (kept on the device)
        if ctx["summed"]:
            out = payload.tensors[0].to(torch.float32).mul_(s)
        else:
            out = decode(payload.tensors[0], 2, ctx["numel"], (-1.0, 0.0, 1.0, 0.0), scale=s)   # (code - 1) s, by table
        return out.to(ctx["dtype"]).view(ctx["shape"])

    def packed_bits(self, numel):
        return 2.0 + 32.0 / max(numel, 1)       # 2-bit codes and the scale

    def sum_dtypes(self, numel, world_size):
        return [(widened(max(2, world_size)), 1, 1), (torch.float32, 1, max(numel, 1))]   # levels + the agreed scale
