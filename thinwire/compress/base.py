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

Wire bits. `nominal_bits(numel)` is the payload as `compress` makes it (packed codes: what an all-gather
carries). A linear quantizer summed by all-reduce sends something else: its levels widened so that the sum of
`world_size` of them fits (`sum_payload`; gloo sums no int16, so those travel as int32) plus the scale agreed
first. `summed_bits(numel, world_size)` is that, and `wire_bits(numel, world_size, allreduce)` the collective the
exchange really picks at that world size with its bits: a linear compressor whose `pick_by_bytes` is set may go
either way, and `pick_collective` takes the one that puts fewer bytes on this rank's wire (the α-β counts of
`thinwire.net.cost`: all-reduce 2(n−1)/n of the summed payload on a ring, all-gather n−1 packed payloads), the
compressor's natural one on a tie. QSGD (4-bit codes, 8-bit summed levels) is gathered on 2–3 ranks and
all-reduced from 4; TernGrad (2-bit codes, 8-bit sums) is gathered up to 7 ranks; int8 (int32 sums) from 8 ranks
is all-reduced.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import UserError


GLOO_SUM_WIDEN = {torch.int16: torch.int32, torch.bool: torch.uint8}   # gloo's all-reduce has no int16 / bool sum
PICKABLE = ("allreduce", "allgather")
_CONSTANTS: dict = {}


