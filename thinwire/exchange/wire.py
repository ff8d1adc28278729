"""One payload = one uint8 buffer, so a single (variable-size) all-gather carries all of a rank's tensors.

Layout: an int32 header `[count, (dtype code, numel) * count]` followed by each tensor's raw bytes, in order.
The header costs 4 + 8·count bytes (≤ 36 bytes for the payloads thinwire makes); shapes never travel (every
rank knows them), so tensors come back 1-D.
"""
from __future__ import annotations

import torch

from ..compress.kernels import host_read

_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_PREFIX = 4 + 8 * 8       # header bytes of up to 8 tensors: what `headers` copies to the host per buffer


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one uint8 buffer with a small header."""
    head = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot put a {t.dtype} tensor on the wire")
        head += [_CODE[t.dtype], t.numel()]
    device = tensors[0].device if tensors else "cpu"      # the header travels with the data
    parts = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]   # bool: its 0/1 bytes
    return torch.cat([torch.tensor(head, dtype=torch.int32, device=device).view(torch.uint8), *parts])


def headers(bufs: list[torch.Tensor]) -> list[list[int]]:
    """Each buffer's `(dtype code, numel) * count` on the host, for all of them in one device-to-host copy: the
    first `_PREFIX` bytes of every buffer side by side (a header of more than 8 tensors is read again in full)."""
    if not bufs:
        return []
    rows = torch.zeros(len(bufs), _PREFIX, dtype=torch.uint8, device=bufs[0].device)
    for row, b in zip(rows, bufs):
        m = min(b.numel(), _PREFIX)
        row[:m] = b.reshape(-1)[:m]
    host = host_read(rows).view(torch.int32).tolist()      # host: once per exchange (every rank's header together)
    out = []
    for b, head in zip(bufs, host):
        count = head[0]
        if 4 + 8 * count > _PREFIX:
            head = host_read(b[:4 + 8 * count].clone()).view(torch.int32).tolist()   # host: a header past _PREFIX bytes
        out.append(head[1:1 + 2 * count])
    return out


def unpack_all(bufs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`unpack` of each buffer (one exchange's payloads: every rank's), reading their headers in one host copy;
    the tensors stay on the buffers' device (copied out, so each is aligned for its dtype)."""
    out = []
    for buf, head in zip(bufs, headers(bufs)):
        off = 4 + 4 * len(head)
        ts = []
        for code, n in zip(head[0::2], head[1::2]):
            dtype = _DTYPES[code]
            ts.append(buf[off:off + n * dtype.itemsize].clone().view(dtype))
            off += n * dtype.itemsize
        out.append(ts)
    return out


def unpack(buf: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `pack` (for the payloads of an exchange, `unpack_all`: one host read of their headers)."""
    return unpack_all([buf])[0]


def packed_size(tensors: list[torch.Tensor]) -> int:
    """Bytes `pack(tensors)` takes."""
    return 4 + 8 * len(tensors) + sum(t.nbytes for t in tensors)
