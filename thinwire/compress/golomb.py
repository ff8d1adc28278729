"""Golomb-Rice coding of non-negative integers, the run-length code of sparse index gaps (as SBC/STC code theirs).

With Rice parameter b (divisor 2^b), v = q·2^b + r is coded as q in unary (q zeros, a one) then r in b bits
(Golomb 1966; Rice 1979). For geometric gaps of mean μ the best b is about log2(μ·ln 2); the encoder picks
b = max(0, ⌊log2(mean · ln 2)⌋) and sends it in the header. Laid out as two planes (all quotients, then the
fixed-width remainders) so decoding is whole-array: same length as the interleaved code.
Sorted unique indices i_0 < i_1 < … become gaps i_0, i_1 − i_0 − 1, … (the zero runs between kept positions).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .coding import Coder, coders, from_bytes, header, read_fields, to_bytes, unary_lengths, unary_plane, write_fields


def rice_parameter(values: np.ndarray) -> int:
    mean = float(values.mean()) if values.size else 0.0
    return max(0, int(math.floor(math.log2(mean * math.log(2))))) if mean * math.log(2) >= 1 else 0


def gaps(sorted_idx: torch.Tensor) -> torch.Tensor:
    """Sorted unique indices -> the zero runs before each one."""
    idx = sorted_idx.reshape(-1).to(torch.int64)
    return torch.diff(idx, prepend=torch.tensor([-1], device=idx.device)) - 1


def ungaps(g: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(g + 1, 0) - 1


@coders.register("golomb")
class GolombRice(Coder):
    """Golomb-Rice code (unary quotient + b-bit remainder, b from the mean): run-length coding of index gaps."""

    def encode(self, values):
        v = values.reshape(-1).to(torch.int64).numpy()
        b = rice_parameter(v)
        q, r = v >> b, v & ((1 << b) - 1)
        bits = np.concatenate([unary_plane(q), write_fields(r, np.full(v.size, b, dtype=np.int64))])
        return header(v.size, b), to_bytes(bits)

    def decode(self, head, data):
        count, b = int(head[0]), int(head[1])
        bits = from_bytes(data)
        q, used = unary_lengths(bits, count)
        r = read_fields(bits, used, np.full(count, b, dtype=np.int64))
        return torch.from_numpy((q << b) | r)
