"""`bf16`: cast to bfloat16 (fp32's exponent range with an 8-bit mantissa: a sum of ranks cannot overflow)."""
from __future__ import annotations

import torch

from . import compressors
from .fp16 import Cast


@compressors.register("bf16")
class BF16(Cast):
    """bf16 cast; summed in bf16 by all-reduce."""

    wire_dtype = torch.bfloat16
    x_memcpy = 2.0
