"""Cheap randomness for stochastic rounding, and the rounding itself.

`torch.rand` costs about 20 memcpys per element here (BENCHMARKS.md, "Where the time goes"), more than a whole
quantizer may. Unbiased rounding only needs each element's uniform to be uniform (E[floor(y + u)] = y for
u ~ U[0, 1)), and variance bounds only pairwise independence. So the n numbers are an R x C table
u_ij = A_i xor B_j of random integers (R + C ~ 2 sqrt(n) draws): each cell exactly uniform, any two cells
independent (pairwise, not jointly: the xor of four corners of a rectangle is 0), written straight into the bits
of fp32 numbers by one broadcast op. Local randomness (per rank) comes from a counter-based stream keyed by
(seed, rank) (`kernels.Stream`), hashed on the tensor's device (the same on every device); shared randomness from
(seed, step, key).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .base import Compressor, reused
from .bitpack import pack_kernel
from .kernels import Stream, blockwise, random_bits, scratch

_COLS = 4096


def rank() -> int:
    """This process's rank in the default process group (0 when there is none)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Uniforms:
    """Pairwise-independent uniform numbers in bulk, from a counter-based `Stream` keyed by (seed, rank) on first
    use: the table's R + C factors are hashed on the tensor's device (`random_bits`), so the numbers are the
    same on every device and nothing is copied from the host."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._gen: Stream | None = None
        self._ibuf = torch.empty(0, dtype=torch.int32, device="cpu")     # regrown on the requested device

    def stream(self) -> Stream:
        if not isinstance(self._gen, Stream):
            # a torch.Generator put here (`base._probes` fixes the streams of a probe copy that way) keys the
            # stream by its seed alone, the same on every rank
            self._gen = Stream(self.seed, "local", rank() if self._gen is None else ("fixed", self._gen.initial_seed()))
        return self._gen

    def factors(self, numel: int, bits: int, device="cpu", prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(A | prefix as an R x 1 int32 column, B as a 1 x C row), A and B uniform `bits`-bit integers: the
        table A_i xor B_j, read row by row, holds `numel` (or a few more) pairwise-independent numbers."""
        cols = min(_COLS, max(numel, 1))
        rows = math.ceil(numel / cols) if numel else 0
        key = self.stream().next_key()
        ab = random_bits(key, rows + cols, bits, device)
        return ab[:rows].view(rows, 1).bitwise_or_(prefix), ab[rows:].view(1, cols)

    def offset_uniforms(self, numel: int, offset: int, device="cpu") -> torch.Tensor:
        """`numel` fp32 numbers offset + u, u pairwise-independent uniform on a grid of [0, 1), built in one
        broadcast xor: offset + u lies in [2^e, 2^(e+1)) (e = floor(log2 offset)), where a float's low 23 - e
        mantissa bits step by 2^-(23-e); so the bits are (exponent, offset's bits, A_i ^ B_j) with A, B uniform
        (23-e)-bit integers. The grid bounds the rounding bias to 2^-(23-e) of a level (2^-23 for offset 1,
        2^-17 at most for offset <= 127), the order of fp32's own round-off. A view of an internal buffer."""
        free, prefix = offset_bits(offset)
        return self._xor_table(numel, device, free, prefix).view(torch.float32)

    def _xor_table(self, numel: int, device, bits: int, prefix: int = 0) -> torch.Tensor:
        """`numel` int32 (A_i | prefix) xor B_j over an R x C table of the internal buffer, A and B uniform
        `bits`-bit integers."""
        a, b = self.factors(numel, bits, device, prefix)
        self._ibuf, table = reused(self._ibuf, a.shape[0] * b.shape[1], device)
        torch.bitwise_xor(a, b, out=table.view(a.shape[0], b.shape[1]))
        return table[:numel]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "stream": None if self._gen is None else self.stream().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        if state.get("stream") is not None:
            self.stream().load_state_dict(state["stream"])


