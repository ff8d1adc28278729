"""`signum`: the sign of a momentum kept per tensor (seed 002 §5.1, Signum [56]: m_t = beta m_{t-1} + (1 - beta) g_t,
send sign(m_t)), combined by majority vote. Use it with plain SGD (no optimizer momentum): the momentum is here."""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors
from .base import Payload
from .finite import check_tensor
from .signsgd import SignSGD, sign_bits


@compressors.register("signum")
class Signum(SignSGD):
    """Packed sign bits of the momentum; `decompress` gives +-1."""

    name = "signum"

    def __init__(self, beta: float = 0.9):
        if not 0.0 <= beta < 1.0:
            raise UserError(f"signum: beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.momenta: dict = {}

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        check_tensor(flat, self.name, key)
        m = self.momenta.get(key)
        if m is None or m.shape != flat.shape:
            m = self.momenta[key] = flat.to(torch.float32) * (1.0 - self.beta)
        else:
            m.lerp_(flat.to(torch.float32), 1.0 - self.beta)   # beta m + (1 - beta) g in one pass
        return Payload([sign_bits(m)], ctx=(tensor.shape, tensor.dtype, flat.numel()))

    def state_dict(self):
        return {"momenta": dict(self.momenta)}

    def load_state_dict(self, state):
        self.momenta = dict(state.get("momenta", {}))
