"""Device-side machinery of the compressors: fused kernels, host reads, and randomness every device agrees on.

Fused kernels. A compressor's elementwise work is written once, as a plain function of torch ops (the eager
source of truth), and wrapped by `fused`: on a CUDA tensor of at least `COMPILE_MIN` elements it runs compiled
by `torch.compile` (Inductor emits one Triton kernel per fused group, so the work reads and writes memory once
instead of once per op); elsewhere (the CPU, small tensors, no Triton, `THINWIRE_COMPILE=0`) it runs as it is.
The compiled and the eager function compute the same thing; they may differ in the last bit of a float where
the compiler contracts a multiply and an add into one fused multiply-add.

Host reads. A value a device tensor carries reaches the host through `host_read`: on CUDA one asynchronous copy
into pinned memory and a wait on that copy alone (the host waits for the work queued before it, as any read
must, and no more: not a synchronisation of the device, and not one torch's sync debug mode reports).

Randomness every device agrees on. `random_bits(key, n)` hashes (key, index) with integer tensor ops (exact on
every device), so a seed names the same numbers on the CPU and on a GPU, and every rank computes them where
its tensors live: no host generator, no copy from the host, no state but the key (see `Stream`).
"""
from __future__ import annotations

import functools
import os
import warnings
import zlib
from typing import Any, Callable

import torch

COMPILE_MIN = 1 << 16          # below this many elements a kernel launch costs more than the passes it saves
_MASK = 0xFFFFFFFF
_MUL = (0x2C1B3C6D, 0x297A2D39)    # odd multipliers < 2^31: a 32-bit value times one fits in int64


def host_read(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host (itself when it is there already): on CUDA an asynchronous copy into pinned memory and
    a wait on an event recorded after it. The caller reads the values (`.tolist()`, `bool()`): one host read."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)     # the host copy
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host


def _compiling() -> bool:
    if os.environ.get("THINWIRE_COMPILE", "1") == "0":
        return False
    try:
        from torch.utils._triton import has_triton
        return has_triton()
    except ImportError:        # pragma: no cover - torch without the helper
        return False


def fused(fn: Callable) -> Callable:
    """`fn` (tensors first; the first decides the device and size) compiled on CUDA for large tensors, eager
    elsewhere. A compilation that fails warns once and leaves `fn` eager for the rest of the process."""
    state: dict[str, Any] = {"compiled": None, "off": False}

    @functools.wraps(fn)
    def run(*args):
        t = args[0]
        if state["off"] or t.device.type != "cuda" or t.numel() < COMPILE_MIN or not _compiling():
            return fn(*args)
        if state["compiled"] is None:
            state["compiled"] = torch.compile(fn, dynamic=True)
        try:
            return state["compiled"](*args)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop training: eager is correct
            state["off"] = True
            warnings.warn(f"thinwire: torch.compile of {fn.__name__} failed ({type(exc).__name__}: {exc}); "
                          f"running it eagerly", RuntimeWarning, stacklevel=2)
            return fn(*args)

    run.eager = fn
    return run


def seed_of(*parts: Any) -> int:
    """A 64-bit key every process derives identically from `parts` (Python's hash() is salted per process)."""
    text = repr(parts).encode()
    return (zlib.crc32(text) << 32) | zlib.crc32(text[::-1] + b"#")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) (int64 values): xor-shift and multiply rounds, in place."""
    for m in _MUL:
        x.bitwise_xor_(x >> 16).mul_(m).bitwise_and_(_MASK)
    return x.bitwise_xor_(x >> 16)


def random_bits(key: int, n: int, bits: int = 32, device="cpu", dtype=torch.int32) -> torch.Tensor:
    """`n` integers uniform on [0, 2^bits) (bits <= 31 for int32), a function of (key, index) alone: the same
    numbers on every device. Meant for up to a few thousand numbers (the rows and columns of a table of
    `Uniforms`, a sample's positions): each costs a dozen integer operations."""
    x = torch.arange(n, dtype=torch.int64, device=device).add_(key & _MASK).bitwise_and_(_MASK)
    x = _mix(_mix(x).bitwise_xor_((key >> 32) & _MASK))
    return x.bitwise_right_shift_(32 - bits).to(dtype)


class Stream:
    """A counter-based stream of random numbers: call i draws from key (seed, i), so the stream's whole state is
    the counter (checkpointed as two integers) and it makes the same numbers on every device."""

    def __init__(self, *seed: Any):
        self.key = seed_of(*seed)
        self.count = 0

    def next_key(self) -> int:
        self.count += 1
        return seed_of(self.key, self.count)

    def state_dict(self) -> dict:
        return {"key": self.key, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.count = int(state["key"]), int(state["count"])
