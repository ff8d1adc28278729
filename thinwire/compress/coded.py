"""`A+B`: compressor A followed by the lossless coder B (`qsgd+elias`, `qsgd+huffman`, `topk+golomb`, …).

The registry resolves any "compressor+coder" name to `Coded(compressor, coder)`, which takes the compressor's
parameters. Quantizers with integer levels (`bits` packed codes, e.g. qsgd) get their levels coded, zig-zagged
around the zero level for Elias (0 → one bit), as they are for Huffman; sparsifiers get their sorted index gaps
coded (Golomb-Rice or Elias; the pairs reordered by index, which changes nothing in their sum). Coded payloads
are variable-length and not summable (all-gathered), and decode(encode(p)) gives back the compressor's payload bit
for bit: the result equals the uncoded compressor's.
"""
from __future__ import annotations

import copy
import inspect

import torch

from ..errors import UserError
from . import compressors
from ._sparse import SparseCompressor, index_dtype
from .base import Compressor, Payload
from .bitpack import pack, packed_nbytes, unpack
from .coding import coders, unzigzag, zigzag
from .golomb import gaps, ungaps

LEVEL_CODERS = ("elias", "eliasdelta", "huffman")
INDEX_CODERS = ("elias", "eliasdelta", "golomb")


def _to_host(head: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A coded stream's int32 header and bytes on the host (the coders are numpy) in one device-to-host copy."""
    if head.device.type == "cpu" and data.device.type == "cpu":
        return head, data
    nh = head.nbytes
    both = torch.cat([head.reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8)]).cpu()
    return both[:nh].view(head.dtype), both[nh:]


