"""Structured state between workers, never pickled: the optimizer state survivors take from the new rank 0
(`Trainer._recover`), a newcomer's state in an elastic job, a short string such as torchft's Lighthouse address
(`broadcast_text`).

`torch.distributed.broadcast_object_list` and its kin pickle: a worker that receives runs whatever the bytes say.
Here the sender writes a JSON header describing the tree and one byte buffer holding every tensor's bytes; the
receiver parses the header with `json` (no code runs), checks it against this grammar and builds fresh tensors of
the declared dtypes and shapes from the bytes:

    value   := null | true | false | number | string            (JSON's own; NaN and the infinities allowed)
             | {"T": [dtype, shape]}                             a tensor; dtype one of DTYPES, shape [int >= 0, ...]
             | {"D": [[key, value], ...]}                        a dict; keys are strings or integers
             | {"L": [value, ...]} | {"U": [value, ...]}         a list, a tuple

Tensors follow each other in the buffer in the header's order, each at an offset rounded up to 8 bytes; the
buffer's length must be exactly what the header declares. Anything else is a ValueError naming what is wrong.
Three messages (`transfer`): the two lengths, the header, the buffer.
"""
from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool)}
MAX_HEADER = 64 << 20       # bytes of JSON: far more than any optimizer's layout needs
MAX_DEPTH = 64
ALIGN = 8


