"""The lossless coding stage: a `Coder` turns a stream of non-negative integers into bits and back, exactly.

Coders are registered by name in `coders` (`thinwire.compress.coders`) and composed with a compressor by
`"compressor+coder"` (see `coded.py`). The bit helpers here are whole-array numpy ops (no Python loop over
elements): variable-width fields are written by `np.repeat` of each field's bits and read back by a `bincount`.

A coded stream is self-describing: its element count and parameters travel in a small int32 header (every rank
decodes the others' streams with only what every rank knows).
"""
from __future__ import annotations

import numpy as np
import torch

from ..registry import Registry

coders = Registry("coder")


class Coder:
    """encode(values: int64 ≥ 0) -> (header int32 tensor, bits uint8 tensor); decode(header, bits) -> values."""

    name = ""

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decode(self, header: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def bit_length(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) + 1 for v ≥ 1 (0 for v = 0), exact for v < 2^53."""
    return np.frexp(v.astype(np.float64))[1].astype(np.int64)


def _fields(widths: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Fields of `widths` bits laid out back to back: (total bits, each bit's field, its shift in the field)."""
    widths = widths.astype(np.int64)
    total = int(widths.sum())
    owner = np.repeat(np.arange(widths.size), widths)
    starts = np.cumsum(widths) - widths
    return total, owner, widths[owner] - 1 - (np.arange(total) - starts[owner])


def write_fields(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Concatenate the low `widths[i]` bits of each `values[i]`, most significant first, as a 0/1 uint8 array."""
    _, owner, shift = _fields(widths)
    return ((values.astype(np.int64)[owner] >> shift) & 1).astype(np.uint8)


def read_fields(bits: np.ndarray, start: int, widths: np.ndarray) -> np.ndarray:
    """Inverse of `write_fields` for fields laid out back to back from bit `start` (values < 2^53)."""
    total, owner, shift = _fields(widths)
    weights = bits[start:start + total].astype(np.float64) * np.exp2(shift)
    return np.bincount(owner, weights=weights, minlength=widths.size).astype(np.int64)


def unary_lengths(bits: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The run lengths of a plane of `count` unary codes (n zeros then a one): (lengths, bits the plane used)."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), 0
    ones = np.flatnonzero(bits)[:count]
    if ones.size < count:
        raise ValueError("corrupt unary plane: fewer terminators than values")
    lengths = np.diff(ones, prepend=-1) - 1
    return lengths.astype(np.int64), int(ones[-1]) + 1


def unary_plane(lengths: np.ndarray) -> np.ndarray:
    """`lengths[i]` zeros then a one, for each i (the inverse of `unary_lengths`)."""
    out = np.zeros(int(lengths.sum()) + lengths.size, dtype=np.uint8)
    out[np.cumsum(lengths + 1) - 1] = 1
    return out


def to_bytes(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.packbits(bits))


def from_bytes(data: torch.Tensor) -> np.ndarray:
    return np.unpackbits(data.reshape(-1).numpy().astype(np.uint8, copy=False))


def header(*fields: int) -> torch.Tensor:
    return torch.tensor(fields, dtype=torch.int32, device="cpu")


def zigzag(levels: torch.Tensor) -> torch.Tensor:
    """Signed levels -> 0, 1, 2 … (0, -1, 1, -2, 2 …), so small magnitudes get short codes."""
    return torch.where(levels >= 0, 2 * levels, -2 * levels - 1)


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z % 2 == 0, z // 2, -(z + 1) // 2)


def entropy_bits(values: torch.Tensor) -> float:
    """Empirical (order-0) entropy of the values, bits per value: the bound any symbol-by-symbol code meets."""
    if values.numel() == 0:
        return 0.0
    _, counts = torch.unique(values, return_counts=True)
    p = counts.double() / values.numel()
    return float(-(p * torch.log2(p)).sum())
