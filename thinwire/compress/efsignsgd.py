"""`efsignsgd`: scaled sign (EF-SignSGD: Karimireddy, Rebjock, Stich, Jaggi 2019, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes", arXiv 1901.09847, Algorithm 1:
Delta = (||p||_1 / d) sign(p)), 1 bit per element plus
one fp32 scale. Meant to run with the `efsignsgd` (learning-rate-scaled) or `residual` memory. The scales differ
per rank, so payloads are gathered and each rank's scaled signs are summed."""
from __future__ import annotations

from . import compressors
from .signsgd import SignSGD


@compressors.register("efsignsgd")
class EFSignSGD(SignSGD):
    """`signsgd`'s payload with its scale, gathered and summed instead of voted."""

    aggregation = "allgather"
    x_memcpy = 5.0

    def __init__(self):
        super().__init__(scale=True)
