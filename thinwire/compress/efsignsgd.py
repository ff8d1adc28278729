"""`efsignsgd`: scaled sign (seed 002 §5.1, EF-SignSGD [58]: Delta = (||p||_1 / d) sign(p)), 1 bit per element plus
one fp32 scale. Meant to run with the `efsignsgd` (learning-rate-scaled) or `residual` memory. The scales differ
per rank, so payloads are gathered and each rank's scaled signs are summed."""
from __future__ import annotations

import torch

from . import compressors
from .base import Compressor, Payload
from .finite import check_scale
from .signsgd import sign_bits, signs


@compressors.register("efsignsgd")
class EFSignSGD(Compressor):
    unbiased = False
    linear = False
    randomness = "none"
    aggregation = "allgather"
    fixed_size = True         # the payload size depends only on the shape
    needs_momentum_first = True

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        n = flat.numel()
        l1 = torch.linalg.vector_norm(flat, ord=1, dtype=torch.float32).reshape(1)
        check_scale(l1, self.name, key, flat)
        scale = l1 / max(n, 1)
        return Payload([sign_bits(flat), scale], ctx=(tensor.shape, tensor.dtype, n))

    def decompress(self, payload):
        shape, dtype, n = payload.ctx
        return signs(payload.tensors[0], n, payload.tensors[1]).to(dtype).view(shape)

    def nominal_bits(self, numel):
        return 1.0 + 32.0 / max(numel, 1)
