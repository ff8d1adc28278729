"""`signum`: the sign of a momentum kept per tensor (Signum: Bernstein, Wang, Azizzadenesheli, Anandkumar 2018,
"signSGD: Compressed Optimisation for Non-Convex Problems", arXiv 1802.04434: send sign(m_t)), combined by majority
vote and scaled as `signsgd` is (the ranks' mean ‖m‖₁/d).

The momentum is heavy ball's, m_t = β m_{t−1} + g_t, not Signum's dampened β m_{t−1} + (1 − β) g_t: the sign is the
same, and the undampened scale makes a step lr·(‖m‖₁/d)·sign(m) as large as heavy-ball SGD's lr·m. It takes the
training's momentum (`Memory` in compress/base.py, "Momentum"): `beta` unset is the optimizer's where gradients are
exchanged (handed over by the Trainer), else 0 (a momentum of model differences, CHOCO's x − x̂, or on top of an
algorithm's own momentum diverged: NaN at step 242 under choco)."""
from __future__ import annotations

import torch

from . import compressors
from .base import Payload, optional_momentum
from .bitpack import GROUP, sign_kernel
from .finite import check_tensor
from .kernels import blockwise
from .signsgd import SignSGD


@compressors.register("signum")
class Signum(SignSGD):
    """Packed sign bits of the momentum (and its scale); `decompress` gives scale·(±1)."""

    takes_momentum = True
    needs_momentum_first = False      # without momentum it is a scaled majority sign (no error feedback to wind up)
    default_momentum = 0.0    # not handed over: the algorithm exchanges model differences or applies its own
    state_attrs = ("momenta",)
    x_memcpy = 4.0

    def __init__(self, beta: float | None = None, scale: bool = True):
        self.momentum = optional_momentum(beta, "signum: beta")
        super().__init__(scale)
        self.momenta: dict = {}

    @property
    def beta(self) -> float:
        return self.default_momentum if self.momentum is None else self.momentum

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        check_tensor(flat, self.name, key)
        m = self.momenta.get(key)
        if m is None or m.shape != flat.shape:
            m = self.momenta[key] = flat.to(torch.float32).clone()
            return self.payload(m, tensor.shape, tensor.dtype, key)
        # m ← β m + g, its sign bits and ‖m‖₁ in one pass (block by block on the CPU, compiled on a GPU)
        bits, l1 = blockwise(momentum_kernel, flat.numel(), [(m, (1, 1)), (flat, (1, 1))], [(1, 8), (1, GROUP)],
                             self.beta, align=GROUP)
        if not self.scale:
            return Payload([bits], ctx=(tensor.shape, tensor.dtype, flat.numel()))
        return self.scaled(bits, l1.sum(dtype=torch.float64), m, tensor.shape, tensor.dtype, key)


def momentum_kernel(m: torch.Tensor, g: torch.Tensor, beta: float):
    """m ← β m + g in place on a block, then its sign kernel (bits, each group's sum of |m|): Signum's kernel."""
    if beta == 0:
        m.copy_(g)            # (β m + g is g for the finite m the check keeps)
    else:
        m.mul_(beta).add_(g)
    return sign_kernel(m, 1)
