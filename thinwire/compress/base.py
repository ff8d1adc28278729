"""The compressor and memory interfaces. A compressor is pure: tensor -> payload -> tensor, no communication.

A `Payload` holds the tensors that cross the wire (already packed: bits, levels, indices, scales) and the local
context needed to decompress them, which never crosses the wire (shape, dtype: every rank knows them).
A compressor knows nothing of collectives, networks or transports: it DECLARES what its payload is, and the
exchange (`thinwire.exchange`, the one place payloads are framed for the wire) chooses the collective from that
and runs every round. The declarations (class attributes of `Compressor`):
- `unbiased`: E[decompress(compress(x))] = x;
- `linear`: payloads of different ranks may be summed element-wise and decompressed as one;
- `randomness`: "none", "shared" (every rank must draw the same numbers: seeded by step and key) or "local";
- `fixed_size`: the payload size depends only on the tensor's shape (ranks need not tell each other sizes);
- `is_sparse`: the top-k family, (index, value) pairs, which a sparse collective may aggregate (`exchange.sparse`);
- `x_memcpy`: compress + decompress time in memcpys of the input (the planner's where no calibration measured it);
- `aggregation`: the algebra that combines the ranks' payloads:
  "allreduce"  summable: payload tensors add element-wise (after `sum_payload` widens them to the type their sum
               needs, which `sum_dtypes` declares); `decompress` of the summed payload is the sum of the
               contributions. Ranks that must first agree on something (a shared scale) get it from `agree`: a
               small tensor whose element-wise max every rank needs, handed to `compress(..., agreed=...)`.
  "allgather"  one by one: every rank's payload is needed (sizes may differ); `aggregate(payloads)` sums the
               contributions.
  "majority"   a vote: `vote(payloads)`, the element-wise sign of `aggregate` (signsgd's majority of signs,
               DeMo's `sign=true`).
  "custom"     several rounds, named in `rounds` (PowerSGD's ("P", "Q")): `begin` does the local math before
               the first round and returns a `Round` whose `send` (fp32) every rank contributes to a sum;
               `advance(round, summed)` does the local math after it and returns the next `Round` or the
               `Result` (sum over ranks, this rank's own contribution, which the memory subtracts). The
               exchange runs each round's sum and divides the result by the world size.
  `pick_by_bytes` (a linear payload that `compress` also packs for gathering) lets the exchange sum it or gather it,
  whichever puts fewer bytes on the wire.
Payloads of other ranks ("allgather", "majority") arrive as 1-D tensors of the same dtypes, in the same order,
with THIS rank's `ctx`: a compressor must put in `ctx` only what every rank knows (shape, dtype, a shared seed's
indices), never something about its own data. A rank that decodes without having compressed (a parameter server
decoding pushes, a worker decoding the server's compressed reply) asks `context(shape, dtype, key, step)` for the
ctx `compress` would have made. `sum_payload` may also pre-scale (fp16 divides by the world size before the sum, as
PyTorch's `fp16_compress_hook` does, so the fp16 sum cannot overflow), as long as `decompress` of the summed
payload still returns the sum of the contributions (it records the scale in `ctx`).

Sizes: `nominal_bits(numel)` is the payload as `compress` makes it (what gathering carries); a summable
quantizer's sum is made of its levels widened so that the sum of `world_size` of them fits, plus the scale agreed
first: `sum_dtypes(numel, world_size)` declares those, and `thinwire.exchange.choose` turns them into the bits the
transport really carries and picks the collective.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import UserError
from ..registry import SEED


_CONSTANTS: dict = {}


def cast_back(decoded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`decoded` (a float tensor a compressor decoded: a scale times signs, levels) in the input's `dtype`: to
    the nearest integer for an integer dtype, where a plain cast truncates toward zero (a sign payload of [1, 2],
    scale 1.5, would decode to [1, 1])."""
    if decoded.dtype != dtype and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        decoded = decoded.round()
    return decoded.to(dtype)


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
class Round:
    """One round of a multi-round compressor ("custom"): `send`, this rank's fp32 buffer that every rank contributes
    to a sum over ranks, and the compressor's own state carried to `Compressor.advance`."""
    name: str
    send: torch.Tensor
    state: Any = None


