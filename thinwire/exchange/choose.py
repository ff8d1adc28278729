"""The exchange's choice of collective, from what a compressor declares (`thinwire.compress.base`) and the α-β counts
of `thinwire.net.cost`. Pure: it sends nothing, so the planner predicts with the same rule the exchange runs.

- the collectives a compressor's algebra allows (`allowed_collectives`; naming another is a `UserError`);
- for a linear payload that may be summed or gathered (`pick_by_bytes`: qsgd, terngrad, int8), the one that puts
  fewer bytes on this rank's wire at the world size (`pick`): an all-reduce sends 2(n−1)/n of the summed payload
  on a ring (or the named algorithm's count), an all-gather n−1 packed payloads; the natural one on a tie. QSGD
  (4-bit codes, 8-bit sums) is gathered on 2–3 ranks and summed from 4; TernGrad (2-bit codes, 8-bit sums)
  gathered up to 7 ranks; int8 (int32 sums) summed from 8 ranks;
- for a payload combined one by one ("allgather": every sparsifier, natural, onebit, ...), whether all-reducing the
  decoded tensors costs less than gathering n − 1 payloads padded to the largest (`dense_is_cheaper`; by contract
  `aggregate` is the sum of the decoded contributions, so the mean is the same). In bytes a payload above 2/n of
  the tensor is cheaper summed dense (threshold with its residual past 25 % density at 4 ranks, natural's 9 bits
  from 8 ranks); on an emulated link time is compared, so the all-reduce's n − 1 extra start-ups keep a small
  payload gathered where latency dominates. The exchange decides on the real sizes and its transport's link,
  `pick` on `nominal_bits` and the link it is given;
- the bits that then travel (`wire_bits`): gloo's all-reduce sums no int16 or bool, so those travel widened
  (`GLOO_SUM_WIDEN`), plus what the ranks agree on first.
"""
from __future__ import annotations

import torch

from ..compress import Compressor
from ..errors import UserError
from ..net.cost import ALLREDUCE, Cost, ring_allgather
from ..net.link import Link

GLOO_SUM_WIDEN = {torch.int16: torch.int32, torch.bool: torch.uint8}   # gloo's all-reduce has no int16 / bool sum
PICKABLE = ("allreduce", "allgather")
COLLECTIVES = ("auto", "allreduce", "allgather", "majority", "custom")


def allowed_collectives(compressor: Compressor) -> list[str]:
    """The collectives a compressor's algebra allows (the first is its natural one)."""
    agg = compressor.aggregation
    if agg == "custom":
        return ["custom"]
    out = [agg]
    if agg != "allgather":
        out.append("allgather")  # any non-custom payload can be gathered and aggregated one by one
    elif compressor.linear:
        out.append("allreduce")  # a linear payload can be summed (int8: at 8 ranks or more it sends fewer bytes)
    return out


def resolve_collective(compressor: Compressor, collective: str) -> str:
    """The collective `collective` names for `compressor` ("auto": its natural one); a UserError where it is
    unknown or the compressor's algebra does not allow it (at construction, not a wrong answer later)."""
    if collective not in COLLECTIVES:
        raise UserError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    allowed = allowed_collectives(compressor)
    if collective == "auto":
        collective = allowed[0]
    if collective not in allowed:
        raise UserError(f"compressor {compressor.name!r} (aggregation {compressor.aggregation!r}, "
                        f"linear={compressor.linear}) cannot use collective {collective!r}; "
                        f"valid: {', '.join(allowed)}")
    if collective == "allreduce" and not compressor.linear:
        raise UserError(f"compressor {compressor.name!r} is not linear: its payloads cannot be summed by "
                        f"all-reduce; valid: allgather")
    if collective == "custom" and not compressor.rounds:
        raise UserError(f"compressor {compressor.name!r} declares custom aggregation without its rounds")
    return collective


