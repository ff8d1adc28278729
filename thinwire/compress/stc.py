"""`stc`: Sparse Ternary Compression (Sattler et al.): top-k, then every kept value becomes μ·sign(g_i) with
one mean μ = mean_{i∈top-k} |g_i| for the tensor (Sattler, Wiedemann, Müller, Samek 2019,
"Robust and Communication-Efficient Federated Learning from Non-IID Data", arXiv 1903.02891).

Payload: indices, 1 bit per kept sign, one fp32 μ. Biased: use `--memory residual`.
"""
from __future__ import annotations

from . import compressors
from .topk import QuantizedTopK


@compressors.register("stc")
class STC(QuantizedTopK):
    """Sparse ternary compression: top-k positions, values μ·sign with one shared mean magnitude μ."""
    x_memcpy = 12.0

    def quantize(self, vals):
        return vals >= 0, vals.abs().mean().reshape(1)

    def dequantize(self, codes, scale):
        return (codes.float() * 2 - 1) * scale
