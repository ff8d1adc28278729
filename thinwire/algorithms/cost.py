"""What an algorithm declares to the planner (`thinwire.plan`): its cost family — the formula of
`thinwire.plan.families` that predicts its iteration time — with that formula's parameters where the constructor's
defaults are not the planner's (or the constructor has none), and what `thinwire.plan.advise.tune` tries for the
parameters a run leaves out. A class declares it as `cost = CostFamily(...)`; a subclass that schedules its
exchanges otherwise declares its own (`Algorithm.cost`; None: the planner has no model of it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostFamily:
    family: str                                   # a name of `thinwire.plan.families.FAMILIES`
    params: dict = field(default_factory=dict)    # the formula's parameters, over the constructor's defaults
    tunable: dict = field(default_factory=dict)   # parameter -> the values `tune` tries, least stale first
    max_staleness: tuple[int, int] | None = None  # the most staleness `tune` gives it (momentum SGD, plain SGD)