@dataclass
class Result:
    """What a multi-round compressor's last round gives: the sum over ranks and this rank's own contribution."""
    total: torch.Tensor
    own: torch.Tensor


@dataclass
class Payload:
    tensors: list[torch.Tensor]
    ctx: Any = None

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
    is_sparse: ClassVar[bool] = False       # top-k family: (index, value) pairs, the sparse collectives' input
    # by `thinwire bench compressors` (2^24 fp32, a 2-core machine; fp8, fp4, demo, sparseloco's loaded: indicative)
    x_memcpy: ClassVar[float] = 8.0         # (8: not measured)
    pick_by_bytes: ClassVar[bool] = False   # (linear) the exchange may gather or sum it, whichever sends fewer bytes
    rounds: ClassVar[tuple[str, ...]] = ()  # ("custom") the rounds it needs, in order (`begin`, `advance`)
    takes_momentum: ClassVar[bool] = False  # applies the training's momentum itself (see `Memory`: signum)
    # a 1-bit (sign) quantizer that trains only with the momentum applied before it (EF-SGDM or signum's, the
    # Trainer's hand-over), not after it (docs/matrix.md): algorithms that compensate momentum SGD after the exchange
    # refuse it
    needs_momentum_first: ClassVar[bool] = False
    # ranges of constructor parameters, checked by the registry with the types the signature declares (a
    # subclass adds its own; thinwire/registry.py `Limit`)
    limits: ClassVar[dict] = {"seed": SEED}

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
        """("allreduce" only) a small tensor whose element-wise max over ranks every rank needs before compressing."""
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

    def sum_dtypes(self, numel: int, world_size: int) -> list[tuple[torch.dtype, int, int]] | None:
        """("allreduce") what this rank contributes to sums over `world_size` ranks, per element of a tensor of
        `numel` elements: `(dtype, count, per)`, `count` values of `dtype` for every `per` elements, for each tensor
        `sum_payload` makes and then for what `agree` asks the ranks to agree on. None (the default): the payload
        as `compress` packs it (`nominal_bits`)."""
        return None

    def begin(self, tensor: torch.Tensor, key: Any, step: int, shapes, world_size: int) -> Round:
        """("custom") The local math before the first of `rounds`: its `Round`."""
        raise NotImplementedError(f"{type(self).__name__} declares rounds {self.rounds} but no `begin`")

    def advance(self, last: Round, summed: torch.Tensor) -> "Round | Result":
        """("custom") The local math after round `last`, given the sum over ranks of its `send`: the next round's
        `Round`, or the `Result`. Dispatches to the compressor's `after_<round name>` method."""
        return getattr(self, f"after_{last.name}")(last, summed)


class Memory(Stateful):
    """Error feedback and its variants: `compensate` before compression, `update` after.

    Momentum. A memory (or compressor) with `takes_momentum = True` applies the training's heavy-ball momentum
    itself, before compression (DGC's momentum correction, Lin et al. 2018, §3.2 eq. 4; EF-SGDM, Zheng, Huang, Kwok
    2019, Alg. 1: m = μ m + g, p = m + e, Δ = C(p), e = p − Δ): momentum after a biased compressor (the
    optimizer's) multiplies the compression error by 1/(1 − μ), and sign and 1-bit compressors do not train so at
    0.9. Its `momentum` unset (None) takes the optimizer's where the exchange carries the gradients the optimizer
    applies (`Algorithm.exchanges_gradients`: the Trainer hands it over, `hand_over_momentum`), else
    `default_momentum`. A memory with `replaces_momentum = True` (DeMo's, SparseLoCo's decayed error feedback) is
    itself the momentum: the optimizer's is set to 0, and an explicit `--momentum` is refused."""

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
