"""What an algorithm declares to the planner (`thinwire.plan`): its cost family — the formula of
`thinwire.plan.families` that predicts its iteration time — with that formula's parameters where the constructor's
defaults are not the planner's (or the constructor has none), and what `thinwire.plan.advise.tune` tries for the
parameters a run leaves out. A class declares it as `cost = CostFamily(...)`; a subclass that schedules its
exchanges otherwise declares its own (`Algorithm.cost`; None: the planner has no model of it).

Its pace says how workers of different speeds share its steps (`thinwire.plan.costmodel.paced`): "slowest" (every
step, or every round, waits for the slowest worker: synchronous), "own" (each worker at its own speed, waiting for
none: asynchronous), "rounds" (rounds at the fastest worker's pace, each worker's steps per round following its
speed: dynamic local updates), "quorum" (the first K of the n workers merge; K the parameter `quorum`).
`pace_with` names the parameters that change it where set (true or > 0): DiLoCo's `dynamic` makes it "rounds"."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostFamily:
    family: str                                   # a name of `thinwire.plan.families.FAMILIES`
    params: dict = field(default_factory=dict)    # the formula's parameters, over the constructor's defaults
    tunable: dict = field(default_factory=dict)   # parameter -> the values `tune` tries, least stale first
    max_staleness: tuple[int, int] | None = None  # the most staleness `tune` gives it (momentum SGD, plain SGD)
    pace: str = "slowest"                         # with workers of different speeds (see the module doc)
    pace_with: tuple = ()                         # (parameter, pace) pairs: the pace where the parameter is set
