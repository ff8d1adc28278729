"""Tensor helpers every layer may use: flat buffers seen as the tensors they are made of, copies outside autograd,
a digest of their bytes."""
from __future__ import annotations

import hashlib

import torch


def views(flat: torch.Tensor, like) -> list[torch.Tensor]:
    """`flat`, the tensors `like` concatenated (flattened), as views of it shaped like each of them."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like)]


def copy_each(tensors: list[torch.Tensor], sources) -> None:
    """Copy each of `sources` into the tensor beside it (outside autograd: parameters too)."""
    with torch.no_grad():
        for t, s in zip(tensors, sources):
            t.copy_(s)


def copy_flat(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy `flat`, the tensors concatenated (flattened), into them."""
    copy_each(tensors, views(flat, tensors))


def digest(tensors) -> int:
    """48 bits of the sha256 of the tensors' bytes (exact in a float64, for an agreement among ranks; host: it
    reads the tensors)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:6], "little")
