"""The non-finite policy: a NaN or Inf gradient raises `NonFiniteError` in `compress`, never a poisoned model.

Quantizers already reduce the tensor to a scale (a norm, a max, a mean), and a NaN or Inf anywhere makes that scale
non-finite, so the check costs nothing there; the scale-free ones (casts, signs) check a plain sum, and look closer
only when the sum is not finite (a finite tensor whose sum overflows is not an error).
"""
from __future__ import annotations

import torch

from .kernels import host_read


class NonFiniteError(FloatingPointError):
    """A tensor handed to a compressor holds NaN or Inf."""


def _fail(name: str, key) -> None:
    raise NonFiniteError(f"{name}: the tensor {key!r} holds NaN or Inf; lower the learning rate or use loss "
                         f"scaling / gradient clipping (compressors refuse non-finite input)")


def check_scale(value: torch.Tensor, name: str, key=None, tensor: torch.Tensor | None = None) -> None:
    """Raise if a reduction of the tensor (norm, max, sum) is not finite: the tensor holds NaN/Inf, or (when
    `tensor` is given and finite) its values are so large that the reduction overflows fp32."""
    if not bool(host_read(torch.isfinite(value).all())):         # host: the one read of a compress
        if tensor is not None and bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(f"{name}: the scale of tensor {key!r} overflows fp32 (values near 3e38); "
                                 f"clip the gradients")
        _fail(name, key)


def check_tensor(x: torch.Tensor, name: str, key=None) -> None:
    """Raise if `x` holds NaN or Inf (one cheap sum; a full check only when the sum is not finite)."""
    if x.numel() and not bool(host_read(torch.isfinite(x.sum()))):      # (x's own type: a widening sum copies x)
        if not bool(torch.isfinite(x).all()):
            _fail(name, key)
