"""Vectorised bit packing: `b`-bit codes (uint8, values < 2**b) <-> a dense uint8 byte string, b in 1..8.

Eight codes fill one int64 word (one per byte); three shift-and-mask stages squeeze the word's eight fields
into its low 8*b bits (pairs of bytes, then pairs of 16-bit lanes, then the two 32-bit halves), and the low `b`
bytes of each word are kept. Every step is one whole-tensor torch op: no Python loop over elements or chunks.
Eight codes take exactly `b` bytes, so `n` codes take `b * ceil(n / 8)` bytes (at most 7 codes of padding);
8-bit codes are already bytes.
"""
from __future__ import annotations

import torch

from ._kernels import fresh, fused, scratch
from .base import constant

# bits -> (word type, multiplier, shift): a word of 8/b code bytes times sum_j 2^(top - (8 - b) j) puts code j at
# bit top + b j with no carries between terms (checked exhaustively in the tests); top = the word's last byte.
_GATHERS = {1: (torch.int64, 0x0102040810204080, 56),
            2: (torch.int32, (1 << 24) + (1 << 18) + (1 << 12) + (1 << 6), 24),
            4: (torch.int16, 0x110, 8)}


def gather8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes of int8 `codes` (< 2^bits, bits in 1, 2, 4; a multiple of 8 of them): code j of each eight
    at bit bits·j. On the CPU one multiply per word, in place over the codes (as `pack`); on other devices
    shifts and a sum per group (what a compiler fuses into the kernel that made the codes); the same bytes."""
    if codes.device.type == "cpu":
        dtype, magic, shift = _GATHERS[bits]
        return codes.view(dtype).mul_(magic).bitwise_right_shift_(shift).to(torch.uint8)
    per = 8 // bits
    lanes = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (codes.view(-1, per).to(torch.int32) << lanes).sum(1, dtype=torch.int32).to(torch.uint8)


def pack_kernel(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack(codes, bits)` (bits in 1, 2, 4) inside a kernel: uint8 codes, scratched."""
    n = codes.numel()
    pad = (-n) % 8
    if pad:
        padded = scratch(n + pad, torch.uint8, codes.device)
        padded[n:] = 0
        padded[:n] = codes
        codes = padded
    return gather8(codes.view(torch.int8), bits)


def sign_kernel(x: torch.Tensor, count: bool):
    """(1-bit codes 1[x >= 0] packed 8 per byte, how many are set or None): the sign compressors' kernel."""
    n = x.numel()
    pad = (-n) % 8
    mask = fresh(n + pad, torch.bool, x.device)
    mask[n:] = False
    torch.ge(x, 0, out=mask[:n])
    set_ = torch.count_nonzero(mask) if count else None        # (before the packing scratches the mask)
    return gather8(mask.view(torch.int8), 1), set_


def pack_signs(x: torch.Tensor, count: bool = False):
    """1[x >= 0] of the 1-D `x` packed as `pack(codes, 1)` packs them; with `count`, also how many are set (an
    int64 0-d tensor on x's device). Compiled on a GPU (`fused`), one pass per op on the CPU."""
    bits, set_ = (sign_kernel if x.device.type == "cpu" else fused_sign)(x, count)
    return (bits, set_) if count else bits


fused_sign = fused(sign_kernel)


def code_table(bits: int, device, dtype=torch.int64) -> torch.Tensor:
    """(256, 8 / bits) table, row v = the codes packed in byte value v; built once per (bits, dtype, device)."""
    def build():
        per = 8 // bits
        v = torch.arange(256, dtype=torch.int64, device="cpu").view(-1, 1)     # built on the host, kept per device
        return ((v >> (bits * torch.arange(per, device="cpu"))) & ((1 << bits) - 1)).to(dtype).contiguous()
    return constant(("bitpack-codes", bits, dtype), device, build)