def aligned(n: int) -> int:
    """`n` bytes rounded up to the next tensor's offset in the buffer (a multiple of ALIGN)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(obj) -> tuple[bytes, list[torch.Tensor]]:
    """(the JSON header, the tensors in header order) of `obj`; a TypeError for anything outside the grammar."""
    tensors: list[torch.Tensor] = []

    def walk(x, depth):
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            name = str(x.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TypeError(f"tensor of dtype {x.dtype} (valid: {', '.join(DTYPES)})")
            tensors.append(x.detach())
            return {"T": [name, list(x.shape)]}
        if isinstance(x, dict):
            bad = [k for k in x if isinstance(k, bool) or not isinstance(k, (int, str))]
            if bad:
                raise TypeError(f"dict key {bad[0]!r} is neither a string nor an integer")
            return {"D": [[k, walk(v, depth + 1)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"L" if isinstance(x, list) else "U": [walk(v, depth + 1) for v in x]}
        raise TypeError(f"{type(x).__name__} is not part of the state format (tensors, numbers, strings, "
                        f"None, dicts, lists, tuples)")

    header = json.dumps(walk(obj, 0), separators=(",", ":")).encode()
    return header, tensors


def pack(obj, device="cpu") -> tuple[bytes, torch.Tensor]:
    """(the JSON header, one uint8 buffer on `device` holding the bytes of `obj`'s tensors, each at its aligned
    offset): what `decode` takes."""
    header, tensors = encode(obj)
    sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    off = 0
    for t, size in zip(tensors, sizes):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        buffer[off:off + raw.numel()].copy_(raw)
        off += size
    return header, buffer


def check_lengths(n_header: int, n_buffer: int) -> None:
    """A ValueError unless a received header of `n_header` bytes and a buffer of `n_buffer` are acceptable (read
    before anything of those sizes is allocated)."""
    if not (0 < n_header <= MAX_HEADER and n_buffer >= 0):
        raise ValueError(f"malformed state: header of {n_header} bytes (at most {MAX_HEADER}), buffer of {n_buffer}")


def layout(header: bytes) -> tuple[object, list[tuple[torch.dtype, list[int], int]]]:
    """The header parsed and checked: (the tree, [(dtype, shape, offset)] of its tensors in order, then
    (None, [], the buffer's length)). A receiver checks a header with it before allocating the buffer."""
    try:
        tree = json.loads(header.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"malformed state header: {e}") from None
    specs: list[tuple[torch.dtype, list[int], int]] = []
    end = [0]

    def check(x, depth):
        if depth > MAX_DEPTH:
            raise ValueError(f"malformed state header: nested deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, int, float, str)):
            return
        if not (isinstance(x, dict) and len(x) == 1 and next(iter(x)) in ("T", "D", "L", "U")):
            raise ValueError(f"malformed state header: unexpected {str(x)[:80]}")
        (tag, body), = x.items()
        if tag == "T":
            ok = (isinstance(body, list) and len(body) == 2 and body[0] in DTYPES and isinstance(body[1], list)
                  and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in body[1]))
            if not ok:
                raise ValueError(f"malformed state header: bad tensor {str(body)[:80]}")
            dtype = DTYPES[body[0]]
            specs.append((dtype, body[1], end[0]))
            nbytes = math.prod(body[1]) * dtype.itemsize
            end[0] = aligned(end[0] + nbytes)
            return
        if not isinstance(body, list):
            raise ValueError(f"malformed state header: {tag} holds {type(body).__name__}, not a list")
        for item in body:
            if tag == "D":
                if not (isinstance(item, list) and len(item) == 2 and not isinstance(item[0], bool)
                        and isinstance(item[0], (int, str))):
                    raise ValueError(f"malformed state header: bad dict entry {str(item)[:80]}")
                check(item[1], depth + 1)
            else:
                check(item, depth + 1)

    check(tree, 0)
    return tree, specs + [(None, [], end[0])]   # the last entry: the buffer's length


def decode(header: bytes, buffer: torch.Tensor):
    """The state `encode` described, its tensors built from `buffer` (uint8; on the device they arrive on)."""
    tree, specs = layout(header)
    total = specs.pop()[2]
    if buffer.numel() != total:
        raise ValueError(f"malformed state: {buffer.numel()} bytes of tensors, the header declares {total}")
    built = iter([buffer[off:off + math.prod(shape) * dtype.itemsize]
                  .view(dtype).reshape(shape).clone() for dtype, shape, off in specs])

    def build(x):
        if not isinstance(x, dict):
            return x
        (tag, body), = x.items()
        if tag == "T":
            return next(built)
        if tag == "D":
            return {k: build(v) for k, v in body}
        items = [build(v) for v in body]
        return items if tag == "L" else tuple(items)

    return build(tree)


def transfer(obj, mine: bool, move, device="cpu") -> tuple[bytes, torch.Tensor]:
    """(header, buffer) of `obj` moved in three messages by `move(tensor)`, which sends a tensor where `mine` (the
    side that has `obj`) and fills it in place elsewhere (a broadcast; a send or a receive): the two lengths, the
    header, the buffer. Each received length and header is checked before anything of its size is allocated;
    `decode` builds the state."""
    if mine:
        header, buffer = pack(obj, device)
        lengths = torch.tensor([len(header), buffer.numel()], dtype=torch.int64, device=device)
    else:
        lengths = torch.zeros(2, dtype=torch.int64, device=device)
    move(lengths)
    n_header, n_buffer = (int(v) for v in lengths.tolist())   # host: once per state transfer
    check_lengths(n_header, n_buffer)
    head = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device) if mine
            else torch.zeros(n_header, dtype=torch.uint8, device=device))
    move(head)
    if not mine:
        header = bytes(head.cpu().numpy().tobytes())
        layout(header)
        buffer = torch.zeros(n_buffer, dtype=torch.uint8, device=device)
    if n_buffer:
        move(buffer)
    return header, buffer


def broadcast_state(obj, src: int, group=None, device=None):
    """`obj` (given on rank `src`, a global rank; ignored elsewhere) on every rank of `group`: three broadcasts,
    nothing pickled (see the module's doc). Returns the state on every rank (freshly built off `src`)."""
    move = lambda t: dist.broadcast(t, src=src, group=group)     # noqa: E731
    return decode(*transfer(obj, dist.get_rank() == src, move, torch.device(device or "cpu")))


def broadcast_text(text: str | None, src: int, group=None, device=None, limit: int = 4096) -> str:
    """A short UTF-8 string from rank `src` (a global rank) to every rank of `group`; at most `limit` bytes."""
    device = torch.device(device or "cpu")
    mine = dist.get_rank() == src
    data = text.encode() if mine else b""
    if mine and len(data) > limit:
        raise ValueError(f"text of {len(data)} bytes, at most {limit}")
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)
    size = int(n.item())     # host: once per text
    if not 0 <= size <= limit:
        raise ValueError(f"malformed text: {size} bytes (at most {limit})")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine and size
           else torch.zeros(size, dtype=torch.uint8, device=device))
    if size:
        dist.broadcast(buf, src=src, group=group)
    try:
        return bytes(buf.cpu().numpy().tobytes()).decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"malformed text: {e}") from None
