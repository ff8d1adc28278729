"""`demo`: DeMo, Decoupled Momentum Optimization (Peng, Quesnelle, Kingma et al. 2024, arXiv 2411.19870), as a
memory and a compressor.

The paper's Algorithm 1 on each worker, with g the local gradient, β the momentum decay, chunk size s, k kept:
    m ← β m + g                              accumulate the gradient in the local momentum      (memory `demo`)
    q ← ExtractFastComponents(m, s, k)       DCT-II of each s-chunk, top-k |coefficient| per chunk (compressor)
    m ← m − q                                 what is sent leaves the momentum                   (memory `demo`)
    Q ← Synchronize(q)                        all-gather of every worker's sparse coefficients
    x ← x − η sign(Q)                         the signed update (the optimizer's step; see `sign`)
Only each worker's fast components travel; the memory is error feedback with decay (`residual` with beta = β), so
sent + kept = β m + g exactly: the slow components stay and grow until they are sent. The momentum lives in the
memory: where gradients are exchanged the Trainer runs the optimizer without momentum (`replaces_momentum`).

The transform: the flattened tensor is cut into chunks of `chunk` elements (the tail gets its own size), each
multiplied by the orthonormal DCT-II basis C[u, j] = c_u cos(π (2j + 1) u / (2s)), c_0 = √(1/s), c_u = √(2/s)
(one matmul per size; the inverse is the transpose). The reference code transforms 2-D blocks of weight
matrices; 1-D chunks of the flat tensor serve any tensor or bucket. Payload: in-chunk indices (ceil(log2 chunk)
bits each, packed) and the kept coefficients in the tensor's dtype. "allgather": the ranks' coefficients summed in
fp32 in coefficient space, then one inverse DCT (the reference averages coinciding coefficients; a sum keeps the
exchange's mean). `sign=True` makes the exchange return sign(Σ_ranks IDCT(q)) ("majority") so a plain SGD step
applies DeMo's signed update, for exchanged gradients (bsp, the DDP hook); where models or pseudo-gradients are
averaged (localsgd, dts, diloco) keep `sign=false`. `decompress` gives this rank's own IDCT(q), which the memory
subtracts. The paper scales g by η inside the momentum; here the optimizer's lr scales the step (the same update
under `sign=True` at a constant lr).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import compressors, memories
from ._chunks import Chunked, Layouts, check_chunk, check_topk, index_nbytes, pack_index, unpack_index
from .base import Payload, constant
from .finite import check_tensor
from .residual import Residual

def dct_basis(n: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """(n, n) orthonormal DCT-II matrix C (row u = frequency u): coefficients = C @ x, x = C.T @ coefficients.
    Built once in float64 on the host (the same numbers on every device), kept once per (n, dtype, device)."""
    def build():
        j = torch.arange(n, dtype=torch.float64, device="cpu")
        u = j.view(-1, 1)
        c = torch.cos(math.pi * (2 * j + 1) * u / (2 * n)) * math.sqrt(2.0 / n)
        c[0] = math.sqrt(1.0 / n)
        return c.to(dtype)
    return constant(("dct", n, dtype), device, build)


def chunked_dct(x: torch.Tensor, layout, inverse: bool = False) -> torch.Tensor:
    """The DCT-II (or its inverse) of every chunk of flat fp32 `x`, one matmul per group of equal chunks."""
    out = torch.empty_like(x)
    for start, rows, width, _ in layout.groups:
        block, c = x[start:start + rows * width].view(rows, width), dct_basis(width, x.device, x.dtype)
        torch.matmul(block, c if inverse else c.T, out=out[start:start + rows * width].view(rows, width))
    return out


@compressors.register("demo")
class DeMo(Chunked):
    """DeMo: chunked DCT-II, top-k coefficients per chunk (indices + values); sum, inverse DCT (sign=true: its sign)."""
    x_memcpy = 28.0

    def __init__(self, chunk: int = 64, topk: int = 4, sign: bool = False):
        self.chunk = check_chunk("demo", chunk)
        self.topk = check_topk("demo", topk, self.chunk)
        self.sign = bool(sign)
        if self.sign:
            self.aggregation = "majority"       # the exchange returns sign(aggregate)
        self.layouts = Layouts(self.chunk, self.topk)

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        check_tensor(flat, self.name, key)
        lay = self.layouts(flat.numel())
        coeff = chunked_dct(flat.to(torch.float32), lay)
        local, vals = lay.topk(coeff)
        vdtype = tensor.dtype if tensor.is_floating_point() else torch.float32
        return Payload([*pack_index(local, self.chunk), vals.to(vdtype)],
                       ctx=self.context(tensor.shape, tensor.dtype))

    def _sum32(self, payloads):
        """The inverse DCT of Σ over payloads of their sparse coefficients (summed dense, in fp32)."""
        lay = self.layouts(payloads[0].ctx["numel"])
        pos, vals = [], []
        for p in payloads:
            local, used = unpack_index(p.tensors, lay.kept, self.chunk)
            pos.append(lay.positions(local))
            vals.append(p.tensors[used].reshape(-1).to(torch.float32))
        coeff = torch.zeros(lay.n, device=vals[0].device).index_add_(0, torch.cat(pos), torch.cat(vals))
        return chunked_dct(coeff, lay, inverse=True)

    def nominal_bits(self, numel):
        lay = self.layouts(numel)
        return (8 * index_nbytes(lay.kept, self.chunk) + 32.0 * lay.kept) / max(numel, 1)


@memories.register("demo")
class DeMoMemory(Residual):
    """DeMo's decoupled momentum: m ← β m + g before compression, m ← m − sent after (error feedback with decay)."""

    replaces_momentum = True   # beta is its own decay; the optimizer runs without momentum (Trainer)

    def __init__(self, beta: float = 0.999):
        if not 0 <= beta < 1:
            raise UserError(f"demo memory: beta (the momentum decay) must be in [0, 1), got {beta}")
        super().__init__(beta=beta, gamma=1.0)
