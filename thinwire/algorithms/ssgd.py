"""`ssgd`: S-SGD as seed 001 names it (eq. 1), the baseline of its comparison set.

The same update as `bsp` (W_{i+1} = W_i − η·mean_j ∇L_j(W_i), full precision, synchronous); what it adds is
the time model of seed 001 §3.3: it measures τ and φ on its own run and reports T^ssgd = τ + φ (eq. 2), and the
OD-SGD prediction max(τ, φ), beside the measured iteration time in `metrics()`.
"""
from __future__ import annotations

from . import register
from .base import Algorithm
from .cdsgd import CDSGD


@register("ssgd")
class SSGD(CDSGD):
    """S-SGD (seed 001 eq. 1): bsp with seed 001's time model measured and predicted in its metrics."""

    name = "ssgd"
    compression = False
    default_compressor = "none"
    default_memory = "none"
    local_update = False
    overlapped = False

    def __init__(self, architecture: str | None = None, servers: int = 0):
        Algorithm.__init__(self, architecture)
        self._configure(k=1, warmup=0, local_lr=None, servers=servers)
