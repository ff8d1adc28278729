"""Canonical Huffman coding of integer levels, the code table in the payload (Huffman 1952; canonical form as in
DEFLATE, RFC 1951 §3.2.2: codes of each length are consecutive integers in symbol order, so the table is just
(symbol, length) pairs).

Lengths come from the symbol counts (a heap over the alphabet, not over elements) and are capped at 16 bits by
halving the counts until they fit, so a decoder's lookup table has at most 2^16 rows. Decoding is whole-array:
every bit position p looks up the codeword that would start there (a 16-bit window into a table), giving
next(p) = p + length(p); the true codeword starts are the orbit of 0 under next, found by pointer doubling
(⌈log2 count⌉ rounds of `reach |= reach∘J; J = J∘J`), never by walking the bits one by one.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from .coding import Coder, coders, from_bytes, header, to_bytes, write_fields

MAX_LEN = 16


def code_lengths(counts: np.ndarray, limit: int = MAX_LEN) -> np.ndarray:
    """Huffman code length per symbol (counts > 0), at most `limit` bits."""
    m = counts.size
    if m == 1:
        return np.ones(1, dtype=np.int64)
    counts = counts.astype(np.int64)
    while True:
        heap = [(int(c), i, (i,)) for i, c in enumerate(counts)]
        heapq.heapify(heap)
        depth = np.zeros(m, dtype=np.int64)
        tie = m
        while len(heap) > 1:
            c1, _, s1 = heapq.heappop(heap)
            c2, _, s2 = heapq.heappop(heap)
            merged = s1 + s2
            depth[list(merged)] += 1
            heapq.heappush(heap, (c1 + c2, tie, merged))
            tie += 1
        if depth.max() <= limit:
            return depth
        counts = counts // 2 + 1


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codewords (as integers) for the lengths, symbols taken in their given order within a length."""
    order = np.lexsort((np.arange(lengths.size), lengths))
    codes = np.zeros(lengths.size, dtype=np.int64)
    code, prev = 0, int(lengths[order[0]])
    for j, i in enumerate(order):
        ln = int(lengths[i])
        if j:
            code = (code + 1) << (ln - prev)
        codes[i], prev = code, ln
    return codes


def chain_starts(nxt: np.ndarray, count: int) -> np.ndarray:
    """The first `count` positions of the orbit of 0 under `nxt` (nxt[p] > p; nxt[T] = T is the sentinel)."""
    reach = np.zeros(nxt.size, dtype=bool)
    reach[0] = True
    jump = nxt.copy()
    span = 1
    while span < count:
        reach[jump[reach]] = True
        jump = jump[jump]
        span *= 2
    starts = np.flatnonzero(reach[:-1])[:count]
    if starts.size < count:
        raise ValueError("corrupt Huffman stream: fewer codewords than values")
    return starts


@coders.register("huffman")
class Huffman(Coder):
    """Canonical Huffman code of the levels, (symbol, length) table in the header (≤ H + 1 bits per level)."""

    def encode(self, values):
        v = values.reshape(-1).to(torch.int64).numpy()
        if v.size == 0:
            return header(0, 0), torch.zeros(0, dtype=torch.uint8, device="cpu")     # host-side coder (numpy)
        symbols, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
        lengths = code_lengths(counts)
        codes = canonical_codes(lengths)
        bits = write_fields(codes[inverse], lengths[inverse])
        return header(v.size, symbols.size, *symbols.tolist(), *lengths.tolist()), to_bytes(bits)   # host: numpy

    def decode(self, head, data):
        h = head.to(torch.int64).numpy()
        count, m = int(h[0]), int(h[1])
        if count == 0:
            return torch.zeros(0, dtype=torch.int64, device="cpu")
        symbols, lengths = h[2:2 + m], h[2 + m:2 + 2 * m]
        codes = canonical_codes(lengths)
        width = int(lengths.max())
        sym_of = np.zeros(1 << width, dtype=np.int64)
        len_of = np.ones(1 << width, dtype=np.int64)          # unused rows: any step > 0 keeps nxt increasing
        for s, c, ln in zip(range(m), codes, lengths):         # a loop over the alphabet (≤ 2^16 rows filled)
            lo = int(c) << (width - int(ln))
            sym_of[lo:lo + (1 << (width - int(ln)))] = s
            len_of[lo:lo + (1 << (width - int(ln)))] = ln
        bits = from_bytes(data)
        total = bits.size
        padded = np.concatenate([bits, np.zeros(width, dtype=np.uint8)]).astype(np.int64)
        window = np.zeros(total, dtype=np.int64)
        for j in range(width):                                 # a loop over the window's bits, not elements
            window = (window << 1) | padded[j:j + total]
        nxt = np.minimum(np.arange(total) + len_of[window], total)
        starts = chain_starts(np.append(nxt, total), count)
        return torch.from_numpy(symbols[sym_of[window[starts]]])
