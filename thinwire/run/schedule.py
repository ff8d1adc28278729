"""When a run evaluates and when it stops: `Schedule` for workers in lockstep, `ClockSchedule` for workers that
take different numbers of steps (an algorithm whose `pace` is "round" or "free": dynamic local updates,
asynchronous DiLoCo, the no-communication reference `local`).

**When to evaluate, when to stop (`Schedule`).** Without a race, every `eval_every` steps (default: twice per
epoch) and at the last step. In a race (`budget_s` and/or `stop_at_target`) every worker rank evaluates at the
same steps and then *agrees*: one all-gather of (metric, clock) per evaluation on a gloo group of the worker
ranks of its own (not the training's group, outside the meter and the clock), so every rank computes the same
mean metric (the mean `summarize` reports) and the same clock (the slowest worker's), and takes the same
decision: stop at the target (`stop_at_target`), stop when the clock reached the budget (`budget_s`), or go on.
Its cadence comes from the step time. After an evaluation at step s and clock t, with τ the mean step time since
the previous one, the next comes ⌊max(EVAL_PRECISION · t, ahead) / τ⌋ steps later (at least 1, and no later than
the step where the budget runs out), where `ahead` is
- half the time the metric needs to reach the target at its current rate (linear through the last two agreed
  evaluations), at most max(FAR · t, e / EVAL_OVERHEAD): evaluations close in on the crossing, few while it is
  far (e is the evaluation's own time, the slowest rank's);
- else (no race to a target, or the metric is not moving toward it) e / EVAL_OVERHEAD: evaluations then cost at
  most a quarter of the training time;
- and, once the metric has covered NEAR (9/10) of the way from its value at step 0 to the target, at most
  RESOLUTION (5 %) of the clock, whatever its trend: a metric that drops in jumps (local-update methods, whose
  models land at each average) crosses where no trend predicts it.
Near the crossing the interval is 2–5 % of the clock, so the evaluation that first reaches the target comes at most
5 % (or one step) after the true crossing; `summarize` reports that interval with every reading
(`time_to_target_resolution_s`: 0 when the evaluation before was one step earlier, as the model changes only at
the end of a step), so each one carries its own accuracy.

**Workers at their own pace (`ClockSchedule`).** Where an algorithm lets workers take different numbers of steps
(`Algorithm.pace` "round" or "free"), evaluations meet on the training clock, not at a step: each worker evaluates
when its own clock reaches the next evaluation time (the cadence above, in seconds of its clock), posts the
result to the launcher's store (one `set`, no waiting for anyone) and reads every worker's latest one (one
`multi_get`) after each evaluation and every RESOLUTION of its clock between them. The race's metric is the mean
of every worker's latest evaluation; the run stops when it reaches the target (or a worker's clock the budget):
under pace "free" each worker stops at once, under "round" it asks its algorithm to stop (`request_stop`) and
every worker ends at the same sync (`finished`). No worker ever waits for another's evaluation, so a fast worker
runs at its own speed between the points where its algorithm makes it wait. `summarize` reads the time to target
from the workers' evaluations in the order of their clocks (`race_crossing`).
"""
from __future__ import annotations

import json
import math
import statistics

import torch
import torch.distributed as dist

EVAL_PRECISION = 0.02   # in a race, evaluations come every 2 % of the training clock (see the module's doc) ...
EVAL_OVERHEAD = 0.25    # ... or far from the target: evaluations cost at most a quarter of the training time ...
FAR = 0.25              # ... or half-way to the predicted crossing, at most a quarter of the clock ahead ...
NEAR, RESOLUTION = 0.9, 0.05    # ... and past 9/10 of the way to the target, at most 5 % of the clock


def racing(cfg) -> bool:
    return cfg.budget_s is not None or bool(cfg.stop_at_target)