def constant(key: tuple, device, build) -> torch.Tensor:
    """A constant tensor (a lookup table, a transform basis) built once on the host by `build()` and kept once per
    device, so every device holds the same numbers and a GPU gets no host copy per call. `key` names the tensor
    with its dtype and size, e.g. ("dct", n, torch.float32); callers must not modify the result."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:       # "cuda" and a tensor's "cuda:0": one entry
        device = torch.device("cuda", torch.cuda.current_device())
    k = (key, device)
    t = _CONSTANTS.get(k)
    if t is None:
        t = _CONSTANTS[k] = build().to(k[1])
    return t


def pick_collective(compressor: "Compressor", numel: int, world_size: int, allreduce: str = "ring") -> str:
    """The collective an exchange of `numel` elements through `compressor` runs at `world_size` ranks with the
    all-reduce algorithm `allreduce` ("gloo" is a ring): for a linear compressor that lets the exchange choose
    (`pick_by_bytes`), all-reduce of the summed payload or all-gather of the packed one, whichever sends fewer
    bytes per rank (ties: the natural one); otherwise its natural collective."""
    natural = compressor.aggregation
    if (world_size <= 1 or numel <= 0 or not compressor.linear or natural not in PICKABLE
            or not getattr(compressor, "pick_by_bytes", False)):
        return natural
    from ..net.cost import ALLREDUCE, ring_allgather
    from ..net.link import Link
    name = allreduce.partition(":")[0]
    unit = Link()
    ar = ALLREDUCE["ring" if name == "gloo" else name](unit, world_size,
                                                      compressor.summed_bits(numel, world_size) * numel / 8).sent
    ag = ring_allgather(unit, world_size, compressor.nominal_bits(numel) * numel / 8).sent
    if natural == "allreduce":
        return "allgather" if ag < ar else "allreduce"
    return "allreduce" if ar < ag else "allgather"


def regroup(state: dict, old: list[tuple[Any, int]], new: list[tuple[Any, int]]) -> dict:
    """Per-key flat state (an error-feedback residual per bucket) carried over a change of bucketing.

    `old` and `new` list (key, numel) of consecutive flat buckets covering the same elements in the same order
    (the scheduler's buckets, backward order): each dict of `state` holding 1-D tensors under old keys gets them
    concatenated and cut at the new boundaries (a missing old key counts as zeros). Nothing is lost, so error
    feedback's invariant (sent + residual = inputs) holds across a re-plan such as MG-WFBP's."""
    old_keys, sizes = {k for k, _ in old}, [n for _, n in new]
    out = {}
    for name, d in state.items():
        held = [(d[k], n) for k, n in old if k in d] if isinstance(d, dict) else []
        if not held or not all(isinstance(t, torch.Tensor) and t.numel() == n for t, n in held):
            out[name] = d       # not per-bucket flat state (e.g. PowerSGD's per-matrix Q): left as it is
            continue
        flat = torch.cat([d[k].reshape(-1) if k in d else held[0][0].new_zeros(n) for k, n in old])
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


def reused(buf: torch.Tensor, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, its first `n` elements): `buf` reused, or a fresh one of its dtype on `device` where it is too small
    or elsewhere. A compressor reuses its temporaries: a fresh large tensor page-faults on every call."""
    if buf.numel() < n or buf.device != torch.device(device):
        buf = torch.empty(n, dtype=buf.dtype, device=device)
    return buf, buf[:n]


class ScratchLock:
    """Guards a compressor's scratch buffer (see `Compressor.decompress`); a copy or a pickle of the compressor
    gets a fresh lock (compressors are deep-copied to probe them)."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def __reduce__(self):
        return type(self), ()


class Stateful:
    """Per-key state that checkpoints save and a change of bucketing carries over: the dicts (key -> tensor) named
    in `state_attrs`, saved under their names (none by default)."""

    state_attrs: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict:
        return {name: dict(getattr(self, name)) for name in self.state_attrs}

    def load_state_dict(self, state: dict) -> None:
        for name in self.state_attrs:
            setattr(self, name, dict(state.get(name, {})))

    def rekey(self, old: list[tuple[Any, int]], new: list[tuple[Any, int]]) -> None:
        """The buckets changed (see `regroup`): carry per-bucket state over to the new keys."""
        self.load_state_dict(regroup(self.state_dict(), old, new))


@dataclass
class Payload:
    tensors: list[torch.Tensor]
    ctx: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class Compressor(Stateful):
    name: ClassVar[str] = ""
    unbiased: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    randomness: ClassVar[str] = "none"
    aggregation: ClassVar[str] = "allreduce"
    fixed_size: ClassVar[bool] = False
    pick_by_bytes: ClassVar[bool] = False   # (linear) the exchange may all-gather or all-reduce, whichever is smaller
    takes_momentum: ClassVar[bool] = False  # applies the training's momentum itself (see `Memory`: signum)
    # a 1-bit (sign) quantizer that trains only with the momentum applied before it (EF-SGDM or signum's, the
    # Trainer's hand-over), not after it (docs/matrix.md): algorithms that compensate momentum SGD after the exchange
    # refuse it
    needs_momentum_first: ClassVar[bool] = False

    def compress(self, tensor: torch.Tensor, key: Any = None, step: int = 0, agreed=None) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The tensor a payload stands for. May run on several threads at once and beside `compress` (an
        exchange decodes on whichever thread first asks for its result): a scratch buffer kept between calls
        needs a `ScratchLock` (`natural`, `countsketch`). `compress` runs inside an exchange's program, one
        program at a time (`thinwire.comm.engine`)."""
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

    def vote(self, payloads: list[Payload]) -> torch.Tensor:
        """("majority" only) what the exchange returns from the ranks' payloads: the element-wise sign of
        `aggregate` (a compressor whose signs carry a scale multiplies it back, e.g. signsgd)."""
        return torch.sign(self.aggregate(payloads))

    def nominal_bits(self, numel: int) -> float:
        """Bits per element of the payload as `compress` makes it (what an all-gather carries)."""
        return 32.0

    def summed_bits(self, numel: int, world_size: int) -> float:
        """("allreduce") bits per element this rank puts into all-reduces at `world_size` ranks: the payload as
        `sum_payload` widens it (as gloo sums it) plus what `agree` all-reduces first. Default: the payload."""
        return self.nominal_bits(numel)

    def wire_bits(self, numel: int, world_size: int, allreduce: str = "ring") -> tuple[str, float]:
        """(collective, bits per element of this rank's contribution on it): what an exchange of `numel`
        elements really sends at `world_size` ranks (`pick_collective`), for benchmarks and the planner."""
        coll = pick_collective(self, numel, world_size, allreduce)
        return coll, (self.summed_bits(numel, world_size) if coll == "allreduce" else self.nominal_bits(numel))


class Memory(Stateful):
    """Error feedback and its variants: `compensate` before compression, `update` after.

    Momentum. A memory (or compressor) with `takes_momentum = True` can apply the training's heavy-ball
    momentum itself, before compression — DGC's momentum correction (Lin et al. 2018, §3.2 eq. 4), EF-SGDM
    (Zheng, Huang, Kwok 2019, Alg. 1: m = μ m + g, p = m + e, Δ = C(p), e = p − Δ) —, which is how error
    feedback and momentum combine: momentum applied after a biased compressor (the optimizer's) multiplies the
    compression error by 1/(1 − μ) and, for sign and 1-bit compressors, does not train at momentum 0.9. Its
    `momentum` parameter left unset (None) takes the optimizer's: the Trainer hands the SGD momentum over where the
    algorithm's exchange carries the gradients the optimizer applies (`Algorithm.exchanges_gradients`) and runs
    the optimizer without momentum (`hand_over_momentum`); elsewhere it is `default_momentum`. A memory with
    `replaces_momentum = True` (DeMo's decoupled momentum, SparseLoCo's decayed error feedback) is itself the
    momentum: there the optimizer's is set to 0, and an explicit `--momentum` is refused."""

    name: ClassVar[str] = ""
    takes_momentum: ClassVar[bool] = False
    replaces_momentum: ClassVar[bool] = False  # its own decayed accumulator stands in for the optimizer's momentum
    default_momentum: ClassVar[float] = 0.0
    momentum: float | None = 0.0

    def momentum_or_default(self) -> float:
        return self.default_momentum if self.momentum is None else self.momentum

    def heavy_ball(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        """u ← μ u + g in `self.momenta[key]` (EF-SGDM, Zheng et al. 2019 Alg. 1), returned as a fresh tensor;
        `tensor` itself where μ = 0. A key whose shape or dtype changed starts from u = g."""
        mu = self.momentum_or_default()
        if mu <= 0:
            return tensor
        u = self.momenta.get(key)
        if u is None or u.shape != tensor.shape or u.dtype != tensor.dtype:
            u = tensor.clone()
        else:
            u.mul_(mu).add_(tensor)
        self.momenta[key] = u
        return u.clone()

    def setup(self, world_size: int) -> None:
        """Called by the exchange with the number of ranks (DGC's local clipping threshold needs it)."""

    def compensate(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        return tensor

    def update(self, tensor: torch.Tensor, key: Any, sent: torch.Tensor) -> None:
        pass


def optional_momentum(value, what: str) -> float | None:
    """A `momentum` parameter (a memory's, signum's beta): a float in [0, 1), or None (unset: the optimizer's)."""
    if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 1):
        raise UserError(f"{what} must be in [0, 1) (or unset: the optimizer's), got {value!r}")
    return None if value is None else float(value)


def _probes(compressor: "Compressor", trials: int = 3, numel: int = 4096):
    """(v, C(v)) on Gaussian probes, from a copy of `compressor` (its own state is untouched)."""
    import copy

    probe = copy.deepcopy(compressor)
    # a stochastic compressor draws from a stream seeded by its rank on first use (`_gen`: Uniforms, qsparse's
    # rounding): the probes take one fixed stream, so every rank measures the same numbers and takes the same
    # decision (terngrad sits near 1: ranks disagreed and hung; qsparse's CHOCO γ differed by rank)
    todo, seen = [probe], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if "_gen" in vars(obj):
            obj._gen = torch.Generator().manual_seed(0)
        todo += [v for v in vars(obj).values()     # the compressors inside it and their streams (Uniforms)
                 if isinstance(v, Compressor) or "_gen" in getattr(v, "__dict__", {})]
    gen = torch.Generator().manual_seed(0)
    for t in range(trials):
        v = torch.randn(numel, generator=gen, device="cpu")   # probes at construction, on the host
        yield v, probe.decompress(probe.compress(v, key=("probe", t), step=t)).reshape(-1).to(v.dtype)


def _ratio(pairs, scale: float = 1.0) -> float:
    return sum(float((out * scale - v).pow(2).sum() / v.pow(2).sum()) for v, out in pairs) / len(pairs)  # host: once


def contraction(compressor: "Compressor", scale: float = 1.0) -> float:
    """E‖s·C(v) − v‖² / ‖v‖² on Gaussian probes (s = `scale`)."""
    return _ratio(list(_probes(compressor)), scale)


def contractive_scale(compressor: "Compressor", role: str, why: str) -> tuple[float, float]:
    """(s, E‖s·C(v) − v‖²/‖v‖²) with s the factor that makes s·C a contraction, E‖s·C(v) − v‖² < ‖v‖², which error
    feedback on the sender's side (a PS downlink, CHOCO's public copies) needs to converge (Stich & Karimireddy
    2019, "The error-feedback framework"; Koloskova et al. 2019, CHOCO-SGD, Assumption 1 and its rescaled unbiased
    operators): 1/(1 + ω) for an unbiased compressor of variance ω = E‖C(v) − v‖²/‖v‖² (ibid., Remark 6); for a
    biased one the least-squares s = E⟨C(v), v⟩ / E‖C(v)‖², which is 1 for top-k and scaled signs and shrinks one
    near the edge (clipped TernGrad measures 0.995 unscaled); a UserError where no scale helps (C(v) not
    correlated with v). One set of probes serves every number."""
    pairs = list(_probes(compressor))
    if compressor.unbiased:
        s = 1.0 / (1.0 + _ratio(pairs))
    else:
        norm = sum(float(torch.dot(out, out)) for _, out in pairs)
        s = sum(float(torch.dot(out, v)) for v, out in pairs) / norm if norm > 0 else 0.0
        if s >= 0.99:           # contractive at 1 already (top-k's s is exactly 1, fp4's 0.997): keep it exact
            s = 1.0
    ratio = _ratio(pairs, s) if s > 0 else 1.0
    if ratio < 1.0:
        return s, ratio
    raise UserError(f"{role} {compressor.name!r} does not correlate with its input (E<C(v), v> <= 0), so {why}")
