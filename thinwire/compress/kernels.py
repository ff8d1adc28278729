"""Device-side machinery of the compressors: fused kernels, host reads, and randomness every device agrees on.

Fused kernels. A compressor's elementwise work is written once, as a plain function of torch ops (the eager
source of truth), and wrapped by `fused`: on a CUDA tensor of at least `COMPILE_MIN` elements it runs compiled by
`torch.compile` (one Triton kernel per fused group: memory read and written once instead of once per op);
elsewhere (the CPU, small tensors, no Triton, `THINWIRE_COMPILE=0`) as it is. Both compute the same thing, up to
the last bit of a float where the compiler contracts a multiply and an add into a fused multiply-add.

Blocks. On the CPU the same function runs block by block (`blockwise`), each block in the core's caches (ten ops
cost about one pass over memory instead of ten), with torch's intra-op thread pool off (a pool round trip per op
on a block costs more than the op).

Host reads. A value a device tensor carries reaches the host through `host_read`: on CUDA one asynchronous copy
into pinned memory and a wait on that copy alone (not a synchronisation of the device).

Randomness every device agrees on. `random_bits(key, n)` hashes (key, index) with integer tensor ops (exact on
every device): a seed names the same numbers on the CPU and on a GPU, computed where the tensors live, with no
host generator and no state but the key (`Stream`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import math
import os
import sys
import threading
import warnings
import zlib
from typing import Any, Callable

import torch

COMPILE_MIN = 1 << 16          # below this many elements a kernel launch costs more than the passes it saves
BLOCK = 1 << 18                # elements per CPU block: 1 MB of fp32 (its temporaries in L2/L3; less Python)
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


_HUGE = 1 << 21                # a transparent huge page
_madvise = None


def _huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask the kernel for huge pages under the not yet touched memory of the CPU tensor `t` (madvise
    MADV_HUGEPAGE over its 2 MB-aligned interior; a no-op where that is unavailable)."""
    global _madvise
    if _madvise is None:
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("not Linux")
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise = libc.madvise
        except (OSError, AttributeError):
            _madvise = False
    if _madvise:
        lo = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
        hi = (t.data_ptr() + t.nbytes) & ~(_HUGE - 1)
        if hi > lo:
            _madvise(lo, hi - lo, 14)            # MADV_HUGEPAGE
    return t


