"""Vectorised bit packing: `b`-bit codes (uint8, values < 2**b) <-> a dense uint8 byte string, b in 1..8.

Eight codes fill one int64 word (one per byte); three shift-and-mask stages squeeze the word's eight fields
into its low 8*b bits (pairs of bytes, then pairs of 16-bit lanes, then the two 32-bit halves), and the low `b`
bytes of each word are kept. Every step is one whole-tensor torch op: no Python loop over elements or chunks.
Eight codes take exactly `b` bytes, so `n` codes take `b * ceil(n / 8)` bytes (at most 7 codes of padding);
8-bit codes are already bytes.
"""
from __future__ import annotations

import torch

from .base import constant
from .kernels import blockwise, scratch

# bits -> (word type, multiplier, shift): a word of 8/b code bytes times sum_j 2^(top - (8 - b) j) puts code j at
# bit top + b j with no carries between terms (checked exhaustively in the tests); top = the word's last byte.
_GATHERS = {1: (torch.int64, 0x0102040810204080, 56),
            2: (torch.int32, (1 << 24) + (1 << 18) + (1 << 12) + (1 << 6), 24),
            4: (torch.int16, 0x110, 8)}


def gather8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes of int8 `codes` (< 2^bits, bits in 1, 2, 4; a multiple of 8 of them): code j of each eight
    at bit bits·j. On the CPU one multiply per word, in place over the codes (as `pack`); on other devices
    shifts and ors per group (what a compiler fuses into the kernel that made the codes); the same bytes."""
    if codes.device.type == "cpu":
        dtype, magic, shift = _GATHERS[bits]
        words = codes.view(dtype).mul_(magic).bitwise_right_shift_(shift)
        return scratch(words.numel(), torch.uint8, codes.device).copy_(words)      # (the low byte of each word)
    return gather8_lanes(codes, bits)


def gather8_lanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`gather8` as elementwise shifts and ors of each group's codes (no reduction: an integer sum inside a
    compiled kernel trips Triton's loop-carried types in torch 2.11)."""
    per = 8 // bits
    lanes = codes.view(-1, per).to(torch.int32)
    word = lanes[:, 0]
    for j in range(1, per):
        word = word | (lanes[:, j] << (bits * j))
    return word.to(torch.uint8)


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


GROUP = 4096        # elements per partial sum of the sign kernel (a multiple of 8)


def group_sums(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 sums of consecutive groups of `group` elements of the 1-D fp32 `x` (the last may be shorter),
    scratched. Summed per group, a tensor's total is the same whatever blocks it is cut into."""
    m = x.numel()
    full = m - m % group
    rows = -(-m // group)
    out = scratch(rows, torch.float32, x.device)
    if full:
        torch.sum(x[:full].view(-1, group), 1, out=out[:full // group])
    if full < m:
        torch.sum(x[full:], 0, keepdim=True, out=out[full // group:])
    return out


def count_ones(codes: torch.Tensor) -> torch.Tensor:
    """How many of the int8 0/1 `codes` (a multiple of 8 of them) are 1, as an int64 0-d tensor: their int64
    words summed 255 at a time (no byte lane can carry into the next), then the lanes' bytes."""
    w = codes.view(torch.int64)
    full = w.numel() - w.numel() % 255
    total = w[full:].sum().view(1).view(torch.uint8).sum(dtype=torch.int64)
    if full:
        total = total + w[:full].view(-1, 255).sum(1).view(torch.uint8).sum(dtype=torch.int64)
    return total


def sign_kernel(x: torch.Tensor, stats: int):
    """The sign compressors' kernel on a block of whole `GROUP`s: (1-bit codes 1[x >= 0] packed 8 per byte,)
    plus, with `stats` >= 1, each group's fp32 sum of |x|, and with `stats` = 2 also each group's sum of x and
    the block's count of set codes."""
    n = x.numel()
    pad = (-n) % 8
    codes = scratch(n + pad, torch.int8, x.device)
    if pad:
        codes[n:] = 0
    torch.ge(x, 0, out=codes[:n])
    out = []
    if stats:
        f = x if x.dtype == torch.float32 else x.float()
        out.append(group_sums(torch.abs(f, out=scratch(n, torch.float32, x.device)), GROUP))
        if stats > 1:
            out += [group_sums(f, GROUP), count_ones(codes).view(1)]
    return (gather8(codes, 1), *out)


def pack_signs(x: torch.Tensor, stats: int = 0) -> tuple[torch.Tensor, ...]:
    """1[x >= 0] of the 1-D `x` packed as `pack(codes, 1)` packs them, and with `stats` (see `sign_kernel`) the
    float64 sum of |x| (1) and of x and the count of set codes, int64 (2), as 0-d tensors on x's device. One
    pass over x: block by block on the CPU, compiled on a GPU (`kernels.blockwise`). The sums add fixed
    groups of `GROUP` elements in fp32 and the groups in float64: the same numbers whatever the blocks."""
    n = x.numel()
    specs = [(1, 8)] + [(1, GROUP)] * min(stats, 2) + ([None] if stats > 1 else [])
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return (torch.zeros(0, dtype=torch.uint8, device=x.device),) + (zero,) * min(stats, 2) + \
            ((zero.long(),) if stats > 1 else ())
    out = blockwise(sign_kernel, n, [(x, (1, 1))], specs, stats, align=GROUP)
    sums = tuple(s.sum(dtype=torch.float64) for s in out[1:3])
    return (out[0], *sums) + ((out[3].sum(),) if stats > 1 else ())


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
    if numel == 0:
        return torch.zeros(0, dtype=dtype, device=packed.device)
    return blockwise(decode_kernel, numel, [(packed.reshape(-1), (bits, 8))], [(1, 1)], table)[0]


def decode_kernel(packed: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor]:
    """A block's values: one row of `table` per byte (`decode`'s kernel; up to a byte's codes past the end)."""
    idx = scratch(packed.numel(), torch.int32, packed.device).copy_(packed)      # (int32: half the bytes)
    out = scratch((idx.numel(), table.shape[1]), table.dtype, packed.device)
    return (torch.index_select(table, 0, idx, out=out).view(-1),)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that `pack` produces for `numel` codes of `bits` bits (8-bit codes are sent as they are)."""
    return numel if bits == 8 else bits * ((numel + 7) // 8)


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