def value_table(bits: int, values, device, dtype=torch.float32) -> torch.Tensor:
    """(256, 8 / bits) table, row v = `values[code]` for the codes packed in byte value v. Constant `values` (a
    sequence of numbers) are built once per (values, bits, dtype, device); a tensor of values (per call: a
    rank's means) is gathered through the cached code table on its own device, without leaving it."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)[code_table(bits, device)]
    values = tuple(values)
    return constant(("bitpack-values", bits, dtype, tuple(map(repr, values))), device,     # (repr: -0.0 != 0.0)
                    lambda: torch.tensor(values, dtype=dtype, device="cpu")[code_table(bits, "cpu")].contiguous())


def decode(packed: torch.Tensor, bits: int, numel: int, values, dtype=torch.float32, scale=None) -> torch.Tensor:
    """`values[code]` (as `dtype`) for the `numel` codes packed in `packed` (bits in 1, 2, 4): one table lookup
    per byte, no intermediate codes. `scale` (a number or a one-element tensor on `packed`'s device) multiplies
    the table, so a per-tensor scale needs no host round trip and no new cached table."""
    table = value_table(bits, values, packed.device, dtype)
    if scale is not None and not (isinstance(scale, (int, float)) and scale == 1):
        table = table * (scale.reshape(()) if isinstance(scale, torch.Tensor) else scale)
    idx = packed.reshape(-1).to(torch.int32)                                           # (int32: half the bytes)
    out = fresh((idx.numel(), table.shape[1]), table.dtype, packed.device)
    return torch.index_select(table, 0, idx, out=out).view(-1)[:numel]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that `pack` produces for `numel` codes of `bits` bits (8-bit codes are sent as they are)."""
    if bits == 8:
        return numel
    return bits * ((numel + 7) // 8)


def _lanes(bits_per_field: int, stride: int) -> int:
    """A mask of `bits_per_field` low bits repeated every `stride` bits across a 64-bit word."""
    field = (1 << bits_per_field) - 1
    return sum(field << (stride * i) for i in range(64 // stride))


def _stages(bits: int):
    """(shift, low mask, packed-high mask, spread-high mask) of each stage: two fields of b, 2b, 4b bits per lane
    of 16, 32, 64 bits, the high one either next to the low one (packed) or at the middle of the lane (spread)."""
    out = []
    for width, lane in ((bits, 16), (2 * bits, 32), (4 * bits, 64)):
        low = _lanes(width, lane)
        out.append((lane // 2 - width, low, low << width, low << (lane // 2)))
    return out


def pack(codes: torch.Tensor, bits: int, inplace: bool = False) -> torch.Tensor:
    """Pack 1-D uint8 `codes` (each < 2**bits) into `packed_nbytes(n, bits)` bytes. `inplace` lets it scratch
    over `codes` (saves a copy when the caller no longer needs them)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    codes = codes.reshape(-1)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.clone() if not inplace else codes
    pad = (-codes.numel()) % 8                      # eight codes to an int64 word
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])    # (a copy: the caller's codes stay)
    elif not inplace:
        codes = codes.clone()
    words = codes.view(torch.int64)
    if bits in _GATHERS:   # one multiply gathers the codes of a word into its top byte (code j -> bits b*j..)
        dtype, magic, shift = _GATHERS[bits]
        return words.view(dtype).mul_(magic).bitwise_right_shift_(shift).to(torch.uint8)
    tmp = torch.empty_like(words)
    for shift, low, high, _ in _stages(bits):       # three stages, whatever the tensor size
        torch.bitwise_right_shift(words, shift, out=tmp)
        tmp.bitwise_and_(high)
        words.bitwise_and_(low).bitwise_or_(tmp)
    return words.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The `numel` uint8 codes that `pack(codes, bits)` produced `packed` from."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    packed = packed.reshape(-1)
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    if bits == 8:
        return packed
    groups = packed.numel() // bits
    if bits == 1:          # one table row per byte value: its eight bits
        return code_table(1, packed.device, torch.uint8).index_select(0, packed.to(torch.int64)).view(-1)[:numel]
    if bits == 4:          # byte -> int16 (c0 | c1 << 4): spread c1 into the high byte
        w = packed.to(torch.int16)
        return w.bitwise_or_(w << 4).bitwise_and_(0x0F0F).view(torch.uint8)[:numel]
    if bits == 2:          # byte -> int32: codes 2, 3 to the high half, then each code to its own byte
        w = packed.to(torch.int32)
        w.bitwise_or_(w << 12).bitwise_and_(0x000F000F)
        return w.bitwise_or_(w << 6).bitwise_and_(0x03030303).view(torch.uint8)[:numel]
    full = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    full[:, :bits] = packed.view(groups, bits)
    words = full.view(torch.int64).view(-1)
    tmp = torch.empty_like(words)
    for shift, low, _, spread in reversed(_stages(bits)):
        torch.bitwise_left_shift(words, shift, out=tmp)
        tmp.bitwise_and_(spread)
        words.bitwise_and_(low).bitwise_or_(tmp)
    return words.view(torch.uint8)[:numel]
