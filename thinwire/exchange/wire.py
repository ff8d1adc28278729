"""One payload = one uint8 buffer, so a single (variable-size) all-gather carries all of a rank's tensors.

Layout: an int32 header `[count, (dtype code, numel) * count]` followed by each tensor's raw bytes, in order.
The header costs 4 + 8·count bytes (≤ 36 bytes for the payloads thinwire makes); shapes never travel (every
rank knows them), so tensors come back 1-D.
"""
from __future__ import annotations

import torch

_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().view(torch.uint8)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one uint8 buffer with a small header."""
    head = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot put a {t.dtype} tensor on the wire")
        head += [_CODE[t.dtype], t.numel()]
    device = tensors[0].device if tensors else "cpu"      # the header travels with the data
    parts = [torch.tensor(head, dtype=torch.int32, device=device).view(torch.uint8)] + [_bytes(t) for t in tensors]
    return torch.cat(parts)


def unpack(buf: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `pack` (tensors are copied out, so each is aligned for its dtype)."""
    count = int(buf[:4].clone().view(torch.int32)[0])
    head = buf[4:4 + 8 * count].clone().view(torch.int32).tolist()
    off = 4 + 8 * count
    out = []
    for i in range(count):
        dtype, n = _DTYPES[head[2 * i]], head[2 * i + 1]
        size = torch.empty(0, dtype=torch.uint8 if dtype == torch.bool else dtype, device="meta").element_size()
        raw = buf[off:off + n * size].clone()
        t = raw.view(torch.uint8 if dtype == torch.bool else dtype)
        out.append(t.to(torch.bool) if dtype == torch.bool else t)
        off += n * size
    return out


def packed_size(tensors: list[torch.Tensor]) -> int:
    """Bytes `pack(tensors)` takes."""
    return 4 + 8 * len(tensors) + sum(t.numel() * t.element_size() for t in tensors)
