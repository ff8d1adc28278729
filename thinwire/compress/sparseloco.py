"""`sparseloco`: SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706), as a compressor and a memory.

The paper's Algorithm 1 on replica r, after H inner steps give the pseudo-gradient Δ_r (any tensor here):
    e_r ← β e_r + Δ_r                      error feedback with decay, in place of DiLoCo's outer momentum   (memory)
    Δ̂_r ← Q(TopK(e_r))                     top-k per chunk, the kept values quantized to 2 bits          (compressor)
    e_r ← e_r − Δ̂_r                        what is sent leaves the accumulator                           (memory)
    Δ = (1/R) Σ_r Δ̂_r                       all-gather of the sparse payloads, summed in fp32 (the exchange's mean)
    θ ← θ − α Δ                             the outer step (plain SGD with lr α: no outer momentum)
The memory `sparseloco` is `residual` with beta = β (sent + e_new = β e_old + Δ exactly: nothing is lost).

TopK keeps the `topk` largest |e| of every `chunk`-element chunk of the flattened tensor (the tail chunk the same
density). Q, the 2-bit code: one sign bit and one magnitude bit per kept value; per chunk with kept magnitudes in
[lo, hi], the bit says whether |v| > (lo + hi)/2, and each half decodes to the mean |v| of its members (two fp32
levels per chunk, the conditional means: the least-squares levels for that split). Error per kept value
≤ (hi − lo)/2 of its chunk; a chunk whose kept values take at most two magnitudes is exact. Payload: in-chunk
indices (ceil(log2 chunk) bits, packed), the 2-bit codes (4 per byte), 2 fp32 levels per chunk.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors, memories
from ._chunks import Chunked, Layouts, check_chunk, check_topk, index_nbytes, pack_index, unpack_index
from .base import Payload
from .bitpack import pack, packed_nbytes, unpack
from .finite import check_tensor
from .residual import Residual


@compressors.register("sparseloco")
class SparseLoCo(Chunked):
    """SparseLoCo: top-k per chunk, values as 2-bit codes (sign + magnitude bit, 2 fp32 levels per chunk)."""

    def __init__(self, chunk: int = 4096, topk: int = 64):
        self.chunk = check_chunk("sparseloco", chunk)
        self.topk = check_topk("sparseloco", topk, self.chunk)
        self.layouts = Layouts(self.chunk, self.topk)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        check_tensor(flat, self.name, key)
        lay = self.layouts(flat.numel())
        local, vals = lay.topk(flat)
        vals = vals.to(torch.float32)
        row, a = lay.row_of(vals.device), vals.abs()
        zeros = torch.zeros(lay.rows, device=vals.device)
        hi = zeros.scatter_reduce(0, row, a, "amax", include_self=False)
        lo = zeros.scatter_reduce(0, row, a, "amin", include_self=False)
        upper = a > ((lo + hi) / 2)[row]
        levels = []
        for half, empty in ((~upper, lo), (upper, hi)):
            n = zeros.index_add(0, row, half.to(torch.float32))
            s = zeros.index_add(0, row, torch.where(half, a, 0.0))
            levels.append(torch.where(n > 0, s / n.clamp(min=1), empty))      # the mean |v| of the half
        codes = upper.to(torch.uint8).bitwise_or_(vals.lt(0).to(torch.uint8).bitwise_left_shift_(1))
        return Payload([*pack_index(local, self.chunk), pack(codes, 2, inplace=True),
                        torch.stack(levels, 1).reshape(-1)], ctx=self.context(tensor.shape, tensor.dtype))

    def _contribution(self, payload, lay) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, fp32 values) of one rank's payload."""
        local, used = unpack_index(payload.tensors, lay.kept, self.chunk)
        codes = unpack(payload.tensors[used], 2, lay.kept).to(torch.int64)
        levels = payload.tensors[used + 1].reshape(-1)
        vals = levels[2 * lay.row_of(levels.device) + codes.bitwise_and(1)]
        return lay.positions(local), torch.where(codes.bitwise_right_shift(1).bool(), -vals, vals)

    def _sum32(self, payloads):
        lay = self.layouts(payloads[0].ctx["numel"])
        parts = [self._contribution(p, lay) for p in payloads]
        pos, vals = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
        return torch.zeros(lay.n, device=vals.device).index_add_(0, pos, vals)

    def nominal_bits(self, numel):
        lay = self.layouts(numel)
        return 8.0 * (index_nbytes(lay.kept, self.chunk) + packed_nbytes(lay.kept, 2) + 8 * lay.rows) / max(numel, 1)


@memories.register("sparseloco")
class SparseLoCoMemory(Residual):
    """SparseLoCo's error feedback with decay: e ← β e + Δ before compression, e ← e − sent after."""

    replaces_momentum = True   # beta is its own decay; the optimizer runs without momentum (Trainer)

    def __init__(self, beta: float = 0.95):
        if not 0 <= beta < 1:
            raise UserError(f"sparseloco memory: beta (the error-feedback decay) must be in [0, 1), got {beta}")
        super().__init__(beta=beta, gamma=1.0)
