"""The compressor and memory interfaces. A compressor is pure: tensor -> payload -> tensor, no communication.

A `Payload` holds the tensors that cross the wire (already packed: bits, levels, indices, scales) and the local
context needed to decompress them, which never crosses the wire (shape, dtype: every rank knows them).
Each compressor declares its algebra so the exchange layer can pick the collective it allows:
- `unbiased`: E[decompress(compress(x))] = x;
- `linear`: payloads of different ranks may be summed element-wise (by all-reduce) and decompressed as one;
- `randomness`: "none", "shared" (every rank must draw the same numbers: seeded by step and key) or "local";
- `aggregation`: how the exchange combines ranks:
  "allreduce"  payload tensors are summed element-wise across ranks (after `sum_payload` widens them if the sum
               needs a wider type); `decompress` of the summed payload is the sum of the contributions.
               If the ranks must first agree on something (a shared scale), `agree` returns a small tensor that
               is all-reduced with max and handed to `compress(..., agreed=...)`.
  "allgather"  every rank's payload is gathered (sizes may differ); `aggregate(payloads)` sums the contributions.
  "majority"   the exchange returns the element-wise sign of `aggregate(payloads)`: for sign payloads the
               majority vote of the ranks' signs (signsgd), for DeMo's `sign=true` the sign of the summed update.
  "custom"     the compressor runs its own communication: `exchange(transport, tensor, key, step, shapes)` is a
               program (a generator, see `thinwire.comm.engine`: it yields a future whenever it needs its
               result) returning `(sum over ranks, this rank's own contribution)`; the exchange divides by the
               world size and feeds the contribution to the memory (PowerSGD).
Payloads of other ranks ("allgather", "majority") arrive as 1-D tensors of the same dtypes, in the same order,
with THIS rank's `ctx`: a compressor must put in `ctx` only what every rank knows (shape, dtype, a shared seed's
indices), never something about its own data. A rank that decodes without having compressed (a parameter server
decoding pushes, a worker decoding the server's compressed reply) asks `context(shape, dtype, key, step)` for the
ctx `compress` would have made: computed from what every rank knows, without compressing, touching no state. `fixed_size = True` says the payload size depends only on the
tensor's shape, so a gather can skip the size exchange.
`sum_payload` may also pre-scale (fp16 divides by the world size before the sum, as PyTorch's
`fp16_compress_hook` does, so the fp16 sum cannot overflow), as long as `decompress` of the summed payload still
returns the sum of the contributions (it records the scale in `ctx`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


def regroup(state: dict, old: list[tuple[Any, int]], new: list[tuple[Any, int]]) -> dict:
    """Per-key flat state (an error-feedback residual per bucket) carried over a change of bucketing.

    `old` and `new` list (key, numel) of consecutive flat buckets covering the same elements in the same order
    (the scheduler's buckets, backward order): each dict of `state` holding 1-D tensors under old keys gets them
    concatenated and cut at the new boundaries (a missing old key counts as zeros). Nothing is lost, so error
    feedback's invariant (sent + residual = inputs) holds across a re-plan such as MG-WFBP's."""
    old_keys, sizes = {k for k, _ in old}, [n for _, n in new]
    out = {}
    for name, d in state.items():
        held = [d[k] for k, _ in old if k in d] if isinstance(d, dict) else []
        if not held or not all(isinstance(t, torch.Tensor) and t.numel() == n
                                for t, n in ((d[k], n) for k, n in old if k in d)):
            out[name] = d       # not per-bucket flat state (e.g. PowerSGD's per-matrix Q): left as it is
            continue
        flat = torch.cat([d[k].reshape(-1) if k in d else held[0].new_zeros(n) for k, n in old])
        out[name] = {k: v for k, v in d.items() if k not in old_keys}
        out[name].update((k, t.clone()) for (k, _), t in zip(new, flat.split(sizes)))
    return out


def assemble(state: dict, key: Any, pieces: list[tuple[Any, int, int]]) -> dict:
    """Per-key flat state for a new bucket `key` made of `pieces` = [(old key, lo, hi)] in order: each dict of
    `state` holding 1-D tensors gets `key` → the concatenation of old[lo:hi] (zeros where the old key holds
    nothing, or is None). The old keys stay (a DDP bucket rebuild: buckets of any order and size)."""
    out = {}
    for name, d in state.items():
        flat = isinstance(d, dict) and d and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in d.values())
        if not flat:
            out[name] = d
            continue
        like = next(iter(d.values()))
        parts = [d[k][lo:hi] if k in d and d[k].numel() >= hi else like.new_zeros(hi - lo)
                 for k, lo, hi in pieces]
        out[name] = {**d, key: torch.cat(parts).clone()}
    return out


@dataclass
class Payload:
    tensors: list[torch.Tensor]
    ctx: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Compressor:
    name: ClassVar[str] = ""
    unbiased: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    randomness: ClassVar[str] = "none"
    aggregation: ClassVar[str] = "allreduce"
    fixed_size: ClassVar[bool] = False

    def compress(self, tensor: torch.Tensor, key: Any = None, step: int = 0, agreed=None) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def context(self, shape, dtype: torch.dtype, key: Any = None, step: int = 0) -> Any:
        """The `ctx` that `compress` gives the payload of a tensor of `shape` and `dtype` under (key, step),
        without its data (no compression, no change of state): what a receiver that did not compress decodes a
        payload with. Default: (shape, dtype, numel), the convention of most compressors; a compressor whose
        ctx holds something else (a shared seed's indices, a pre-scale) overrides it."""
        shape = torch.Size(shape)
        return (shape, dtype, shape.numel())

    def agree(self, tensor: torch.Tensor, key: Any = None, step: int = 0) -> torch.Tensor | None:
        """("allreduce" only) a small tensor all ranks must agree on (all-reduced with max) before compressing."""
        return None

    def sum_payload(self, payload: Payload, world_size: int) -> Payload:
        """("allreduce" only) the payload in a type wide enough to hold the sum of `world_size` of them."""
        return payload

    def aggregate(self, payloads: list[Payload]) -> torch.Tensor:
        """("allgather" only) the sum of the ranks' decompressed contributions."""
        out = self.decompress(payloads[0]).clone()
        for p in payloads[1:]:
            out += self.decompress(p)
        return out

    def nominal_bits(self, numel: int) -> float:
        """Bits per element the method nominally sends (for benchmarks and the planner)."""
        return 32.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rekey(self, old: list[tuple[Any, int]], new: list[tuple[Any, int]]) -> None:
        """The buckets changed (see `regroup`): carry per-bucket state over to the new keys."""
        self.load_state_dict(regroup(self.state_dict(), old, new))


class Memory:
    """Error feedback and its variants: `compensate` before compression, `update` after."""

    name: ClassVar[str] = ""

    def setup(self, world_size: int) -> None:
        """Called by the exchange with the number of ranks (DGC's local clipping threshold needs it)."""

    def compensate(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        return tensor

    def update(self, tensor: torch.Tensor, key: Any, sent: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rekey(self, old: list[tuple[Any, int]], new: list[tuple[Any, int]]) -> None:
        """The buckets changed (see `regroup`): carry per-bucket state over to the new keys."""
        self.load_state_dict(regroup(self.state_dict(), old, new))