def fresh(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """torch.empty for an output a compressor hands back (a payload, a decompressed tensor). A large fresh CPU
    tensor's 4 KB page faults cost several memcpys of it (a 64 MB output: ~5x a copy into mapped memory; ~1.2x on
    huge pages, what THP_MEM_ALLOC_ENABLE=1 gives PyTorch's own): it comes from `_Pool`, memory mapped already."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 2 * _HUGE and torch.device(device).type == "cpu":
        buf = _POOL.take(nbytes)
        if buf is not None:
            return buf[:nbytes].view(dtype).view(shape)
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.nbytes >= 2 * _HUGE:
        _huge_pages(t)
    return t


class _Pool:
    """Large CPU outputs on memory mapped already: a caching allocator for `fresh`, as PyTorch's is for CUDA. A
    buffer is handed out again once no tensor references its storage (its use count and its Python object's
    reference count back at the pool's own; a view or a held storage keeps it out). Free buffers count against
    `THINWIRE_POOL_MB` (default 512), past which the least recently used go. A torch whose counts do not behave so
    (checked once) gets no pooling."""

    def __init__(self, limit_mb: int):
        self.limit = limit_mb << 20
        self.bufs: list[torch.Tensor] = []          # uint8 CPU buffers, most recently handed out last
        self.lock = threading.Lock()
        self.baseline = None                         # the counts of a buffer only the pool holds (None: unchecked)

    @staticmethod
    def _counts(buf: torch.Tensor):
        s = buf.untyped_storage()
        return torch._C._storage_Use_Count(s._cdata), sys.getrefcount(s)

    def _works(self) -> bool:
        if self.baseline is None:
            try:
                b = torch.empty(64, dtype=torch.uint8, device="cpu")    # (a probe of the counts, on the host)
                alone = self._counts(b)
                view = b[8:].view(torch.int32)
                with_view = self._counts(b)
                del view
                held = b[8:].untyped_storage()
                with_storage = self._counts(b)
                del held
                ok = with_view != alone and with_storage != alone and self._counts(b) == alone
                self.baseline = alone if ok else False
            except (AttributeError, RuntimeError, TypeError):      # no such private API in this torch
                self.baseline = False
        return self.baseline is not False

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A free pooled buffer of `nbytes` rounded up to huge pages (a new one, pooled, when none is free);
        None when pooling is off."""
        if self.limit <= 0 or not self._works():
            return None
        size = -(-nbytes // _HUGE) * _HUGE
        with self.lock:
            free = [i for i, b in enumerate(self.bufs) if self._counts(b) == self.baseline]
            for i in free:
                if self.bufs[i].numel() == size:
                    buf = self.bufs.pop(i)
                    self.bufs.append(buf)
                    return buf[:]                 # (a view: counted while the caller's tensors live)
            idle, gone = sum(self.bufs[i].numel() for i in free), []
            for i in free:                        # past the limit, the least recently used free buffers go
                if idle + size <= self.limit:
                    break
                idle -= self.bufs[i].numel()
                gone.append(i)
            for i in reversed(gone):
                del self.bufs[i]
            if size > self.limit:
                return None
            buf = _huge_pages(torch.empty(size, dtype=torch.uint8, device="cpu"))    # (a host output)
            self.bufs.append(buf)
            return buf[:]


_POOL = _Pool(int(os.environ.get("THINWIRE_POOL_MB", "512")))


class _Arena(threading.local):
    """Per-thread scratch memory of the blocks: `scratch` hands out slices of one buffer, taken back at the next
    block. (A block's temporaries are a few hundred KB: malloc maps and unmaps each one, and its page faults
    then cost more than the op.)"""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8, device="cpu")    # grown on first use
        self.views: dict = {}                                          # the buffer as each dtype
        self.off = 0
        self.active = False


_ARENA = _Arena()


def scratch(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A temporary of a kernel, for an op's `out=`: inside `blockwise` on the CPU a slice of this thread's arena,
    valid until the next block (never return one: copy it out); elsewhere torch.empty. (Called a dozen times a
    block: kept to one tensor op.)"""
    a = _ARENA
    if not a.active or (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    count = shape if isinstance(shape, int) else math.prod(shape)
    nbytes = -(-count * dtype.itemsize // 64) * 64
    if a.off + nbytes > a.buf.numel():
        a.buf = fresh(max(2 * a.buf.numel(), a.off + nbytes, 1 << 22), torch.uint8)   # (old slices keep the old)
        a.views = {}
        a.off = 0
    view = a.views.get(dtype)
    if view is None:
        view = a.views[dtype] = a.buf.view(dtype)
    start = a.off // dtype.itemsize
    a.off += nbytes
    t = view[start:start + count]
    return t if isinstance(shape, int) or len(shape) == 1 else t.view(shape)


@functools.cache
def _triton() -> bool:
    """Triton installed, and a GPU of compute capability 7.0 or more (what Inductor's Triton back end needs)."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.get_device_capability()[0] >= 7


def fused(fn: Callable) -> Callable:
    """`fn` (tensors first; the first decides the device and size) compiled on CUDA for large tensors, eager
    elsewhere. A compilation that fails warns once and leaves `fn` eager for the rest of the process."""
    state: dict[str, Any] = {"compiled": None, "off": False}

    @functools.wraps(fn)
    def run(*args):
        t = args[0]
        if (state["off"] or t.device.type != "cuda" or t.numel() < COMPILE_MIN
                or os.environ.get("THINWIRE_COMPILE", "1") == "0" or not _triton()):
            return fn(*args)
        if state["compiled"] is None:
            # automatic dynamic shapes: the first size compiles static, a second recompiles with symbolic sizes;
            # the Python ints (a bucket, a chunk, a level count) stay constants, so index arithmetic divides by
            # constants (dynamic=True made them symbolic: 64-bit divisions per element, kernels 5-10x slower)
            state["compiled"] = torch.compile(fn, dynamic=None)
        try:
            return state["compiled"](*args)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop training: eager is correct
            state["off"] = True
            warnings.warn(f"thinwire: torch.compile of {fn.__name__} failed ({type(exc).__name__}: {exc}); "
                          f"running it eagerly", RuntimeWarning, stacklevel=2)
            return fn(*args)

    run.eager = fn
    return run


def _span(spec: tuple[int, int], lo: int, hi: int) -> tuple[int, int]:
    """The part of a tensor holding elements [lo, hi) of the data, `spec` = (num, den): num entries per group of
    den elements, a partial group taking a whole one (4-bit codes: (4, 8), 4 bytes per 8 codes; one scale per
    chunk of 128: (1, 128)); lo is a multiple of den."""
    num, den = spec
    return lo // den * num, -(-hi // den) * num


def blockwise(kernel: Callable, n: int, inputs: list[tuple[torch.Tensor, tuple[int, int]]],
              outputs: list[tuple[int, int]], *consts, align: int = 8):
    """`kernel(*input blocks, *consts)` over the `n` elements of the data, its results for the whole data as a
    tuple: on CUDA once over everything (`fused`), on the CPU block by block (`BLOCK` elements, a multiple of
    `align`) into outputs allocated once. `inputs` pair each tensor with its (num, den) entries per element
    (`_span`), or None for a tensor every block takes whole (a scale); `outputs` give the results' (num, den) (a
    block's result may run past its span: cut to it), or None for a per-block result (a partial sum, a count),
    concatenated over the blocks (one entry on CUDA)."""
    tensors = [t for t, _ in inputs]
    if n <= BLOCK // 4 or tensors[0].device.type != "cpu":
        run = kernel if tensors[0].device.type == "cpu" else _fused_once(kernel)
        return tuple(p if spec is None else p[:_span(spec, 0, n)[1]] for p, spec in zip(run(*tensors, *consts), outputs))
    block = max(align, BLOCK - BLOCK % align)
    outs = None
    with cpu_blocks() as next_block:
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            next_block()
            parts = kernel(*(t if spec is None else t[slice(*_span(spec, lo, hi))] for t, spec in inputs), *consts)
            outs = _store(outs, parts, outputs, n, lo, hi)
    return tuple(torch.cat(o) if spec is None else o for o, spec in zip(outs, outputs))


@contextlib.contextmanager
def cpu_blocks():
    """The setting of a loop over CPU blocks: torch's intra-op pool off (this thread's, and the default of
    threads started meanwhile; restored after) and `scratch` from this thread's arena. Yields the function to
    call at each block's start (it takes the arena back: the last block's temporaries are dead by then)."""
    threads = torch.get_num_threads()
    arena, was = _ARENA, _ARENA.active
    if threads > 1:
        torch.set_num_threads(1)
    arena.active = True

    def next_block():
        arena.off = 0
    try:
        yield next_block
    finally:
        arena.active, arena.off = was, 0
        if threads > 1:
            torch.set_num_threads(threads)


def _store(outs, parts, outputs, n, lo, hi):
    """Copy a block's results into the whole outputs (allocated on the first block)."""
    if outs is None:
        outs = [[] if spec is None else fresh(_span(spec, 0, n)[1], p.dtype, p.device)
                for p, spec in zip(parts, outputs)]
    for o, p, spec in zip(outs, parts, outputs):
        if spec is None:
            o.append(p.reshape(-1).clone())
        else:
            a, b = _span(spec, lo, hi)
            o[a:b] = p[:b - a]
    return outs


_fused_once = functools.cache(fused)      # a kernel's `fused` wrapper, made once


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
