"""`local`: every worker trains alone, with no communication at all.

The no-communication limit: its throughput is what the same workers reach on this machine when the wire costs
nothing, so scalability = throughput / throughput of `local` (Zhu, Lu, Lin, Han 2019, "Distributed Training Across
the World" (DTS): speedup / N, measured here).
"""
from __future__ import annotations

from ._registry import register
from .base import Algorithm
from .cost import CostFamily


@register("local")
class Local(Algorithm):
    """No communication: each worker steps its own optimizer on its own gradients; models are never averaged."""

    compression = False
    cost = CostFamily("none", pace="own")
    pace = "free"       # every worker at its own speed: the reference a race of unequal workers compares with

    def communicates(self):
        return False

    def step(self):
        self.local_update()