class Schedule:
    """The evaluation steps and the stop decision (see the module's doc); identical on every worker rank."""

    def __init__(self, cfg, wl, total: int | None, workers: int, group=None):
        self.wl, self.total, self.group = wl, total, group
        self.race = racing(cfg)
        self.every = cfg.eval_every or (None if self.race else max(1, wl.steps_per_epoch(workers, cfg.batch_size) // 2))
        self.budget = cfg.budget_s
        self.target = cfg.target if cfg.target is not None else wl.target
        self.stop_at_target = bool(cfg.stop_at_target)
        self.next = 1 if self.race else self.every
        self.last = (0, 0.0)    # (step, agreed clock) of the last evaluation
        self.seen = None        # (agreed clock, agreed metric) of the last evaluation
        self.first = None       # the agreed metric at step 0

    def due(self, step: int) -> bool:
        return step == self.total or (step == self.next if self.race else step % self.every == 0)

    def agree(self, value: float, clock: float, eval_s: float) -> tuple[float, float, float]:
        """(mean metric over the worker ranks, the slowest worker's clock, the slowest evaluation): the same
        numbers on every rank (all ranks compute them from the same all-gathered list, in rank order)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return value, clock, eval_s
        mine = torch.tensor([value, clock, eval_s], dtype=torch.float64, device="cpu")   # (a gloo group)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        return (statistics.fmean(float(v[0]) for v in every), max(float(v[1]) for v in every),
                max(float(v[2]) for v in every))

    def evaluated(self, step: int, value: float, clock: float, eval_s: float = 0.0) -> tuple[str | None, dict]:
        """After the evaluation at `step` (which took `eval_s`): (why to stop or None, what to add to its record)."""
        if not self.race:
            return ("steps" if step == self.total else None), {}
        mean, t, e = self.agree(value, clock, eval_s)
        on_target = step > 0 and self.stop_at_target and math.isfinite(mean) and self.wl.reached(mean, self.target)
        stop = ("target" if on_target else "budget" if self.budget is not None and t >= self.budget else
                "steps" if step == self.total else None)
        s0, t0 = self.last
        tau = (t - t0) / (step - s0) if step > s0 else 0.0
        if self.every:
            gap = self.every
        elif tau <= 0:
            gap = 1
        else:
            gap = max(1, math.floor(max(EVAL_PRECISION * t, self._ahead(t, mean, e)) / tau))
            if self.budget is not None:  # land on the budget; the slower of the recent and the mean step time
                gap = min(gap, max(1, math.ceil((self.budget - t) / max(tau, t / step))))
        self.next = step + gap if self.total is None else min(step + gap, self.total)
        self.last, self.seen = (step, t), (t, mean)
        if step == 0:
            self.first = mean
        return stop, {"agreed": mean, "agreed_t": t}

    def _ahead(self, t: float, mean: float, e: float) -> float:
        """How far ahead (training time) the next evaluation may come, beyond 2 % of the clock (module doc)."""
        near = (self.stop_at_target and self.first is not None and math.isfinite(mean) and self.first != self.target
                and (mean - self.first) / (self.target - self.first) >= NEAR)
        cap = RESOLUTION * t if near else math.inf
        if self.stop_at_target and self.seen is not None and t > self.seen[0] and math.isfinite(mean):
            rate = (mean - self.seen[1]) / (t - self.seen[0])
            left = (self.target - mean) / rate if rate else -1.0
            if left > 0:
                return min(left / 2, max(FAR * t, e / EVAL_OVERHEAD), cap)
        return min(e / EVAL_OVERHEAD, cap)

    def state_dict(self) -> dict:
        return {"next": self.next, "last_step": self.last[0], "last_t": self.last[1],
                "seen": list(self.seen) if self.seen else None, "first": self.first}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.next, self.last = int(state["next"]), (int(state["last_step"]), float(state["last_t"]))
            self.seen = tuple(state["seen"]) if state.get("seen") else None
            self.first = state.get("first")


class ClockSchedule(Schedule):
    """(pace "round" or "free", a race) Evaluations on this worker's own clock, the stop decision from every
    worker's latest evaluation in the store (see the module's doc)."""

    def __init__(self, cfg, wl, total: int | None, workers: int, wrank: int, store, run: str):
        super().__init__(cfg, wl, total, workers)
        self.wrank, self.workers = wrank, workers
        self.store = dist.PrefixStore(f"thinwire/race/{run}/", store)
        self.keys = [f"latest/{r}" for r in range(workers)]
        self.next_t, self.polled = 0.0, 0.0

    def due(self, step: int, clock: float = 0.0) -> bool:
        return step == self.total or clock >= self.next_t

    def latest(self) -> tuple[float, float] | None:
        """(mean of every worker's latest evaluation, the latest clock among them), or None before every worker
        posted one: one round trip to the store."""
        if not self.store.check(self.keys):
            return None
        got = [json.loads(v) for v in self.store.multi_get(self.keys)]
        return statistics.fmean(g[1] for g in got), max(g[0] for g in got)

    def poll(self, step: int, clock: float) -> str | None:
        """Between evaluations, every RESOLUTION of the clock: why to stop (every worker's latest on target, or
        this worker's clock past the budget) or None."""
        if self.budget is not None and clock >= self.budget:
            return "budget"
        if not self.stop_at_target or clock < self.polled + RESOLUTION * clock:
            return None
        self.polled = clock
        seen = self.latest()
        return "target" if seen and math.isfinite(seen[0]) and self.wl.reached(seen[0], self.target) else None

    def evaluated(self, step: int, value: float, clock: float, eval_s: float = 0.0) -> tuple[str | None, dict]:
        self.store.set(self.keys[self.wrank], json.dumps([clock, value, step]))
        seen = self.latest()
        mean, t = seen if seen is not None else (value, clock)
        on_target = (step > 0 and seen is not None and self.stop_at_target and math.isfinite(mean)
                     and self.wl.reached(mean, self.target))
        stop = ("target" if on_target else "budget" if self.budget is not None and clock >= self.budget else
                "steps" if step == self.total else None)
        gap = max(EVAL_PRECISION * clock, self._ahead(clock, mean, eval_s))
        if self.budget is not None:
            gap = min(gap, max(0.0, self.budget - clock))
        self.next_t, self.polled = clock + gap, clock
        if self.first is None:
            self.first = mean
        self.seen = (t, mean)
        return stop, {}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "next_t": self.next_t}

    def load_state_dict(self, state: dict | None) -> None:
        super().load_state_dict(state)
        if state:
            self.next_t = float(state["next_t"])


def race_curve(workers_evals: list[list[dict]]) -> list[dict]:
    """(a race of workers at their own pace) The race's metric as it moved: at every evaluation, in the order of
    the workers' clocks, once every worker has posted one, {"t", "value": the mean of every worker's latest
    evaluation, "step": the mean of their steps}."""
    events = sorted((e["t"], w, e) for w, evals in enumerate(workers_evals) for e in evals)
    latest: dict[int, dict] = {}
    out = []
    for t, w, e in events:
        latest[w] = e
        if len(latest) == len(workers_evals):
            out.append({"t": t, "value": statistics.fmean(x["value"] for x in latest.values()),
                        "step": statistics.fmean(x["step"] for x in latest.values())})
    return out


def race_crossing(curve: list[dict], reached) -> tuple[dict | None, float | None]:
    """The first point of a `race_curve` past step 0 whose value is `reached`, and the reading's resolution (the
    time since the point before it); or (None, None)."""
    for i, e in enumerate(curve):
        if e["step"] > 0 and math.isfinite(e["value"]) and reached(e["value"]):
            return e, (e["t"] - curve[i - 1]["t"] if i else None)
    return None, None
