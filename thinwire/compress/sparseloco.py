"""`sparseloco`: SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706), as a compressor and a memory.

The paper's Algorithm 1 on replica r, after H inner steps give the pseudo-gradient Δ_r (any tensor here):
    e_r ← β e_r + Δ_r                      error feedback with decay, in place of DiLoCo's outer momentum   (memory)
    Δ̂_r ← Q(TopK(e_r))                     top-k per chunk, the kept values quantized to 2 bits          (compressor)
    e_r ← e_r − Δ̂_r                        what is sent leaves the accumulator                           (memory)
    Δ = (1/R) Σ_r Δ̂_r                       all-gather of the sparse payloads, summed in fp32 (the exchange's mean)
    θ ← θ − α Δ                             the outer step (plain SGD with lr α: no outer momentum)
The memory is `residual` with beta = β (sent + e_new = β e_old + Δ exactly). TopK keeps the `topk` largest |e| of
every `chunk`-element chunk (the tail the same density). Q, the 2-bit code: a sign bit and a magnitude bit per
kept value, which says whether |v| > (lo + hi)/2 for the chunk's kept magnitudes in [lo, hi]; each half decodes
to the mean |v| of its members (two fp32 levels per chunk: the least-squares levels for that split), so the
error per kept value is ≤ (hi − lo)/2, nil where a chunk's kept values take at most two magnitudes. Payload:
in-chunk indices (ceil(log2 chunk) bits, packed), the 2-bit codes (4 per byte), 2 fp32 levels per chunk.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import compressors, memories
from ._chunks import Chunked, Layouts, check_chunk, check_topk, index_nbytes, pack_index, unpack_index
from .base import Payload
from .bitpack import pack, packed_nbytes, unpack
from .finite import check_tensor
from .kernels import fresh
from .residual import Residual


@compressors.register("sparseloco")
class SparseLoCo(Chunked):
    """SparseLoCo: top-k per chunk, values as 2-bit codes (sign + magnitude bit, 2 fp32 levels per chunk)."""
    x_memcpy = 19.0

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
        a, uppers, levels, at = vals.abs(), [], [], 0
        for _, rows, _, kk in lay.groups:                 # the kept values of a group of rows: (rows, kk)
            m = a[at:at + rows * kk].view(rows, kk)
            at += rows * kk
            lo, hi = m.amin(1), m.amax(1)
            upper = m > ((lo + hi) / 2).unsqueeze(1)
            halves = []
            for half, empty in ((~upper, lo), (upper, hi)):
                n = half.sum(1)
                s = torch.where(half, m, 0.0).sum(1)
                halves.append(torch.where(n > 0, s / n.clamp(min=1), empty))   # the mean |v| of the half
            uppers.append(upper.reshape(-1))
            levels.append(torch.stack(halves, 1).reshape(-1))
        upper = torch.cat(uppers) if uppers else a.bool()          # (an empty tensor: no groups)
        codes = upper.to(torch.uint8).bitwise_or_(vals.lt(0).to(torch.uint8).bitwise_left_shift_(1))
        levels = torch.cat(levels) if levels else a.new_zeros(0)
        return Payload([*pack_index(local, self.chunk), pack(codes, 2, inplace=True), levels],
                       ctx=self.context(tensor.shape, tensor.dtype))

    def _contribution(self, payload, lay) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group of rows (`lay.groups`): (in-chunk indices, fp32 values), each (rows, kept per row)."""
        local, used = unpack_index(payload.tensors, lay.kept, self.chunk)
        codes = unpack(payload.tensors[used], 2, lay.kept)
        levels = payload.tensors[used + 1].reshape(-1)
        out, at, row = [], 0, 0
        for _, rows, _, kk in lay.groups:
            c = codes[at:at + rows * kk].view(rows, kk)
            lv = levels[2 * row:2 * (row + rows)].view(rows, 2)                 # (low, high) of each row
            vals = lv.gather(1, c.bitwise_and(1).long())
            out.append((local[at:at + rows * kk].view(rows, kk), torch.where(c >= 2, -vals, vals)))   # bit 1: sign
            at, row = at + rows * kk, row + rows
        return out

    def _sum32(self, payloads):
        """Σ of the ranks' values into the chunks they came from: one scatter-add per group of rows (rows ×
        chunk) over every rank's entries side by side."""
        lay = self.layouts(payloads[0].ctx["numel"])
        parts = [self._contribution(p, lay) for p in payloads]
        out = fresh(lay.n, torch.float32, payloads[0].tensors[0].device).zero_()       # (mapped already)
        for i, (start, rows, width, _) in enumerate(lay.groups):
            idx, vals = zip(*(part[i] for part in parts))
            idx, vals = (idx[0], vals[0]) if len(parts) == 1 else (torch.cat(idx, 1), torch.cat(vals, 1))
            out[start:start + rows * width].view(rows, width).scatter_add_(1, idx, vals)
        return out

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