def summed_bits(compressor: Compressor, numel: int, world_size: int) -> float:
    """Bits per element this rank puts into all-reduces at `world_size` ranks: the tensors `sum_payload` makes
    and what `agree` asks for (`sum_dtypes`), each in the type gloo sums it in; the packed payload where the
    compressor declares no other."""
    parts = compressor.sum_dtypes(numel, world_size)
    if parts is None:
        return compressor.nominal_bits(numel)
    bits = 0
    for dtype, count, per in parts:
        bits += 8 * GLOO_SUM_WIDEN.get(dtype, dtype).itemsize * count / per
    return bits


def _allreduce_cost(allreduce: str, world_size: int, nbytes: float, link: Link) -> Cost:
    """An all-reduce of `nbytes` with the algorithm `allreduce` ("gloo": a ring) on `link`, for one rank."""
    name = allreduce.partition(":")[0]
    return ALLREDUCE["ring" if name == "gloo" else name](link, world_size, nbytes)


def dense_is_cheaper(gathered_bytes: float, dense_bytes: float, world_size: int, allreduce: str = "ring",
                     link: Link | None = None) -> bool:
    """Whether an all-reduce of every rank's decoded tensor (`dense_bytes` each) costs a rank less than the
    all-gather of every rank's payload padded to the largest (`gathered_bytes`): less time on `link` (α-β: a ring
    all-reduce pays 2(n − 1) start-ups where the gather pays n − 1, so on a high-latency link a small payload stays
    gathered), and where the link costs nothing (none given, or no emulation) fewer bytes."""
    if world_size <= 1:
        return False
    link = link or Link()
    ar = _allreduce_cost(allreduce, world_size, dense_bytes, link)
    ag = ring_allgather(link, world_size, gathered_bytes)
    return ar.time < ag.time if ar.time != ag.time else ar.sent < ag.sent


def densifies(compressor: Compressor) -> bool:
    """Whether the exchange may all-reduce this compressor's decoded tensors instead of gathering its payloads:
    payloads combined one by one, whose `aggregate` is by contract the sum of the decoded contributions."""
    return compressor.aggregation == "allgather" and not compressor.pick_by_bytes


def pick(compressor: Compressor, numel: int, world_size: int, allreduce: str = "ring", link: Link | None = None) -> str:
    """The collective an exchange of `numel` elements through `compressor` runs at `world_size` ranks with the
    all-reduce algorithm `allreduce` ("gloo" is a ring): for a linear compressor that lets the exchange choose
    (`pick_by_bytes`), all-reduce of the summed payload or all-gather of the packed one, whichever sends fewer
    bytes per rank (ties: the natural one); for a gathered payload (`densifies`), "allreduce" where its decoded
    fp32 tensors cost less on `link` (`dense_is_cheaper` on `nominal_bits`); otherwise its natural collective."""
    natural = compressor.aggregation
    if world_size <= 1 or numel <= 0 or natural not in PICKABLE:
        return natural
    if densifies(compressor):
        dense = dense_is_cheaper(compressor.nominal_bits(numel) * numel / 8, 4.0 * numel, world_size, allreduce, link)
        return "allreduce" if dense else natural
    if not compressor.linear or not compressor.pick_by_bytes:
        return natural
    ar = _allreduce_cost(allreduce, world_size, summed_bits(compressor, numel, world_size) * numel / 8, Link()).sent
    ag = ring_allgather(Link(), world_size, compressor.nominal_bits(numel) * numel / 8).sent
    if natural == "allreduce":
        return "allgather" if ag < ar else "allreduce"
    return "allreduce" if ar < ag else "allgather"


def wire_bits(compressor: Compressor, numel: int, world_size: int, allreduce: str = "ring",
              link: Link | None = None) -> tuple[str, float]:
    """(collective, bits per element of this rank's contribution on it): what an exchange of `numel` elements
    through `compressor` really sends at `world_size` ranks on `link` (`pick`), for benchmarks and the planner."""
    coll = pick(compressor, numel, world_size, allreduce, link)
    if coll == "allreduce" and densifies(compressor):
        return coll, 32.0                        # the decoded fp32 tensor, summed
    return coll, (summed_bits(compressor, numel, world_size) if coll == "allreduce"
                  else compressor.nominal_bits(numel))
