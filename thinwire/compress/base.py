"""The compressor and memory interfaces. A compressor is pure: tensor -> payload -> tensor, no communication.

A `Payload` holds the tensors that cross the wire (already packed: bits, levels, indices, scales) and the local
context needed to decompress them, which never crosses the wire (shape, dtype: every rank knows them).
Each compressor declares its algebra so the exchange layer can pick the collective it allows:
- `unbiased`: E[decompress(compress(x))] = x;
- `linear`: payloads of different ranks may be summed element-wise (by all-reduce) and decompressed as one;
- `randomness`: "none", "shared" (every rank must draw the same numbers: seeded by step and key) or "local";
- `aggregation`: "allreduce", "allgather" or "majority".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class Payload:
    tensors: list[torch.Tensor]
    ctx: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Compressor:
    name: ClassVar[str] = ""
    unbiased: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    randomness: ClassVar[str] = "none"
    aggregation: ClassVar[str] = "allreduce"

    def compress(self, tensor: torch.Tensor, key: Any = None, step: int = 0) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def nominal_bits(self, numel: int) -> float:
        """Bits per element the method nominally sends (for benchmarks and the planner)."""
        return 32.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Memory:
    """Error feedback and its variants: `compensate` before compression, `update` after."""

    name: ClassVar[str] = ""

    def compensate(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        return tensor

    def update(self, tensor: torch.Tensor, key: Any, sent: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
