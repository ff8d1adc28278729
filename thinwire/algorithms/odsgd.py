"""`odsgd`: OD-SGD, the local update mechanism without compression (seed 001 §2.2, eqs. 3–4; its ref. [38]).

W^loc_{i+1,j} = W_i − η_loc·g_{i,j} lets iteration i+1 start at once; the full-precision exchange and
W_{i+1} = W_i − η·mean_j g_{i,j} run in the background (T^loc = max(τ, φ)). CD-SGD with every iteration a
correction step (k = 1), with the same warm-up.
"""
from __future__ import annotations

from . import register
from .base import Algorithm
from .cdsgd import CDSGD


@register("odsgd")
class ODSGD(CDSGD):
    """OD-SGD (seed 001 eq. 4): local update overlapping the full-precision exchange; no compression."""

    name = "odsgd"
    compression = False
    default_compressor = "none"
    default_memory = "none"

    def __init__(self, architecture: str | None = None, warmup: int = 10, local_lr: float | None = None,
                 servers: int = 0, local_momentum: bool = True):
        Algorithm.__init__(self, architecture)
        self._configure(k=1, warmup=warmup, local_lr=local_lr, servers=servers, local_momentum=local_momentum)
