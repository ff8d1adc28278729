"""The exchange's choice of collective, from what a compressor declares (`thinwire.compress.base`) and the α-β counts
of `thinwire.net.cost`. Pure: it sends nothing, so the planner predicts with the same rule the exchange runs.

A compressor says what its payload is: summable ("allreduce") or combined one by one ("allgather", "majority"),
linear or not, several rounds ("custom"), and for a summable quantizer the types its sum needs (`sum_dtypes`).
The exchange decides:
- which collectives that algebra allows (`allowed_collectives`; naming another is a `UserError`);
- for a linear payload that may be summed or gathered (`pick_by_bytes`: qsgd, terngrad, int8), the one that puts
  fewer bytes on this rank's wire at the world size (`pick`): all-reduce 2(n−1)/n of the summed payload on a
  ring (or the named algorithm's count), all-gather n−1 packed payloads; the natural one on a tie. QSGD (4-bit
  codes, 8-bit summed levels) is gathered on 2–3 ranks and summed from 4; TernGrad (2-bit codes, 8-bit sums) is
  gathered up to 7 ranks; int8 (int32 sums) is summed from 8 ranks;
- the bits that then travel (`wire_bits`): gloo's all-reduce sums no int16 or bool, so those travel widened
  (`GLOO_SUM_WIDEN`), plus what the ranks agree on first.
"""
from __future__ import annotations

import torch

from ..compress import Compressor
from ..errors import UserError
from ..net.cost import ALLREDUCE, ring_allgather
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


def pick(compressor: Compressor, numel: int, world_size: int, allreduce: str = "ring") -> str:
    """The collective an exchange of `numel` elements through `compressor` runs at `world_size` ranks with the
    all-reduce algorithm `allreduce` ("gloo" is a ring): for a linear compressor that lets the exchange choose
    (`pick_by_bytes`), all-reduce of the summed payload or all-gather of the packed one, whichever sends fewer
    bytes per rank (ties: the natural one); otherwise its natural collective."""
    natural = compressor.aggregation
    if (world_size <= 1 or numel <= 0 or not compressor.linear or natural not in PICKABLE
            or not getattr(compressor, "pick_by_bytes", False)):
        return natural
    name = allreduce.partition(":")[0]
    unit = Link()
    ar = ALLREDUCE["ring" if name == "gloo" else name](unit, world_size,
                                                      summed_bits(compressor, numel, world_size) * numel / 8).sent
    ag = ring_allgather(unit, world_size, compressor.nominal_bits(numel) * numel / 8).sent
    if natural == "allreduce":
        return "allgather" if ag < ar else "allreduce"
    return "allreduce" if ar < ag else "allgather"


def wire_bits(compressor: Compressor, numel: int, world_size: int, allreduce: str = "ring") -> tuple[str, float]:
    """(collective, bits per element of this rank's contribution on it): what an exchange of `numel` elements
    through `compressor` really sends at `world_size` ranks (`pick`), for benchmarks and the planner."""
    coll = pick(compressor, numel, world_size, allreduce)
    return coll, (summed_bits(compressor, numel, world_size) if coll == "allreduce"
                  else compressor.nominal_bits(numel))
