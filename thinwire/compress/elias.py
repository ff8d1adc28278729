"""Elias-gamma and Elias-delta codes of non-negative integers (QSGD's lossless stage: Alistarh et al.
2017, arXiv 1610.02132).

A value v ≥ 0 is coded as u = v + 1 ≥ 1 with N = ⌊log2 u⌋:
  gamma: N zeros, a one, then the N low bits of u                          (2N + 1 bits; 1 bit for v = 0)
  delta: gamma(N + 1), then the N low bits of u                            (N + 2⌊log2(N+1)⌋ + 1 bits)
The code lengths are exactly Elias's; the codewords' parts are laid out as planes (all unary prefixes, then all
mantissas) instead of interleaved, which costs no bit and makes decoding a few whole-array ops: the terminating
ones of the unary plane give every N at once, a prefix sum of the N gives every mantissa's offset.
"""
from __future__ import annotations

import numpy as np
import torch

from .coding import (Coder, bit_length, coders, from_bytes, header, read_fields, to_bytes, unary_lengths,
                      unary_plane, write_fields)


def gamma_bits(u: np.ndarray) -> np.ndarray:
    """The unary and mantissa planes of the gamma codes of u ≥ 1."""
    n = bit_length(u) - 1
    return np.concatenate([unary_plane(n), write_fields(u, n)])


def gamma_read(bits: np.ndarray, count: int, start: int = 0) -> tuple[np.ndarray, int]:
    """`count` gamma-coded u ≥ 1 from bit `start`: (u, the bit after them)."""
    n, used = unary_lengths(bits[start:], count)
    mant = read_fields(bits, start + used, n)
    return (np.int64(1) << n) | mant, start + used + int(n.sum())


@coders.register("elias")
class EliasGamma(Coder):
    """Elias-gamma code: 2⌊log2(v+1)⌋ + 1 bits for v (1 bit for a zero level)."""

    def encode(self, values):
        u = values.reshape(-1).to(torch.int64).numpy() + 1
        return header(u.size), to_bytes(gamma_bits(u))

    def decode(self, head, data):
        u, _ = gamma_read(from_bytes(data), int(head[0]))
        return torch.from_numpy(u - 1)


@coders.register("eliasdelta")
class EliasDelta(Coder):
    """Elias-delta code: ⌊log2 u⌋ + 2⌊log2(⌊log2 u⌋+1)⌋ + 1 bits for u = v+1 (shorter for large values, e.g. gaps)."""

    def encode(self, values):
        u = values.reshape(-1).to(torch.int64).numpy() + 1
        n = bit_length(u) - 1
        return header(u.size), to_bytes(np.concatenate([gamma_bits(n + 1), write_fields(u, n)]))

    def decode(self, head, data):
        bits, count = from_bytes(data), int(head[0])
        n1, pos = gamma_read(bits, count)
        n = n1 - 1
        return torch.from_numpy(((np.int64(1) << n) | read_fields(bits, pos, n)) - 1)