class Coded(Compressor):
    """A compressor's payload, losslessly coded (all-gathered: coded payloads cannot be summed)."""

    linear = False
    aggregation = "allgather"

    def __init__(self, base: Compressor, coder: str):
        self.base, self.coder = base, coders.get(coder)
        self.name = f"{base.name}+{coder}"
        self.unbiased, self.randomness, self.is_sparse = base.unbiased, base.randomness, base.is_sparse
        if isinstance(base, SparseCompressor):
            self.mode, valid = "indices", INDEX_CODERS
            base.dense_ok = False          # coded gaps make the pairs cheaper than the dense tensor they replace
        elif hasattr(base, "bits") and base.aggregation in ("allreduce", "allgather"):
            self.mode, valid = "levels", LEVEL_CODERS
        else:
            raise UserError(f"{self.name}: the coding stage codes integer levels (qsgd, qsparse) or sparse index "
                            f"gaps (topk, dgc, gaussiank, threshold, stc, qsparse); {base.name!r} has neither")
        if coder not in valid:
            raise UserError(f"{self.name}: {base.name!r} payloads are coded by {self.mode}; valid coders: "
                            f"{', '.join(valid)}")
        # levels are zig-zagged around the zero level for Elias (0 -> one bit), coded as they are for Huffman
        self._offset = int(getattr(base, "levels", 0)) if coder != "huffman" else 0
        self._nominal: dict[int, float] = {}

    # -- levels (quantizers) -------------------------------------------------------------------------
    def _encode_levels(self, p: Payload) -> list[torch.Tensor]:
        bits, n = self.base.bits, p.ctx["numel"]
        codes = unpack(p.tensors[0], bits, n).to(torch.int64)
        sym = zigzag(codes - self._offset) if self._offset else codes
        head, data = self.coder.encode(sym.cpu())                  # entropy coders run on the host (numpy)
        return [head.to(sym.device), data.to(sym.device), *p.tensors[1:]]

    def _decode_levels(self, tensors) -> list[torch.Tensor]:
        sym = self.coder.decode(*_to_host(tensors[0], tensors[1])).to(tensors[0].device)
        codes = unzigzag(sym) + self._offset if self._offset else sym
        return [pack(codes.to(torch.uint8), self.base.bits), *tensors[2:]]

    # -- indices (sparsifiers) -----------------------------------------------------------------------
    def _encode_indices(self, p: Payload) -> list[torch.Tensor]:
        ts = p.tensors
        pos = self.base.index_slot
        idx = ts[pos].reshape(-1).to(torch.int64)
        k = idx.numel()
        order = torch.sort(idx, stable=True)
        g = gaps(order.values).cpu()           # the coder runs on the host: one copy there, checked there
        if k and bool((g < 0).any()):
            raise ValueError(f"{self.name}: repeated indices cannot be gap-coded")
        head, data = self.coder.encode(g)
        head, data = head.to(idx.device), data.to(idx.device)
        rest = [self._permute(t, order.indices, k) for i, t in enumerate(ts) if i != pos]
        return [head, data, *rest]

    def _permute(self, t, perm, k):
        t = t.reshape(-1)
        if t.numel() == k and k > 1:
            return t[perm]
        b = getattr(self.base, "bits", 1)
        if t.dtype == torch.uint8 and k > 1 and t.numel() == packed_nbytes(k, b):   # packed per-element codes
            return pack(unpack(t, b, k)[perm].contiguous(), b)
        return t

    def _decode_indices(self, tensors, numel: int) -> list[torch.Tensor]:
        pos = self.base.index_slot
        idx = ungaps(self.coder.decode(*_to_host(tensors[0], tensors[1]))).to(tensors[0].device, index_dtype(numel))
        rest = list(tensors[2:])
        return rest[:pos] + [idx] + rest[pos:]

    # -- the compressor interface --------------------------------------------------------------------
    def compress(self, tensor, key=None, step=0, agreed=None):
        p = self.base.compress(tensor, key, step)
        if self.mode == "levels":
            return Payload(self._encode_levels(p), ctx=p.ctx)          # the compressor's own ctx
        ts = self._encode_indices(p)
        if sum(t.nbytes for t in ts) > tensor.numel() * tensor.element_size():   # coded pairs outweigh the tensor:
            dense = self.base.densify(p)                                          # send it whole (no gaps to code)
            ts = ts if dense is None else self._encode_indices(dense)
        return Payload(ts, ctx=p.ctx)

    def context(self, shape, dtype, key=None, step=0):
        return self.base.context(shape, dtype, key, step)

    def decode(self, payload: Payload) -> Payload:
        """The compressor's own payload back, exactly."""
        ts = [t.reshape(-1) for t in payload.tensors]    # ctx: the compressor's (a sparsifier's: shape, dtype, numel)
        ts = self._decode_levels(ts) if self.mode == "levels" else self._decode_indices(ts, payload.ctx[2])
        return Payload(ts, payload.ctx)

    def decompress(self, payload):
        return self.base.decompress(self.decode(payload))

    def aggregate(self, payloads):
        return self.base.aggregate([self.decode(p) for p in payloads])

    def nominal_bits(self, numel: int) -> float:
        """Coded bits per element on a typical (Gaussian) tensor: measured once per size on ≤ 2^18 elements
        (the density, hence the gap statistics, is kept), wire headers included."""
        if numel not in self._nominal:
            m = min(int(numel), 1 << 18)
            x = torch.randn(m, generator=torch.Generator().manual_seed(0), device="cpu")   # a CPU probe of sizes only
            probe = copy.copy(self)                     # a copy of the compressor: its random state stays as is
            probe.base = copy.deepcopy(self.base)
            p = probe.compress(x, key="nominal", step=0)
            self._nominal[numel] = p.nbytes * 8.0 / max(1, m)
        return self._nominal[numel]

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state):
        self.base.load_state_dict(state)


def compose(name: str):
    """The constructor of "compressor+coder": the compressor's parameters, returning `Coded`."""
    base_name, _, coder_name = name.rpartition("+")
    base_cls = compressors.lookup(base_name)
    coders.lookup(coder_name)

    def build(**params):
        return Coded(compressors.get(base_name, **params), coder_name)
    build.__signature__ = inspect.signature(base_cls)
    build.__doc__ = f"{base_name} followed by the lossless {coder_name} coder"
    build.name = name
    return build


compressors.compose = compose
__all__ = ["Coded", "compose"]
