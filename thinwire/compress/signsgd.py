"""`signsgd`: one bit per element, the sign (Bernstein, Wang, Azizzadenesheli, Anandkumar
2018, "signSGD: Compressed Optimisation for Non-Convex Problems", arXiv 1802.04434; majority vote:
Bernstein, Zhao, Azizzadenesheli, Anandkumar 2019, arXiv 1810.05291: C(g) = 1[g >= 0], D(b) = 2b - 1),
combined across ranks by majority vote, scaled by default by the ranks' mean ‖g‖₁/d (see `SignSGD`). Zero counts as
positive (ties go to +1, as in GRACE)."""
from __future__ import annotations

import torch

from . import compressors
from .base import Compressor, Payload, cast_back
from .bitpack import decode, pack_signs
from ..errors import UserError
from .finite import check_scale, check_tensor


def signs(bits: torch.Tensor, numel: int, scale=1.0) -> torch.Tensor:
    """fp32 tensor of scale * (2b - 1) from packed bits (a table lookup per byte); `scale` a number or a
    one-element tensor (kept on the device)."""
    return decode(bits, 1, numel, (-1.0, 1.0), scale=scale)


@compressors.register("signsgd")
class SignSGD(Compressor):
    """Packed sign bits and (`scale=True`) one fp32 scale ‖x‖₁/d: the exchange takes the majority vote times the
    ranks' mean scale; `decompress` gives scale·(±1). The scale is EF-SignSGD's (Karimireddy et al. 2019, arXiv
    1901.09847, Alg. 1: C(p) = (‖p‖₁/d) sign(p)): a sign step then has the gradient's mean magnitude, so the
    learning rate means what it means for SGD, and `residual` error feedback is bounded (‖C(p) − p‖² = ‖p‖² −
    ‖p‖₁²/d). Without it (`scale=False`, as Bernstein et al. 2018/2019 print it: x ← x − η sign(Σ sign g)) every
    coordinate moves by the full learning rate each step: an SGD rate is orders of magnitude too large."""

    unbiased = False
    linear = False
    aggregation = "majority"
    fixed_size = True         # the payload size depends only on the shape
    needs_momentum_first = True
    x_memcpy = 4.0

    def __init__(self, scale: bool = True):
        if not isinstance(scale, bool):
            raise UserError(f"{self.name}: scale must be true or false, got {scale!r}")
        self.scale = scale

    def payload(self, flat: torch.Tensor, shape, dtype, key=None) -> Payload:
        """The sign bits of `flat` (and its scale ‖flat‖₁/d)."""
        if not self.scale:
            return Payload([pack_signs(flat)[0]], ctx=(shape, dtype, flat.numel()))   # the bits 1[x >= 0]
        return self.scaled(*pack_signs(flat, stats=1), flat, shape, dtype, key)    # (‖x‖₁ from the same pass)

    def scaled(self, bits: torch.Tensor, l1: torch.Tensor, flat: torch.Tensor, shape, dtype, key) -> Payload:
        """The payload of sign `bits` and the scale ‖flat‖₁/d from `l1` = ‖flat‖₁ (float64, checked finite)."""
        check_scale(l1, self.name, key, flat)
        return Payload([bits, (l1 / max(flat.numel(), 1)).float().reshape(1)], ctx=(shape, dtype, flat.numel()))

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        if not self.scale:        # (the scale's check in `payload` catches NaN/Inf)
            check_tensor(flat, self.name, key)
        return self.payload(flat, tensor.shape, tensor.dtype, key)

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        s = payload.tensors[1] if self.scale else 1.0
        return cast_back(signs(payload.tensors[0], n, s), dtype).view(shape)

    def vote(self, payloads):
        """sign(Σ_ranks sign_r) · (1/R) Σ_r scale_r: the majority vote with the ranks' mean scale."""
        shape, dtype, n = payloads[0].ctx
        total = signs(payloads[0].tensors[0], n)           # a fresh tensor (a table lookup)
        for p in payloads[1:]:
            total += signs(p.tensors[0], n)
        total.sign_()
        if self.scale:        # the mean scale, kept on the device
            total.mul_(torch.stack([p.tensors[1].reshape(()) for p in payloads]).mean())
        return cast_back(total, dtype).view(shape)

    def nominal_bits(self, numel):
        return 1.0 + (32.0 / max(numel, 1) if self.scale else 0.0)
