"""`bitsgd`: BIT-SGD, synchronous SGD on 2-bit quantized gradients with a residual (seed 001 §2.3, eq. 5).

W_{i+1} = W_i − η·mean_j Q_j(g_{i,j}) with g_{i,j} = ∇L_j(W_i): every iteration waits for its own compressed
exchange (T^bit = τ + δ + ψ). CD-SGD without the local update, the overlap and the correction steps.
"""
from __future__ import annotations

from . import register
from .base import Algorithm
from .cdsgd import CDSGD


@register("bitsgd")
class BitSGD(CDSGD):
    """BIT-SGD (seed 001 eq. 5): synchronous SGD on 2-bit threshold-quantized gradients with residual."""

    name = "bitsgd"
    local_update = False
    overlapped = False

    def __init__(self, architecture: str | None = None, servers: int = 0):
        Algorithm.__init__(self, architecture)
        self._configure(k=0, warmup=0, local_lr=None, servers=servers)