def offset_bits(offset: int) -> tuple[int, int]:
    """(free mantissa bits, the fp32 bit pattern of `offset`) for `Uniforms.offset_uniforms`: offset + u with u on
    a 2^-free grid of [0, 1) is the float whose bits are pattern | (a free-bit integer)."""
    if not 1 <= offset < 2**22:
        raise ValueError(f"offset must be in 1..2^22, got {offset}")
    e = offset.bit_length() - 1
    free = 23 - e
    return free, ((127 + e) << 23) | ((offset - (1 << e)) << free)


class Stochastic(Compressor):
    """A compressor that rounds with its own `Uniforms`, whose stream a checkpoint saves and restores."""

    def __init__(self, seed: int = 0):
        self.uniforms = Uniforms(seed)

    def state_dict(self):
        return {"uniforms": self.uniforms.state_dict()}

    def load_state_dict(self, state):
        self.uniforms.load_state_dict(state["uniforms"])


def stochastic_codes(x: torch.Tensor, inv_scale: torch.Tensor | float, levels: int, uniforms: Uniforms,
                     bucket: int | None = None, clip: bool = False, bits: int = 8) -> torch.Tensor:
    """uint8 codes in [0, 2*levels] of floor(x * inv_scale + u) + levels, the unbiased rounding of x * inv_scale
    to the integers -levels..levels (QSGD's xi(g, s), Alistarh et al. 2017, arXiv 1610.02132, and TernGrad's
    Bernoulli, Wen et al. 2017, arXiv 1705.07878, are both this rounding).
    `inv_scale`: a number, a one-element tensor or one value per bucket of `bucket` elements (kept on the device).
    `clip`: |x * inv_scale| may exceed `levels` and is clipped to it (TernGrad's clipping); without it it must not
    (QSGD: |x| <= norm; only round-off is guarded against). `bits` in 1, 2, 4: the codes come packed (`bitpack`).
    One kernel (`codes_kernel`) per block of the table's rows on the CPU, fused on a GPU."""
    flat = x.reshape(-1)
    n = flat.numel()
    free, prefix = offset_bits(levels)
    a, b = uniforms.factors(n, free, flat.device, prefix)
    inv = torch.as_tensor(inv_scale, dtype=torch.float32, device=flat.device).reshape(-1)
    per = bucket if bucket is not None and inv.numel() > 1 else 0
    pack = bits if bits in (1, 2, 4) else 0
    spec = (pack, 8) if pack else (1, 1)
    inputs = [(flat, (1, 1)), (a.view(-1), (1, b.shape[1])), (inv, (1, per) if per else None)]
    return blockwise(codes_kernel, n, inputs, [spec], b, levels, per, clip, pack,
                     align=math.lcm(8, b.shape[1], per or 1))[0]


def codes_kernel(x: torch.Tensor, a: torch.Tensor, inv: torch.Tensor, b: torch.Tensor, levels: int, per: int,
                 clip: bool, pack: int):
    """The kernel of `stochastic_codes` on a block of whole table rows (`a`: their row factors, `b` the
    columns'; `inv` per bucket of `per`, or one): (codes, packed when `pack` > 0,)."""
    m = x.numel()
    cols = b.shape[1]
    w = torch.bitwise_xor(a.view(-1, 1), b, out=scratch((a.numel(), cols), torch.int32, x.device))
    w = w.view(-1)[:m].view(torch.float32)                 # levels + u: then x * inv + levels + u >= 0, trunc = floor
    f = x.to(torch.float32)
    if per:
        full = m - m % per
        w[:full].view(-1, per).addcmul_(f[:full].view(-1, per), inv[:full // per].view(-1, 1))
        if full < m:
            w[full:].addcmul_(f[full:], inv[-1])
    elif m:
        w.addcmul_(f, inv.reshape(()))
    if clip:
        w.clamp_(0, 2 * levels)
    # float -> int8 is a fast cast (-> uint8 is not); codes above 127 go through int16
    small = 2 * levels + 1 <= 127
    q = scratch(m, torch.int8 if small else torch.int16, x.device)
    q.copy_(w)
    if not clip:
        q.clamp_(max=2 * levels)                            # round-off may reach 2 levels + 1
    codes = q.view(torch.uint8) if small else q.to(torch.uint8)
    return (pack_kernel(codes, pack),) if pack else (codes,)
