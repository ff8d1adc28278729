"""What the planner says about a race before it runs: the parameters a cell leaves out, picked for its network
(`tune_cell`: `thinwire.plan.advise.tune`, `thinwire.plan.diloco` for DiLoCo), a cell's predicted step and sync
(`predict_cell`), and every cell's time to target with the predicted winner per network (`predict_race`), from the
model size and the no-communication reference's median step and steps to target. A peer is predicted as the
thinwire algorithm it declares (`planned_as`)."""
from __future__ import annotations

import math
from dataclasses import replace

from .. import algorithms
from ..errors import UserError
from ..net import Islands, parse_network
from ..plan.advise import tune
from ..plan.costmodel import Scenario, cost_of, exchange, predict, scenario_speeds
from ..speeds import parse as parse_speeds
from ..plan.diloco import plan_diloco
from ..plan.families import FAMILIES
from ..run import workloads
from . import peers, presets

DILOCO_PLANNED = ("period", "fragments", "overlap", "eager", "allreduce", "replicas", "dynamic")
DILOCO_DEFAULTS = {"fragments": 1, "overlap": 0, "eager": False, "allreduce": "gloo", "replicas": "worker",
                   "dynamic": False}

# Steps to the target, relative to the no-communication reference's (independent workers, each its own model and
# batch): a cell that averages every step trains on the workers' whole batch (fewer steps: SYNC_STEPS of the
# reference's), one that averages every H steps follows its workers' own trajectories between averages (as many).
# Measured on stdlib-lm to loss 2.5, 4 workers, seed 0 on `lan`: `local` 160 steps, `bsp` 116 (0.72 of it), `diloco`
# H = 32 136, H = 64 144, H = 16 160 (BENCHMARKS.md, "Predict, then race"); a prior for other workloads, where the
# report says how far it was off.
SYNC_STEPS = 0.72
# averaging every H steps: diloco H = 32 / 64 136 / 144 steps (0.85-0.9), overlapped by τ with α = 0.5 144 (0.9),
# with α = 0 152-160 (about 1)
PERIODIC_STEPS = {"plain": 0.88, "mixed": 0.9, "overlapped": 1.0}
# model averaging every H steps (local SGD, post-local SGD, torchft's DiLoCo), by H: the map's cells (stdlib-lm to
# loss 2.5, 4 workers, seed 0, reference 166 steps; BENCHMARKS.md, "The map") took H = 1: 95 and 97 steps (0.57-0.58
# of the reference's), H = 2: 102-113 (0.61-0.68; fewer than bsp's 113-114 at H = 1 and 2), H = 32: 133-138
# (0.80-0.83), H = 64: 138-145 (0.83-0.87), H = 128: 146-154 (0.88-0.93): about 0.575 + 0.048 log2 H, at most 1
AVERAGING_STEPS = (0.575, 0.048)
# asynchronous DiLoCo (each pseudo-gradient applied on arrival, up to n - 1 updates stale): more steps than the
# reference, not fewer. Measured on stdlib-lm to loss 2.5, 4 workers on `world` under straggler episodes (H = 32,
# tau = 7, fp4 + residual, 3 seeds; BENCHMARKS.md, "Stragglers on `world` and two speeds 1:3 on `home`"): at 0.80-0.89
# of the reference's throughput it took 52.7 s against the reference's 33.4 s in seed 0, about 1.34 of its steps,
# and did not reach the target within 60 s in seeds 1 and 2 (over 1.5).
ASYNC_STEPS = 1.34


def planned_as(algorithm: str, compressor: str | None = None) -> tuple[str, str]:
    """The (algorithm, compressor) the planner sees a cell as: a peer's declared `plan_as`, else its own (none
    named: the algorithm's default, e.g. 1-bit Adam's onebit)."""
    peer = peers.find(algorithm)
    if peer is not None:
        return peer.plan_as
    default = algorithms.registry.lookup(algorithm).default_compressor if algorithm in algorithms.registry else "none"
    return algorithm, compressor or default


def family(algorithm: str | None) -> str | None:
    """The cost family of a cell's algorithm (`thinwire.algorithms.cost`), a peer's that of the thinwire algorithm
    it is planned as (`planned_as`); None for a name nobody registered (a row of an older result)."""
    name = planned_as(algorithm)[0] if algorithm else algorithm
    return cost_of(name).family if name in algorithms.registry else None


def syncs_every_step(algorithm: str | None) -> bool:
    """Whether a cell's algorithm averages every step's gradient (its steps to a target are SGD's), rather than
    its models every few steps."""
    kind = family(algorithm)
    return kind is not None and FAMILIES[kind].every_step


def needed_optimizer(cell: presets.Cell) -> tuple[str, str] | None:
    """(optimizer, why) an algorithm's update is written for: SGD for one that compensates SGD only, AdamW for one
    whose update is Adam's or that averages Adam's moments (1-bit Adam, 0/1 Adam, DES-LOC); None for any optimizer
    (and for a peer)."""
    if cell.peer or cell.algorithm not in algorithms.registry:
        return None
    cls = algorithms.registry.lookup(cell.algorithm)
    return ("sgd", "compensates SGD only") if cls.sgd_only else \
        ("adamw", "runs on Adam's moments") if cls.adam_only else None


def with_needed_optimizer(cell: presets.Cell, workload: str) -> presets.Cell:
    """A copy of `cell`, with the optimizer its algorithm needs (`needed_optimizer`) on a workload whose optimizer
    is another (unless the cell names one)."""
    out = replace(cell, params=dict(cell.params))
    need = needed_optimizer(cell)
    if need and cell.optimizer is None and workloads.get(workload).optimizer != need[0]:
        out.optimizer = need[0]
    return out


def _scenario(wl, network: str, workers: int, compute_s: float, speeds: str | None = None) -> Scenario:
    return Scenario(params=wl.num_params(), compute_s=compute_s, link=parse_network(network), workers=workers,
                    handshake=True, **scenario_speeds(parse_speeds(speeds), workers))


def tune_cell(cell: presets.Cell, network: str, workload: str, workers: int,
              compute_s: float | None, speeds: str | None = None) -> tuple[presets.Cell, list[str]]:
    """The cell with the parameters it leaves out picked for `network` (and SGD for an algorithm that
    compensates SGD only, on a workload whose optimizer is another); the reasons, one per decision. DiLoCo's
    settings hide its sync (the τ rule, eager updates, the all-reduce and the compressor: `thinwire.plan.diloco`)."""
    wl = workloads.get(workload)
    out = with_needed_optimizer(cell, workload)
    why: list[str] = []
    if out.optimizer != cell.optimizer:
        why.append(f"optimizer={out.optimizer}: {cell.algorithm} {needed_optimizer(cell)[1]} (the workload trains "
                   f"with {wl.optimizer})")
    peer, plan_as = peers.find(cell.algorithm), planned_as(cell.algorithm)[0]
    diloco = family(cell.algorithm) == "diloco"
    takes = (lambda k: k in peer.params) if peer else (lambda k: algorithms.registry.accepts(cell.algorithm, k))
    if (all(k in out.params for k in DILOCO_PLANNED[:3]) and out.compressor if diloco else
            not any(takes(k) and k not in out.params for k in cost_of(plan_as).tunable)):
        return out, why
    if compute_s is None:
        why.append("defaults: no compute time was measured for the planner")
        return out, why
    if diloco:
        plan = diloco_plan(out, network, wl, workers, compute_s, speeds=speeds)
        name = wl.optimizer_settings(out.optimizer)[0]  # the outer SGD's settings follow the inner optimizer
        inner = None if peer or "outer_optimizer" in out.params or name == "custom" else name
        pick = {k: v for k, v in plan.params(inner).items() if k not in out.params}
        reason = f"planner: {plan.describe()}"
        out.params.update(pick)
        if plan.algorithm != out.algorithm:     # at unequal speeds: a quorum or asynchronous DiLoCo, on servers
            out.algorithm = pick["algorithm"] = plan.algorithm
        if not out.compressor and plan.compressor != "none":
            out.compressor, out.memory = plan.compressor, plan.memory
            pick["compressor"] = f"{plan.compressor} + {plan.memory}"
    else:
        momentum = wl.optimizer_settings(out.optimizer)[1]["momentum"] if not cell.peer else 0.9
        pick, reason = tune(plan_as, _scenario(wl, network, workers, compute_s, speeds), out.params,
                            compressor=out.compressor or "none", momentum=momentum)
        pick = {k: v for k, v in pick.items() if takes(k)}
        out.params.update(pick)
    if pick:
        why.append(f"{', '.join(f'{k}={v}' for k, v in pick.items())}: {reason}")
    return out, why


def diloco_plan(cell: presets.Cell, network: str, wl, workers: int, compute_s: float, complete: bool = False,
                speeds: str | None = None):
    """The planner's DiLoCo (`thinwire.plan.diloco`) for this cell on `network` and workers at `speeds` (a
    `--speeds` spec): what the cell gives (parameters, a compressor) is kept, the rest planned (`complete`: the rest
    is the algorithm's defaults, as the cell runs)."""
    s = _scenario(wl, network, workers, compute_s, speeds)
    given = {**(DILOCO_DEFAULTS if complete else {}), **{k: v for k, v in cell.params.items() if k in DILOCO_PLANNED}}
    if cell.peer:       # a peer runs its own synchronous DiLoCo: only its parameters are planned
        given.setdefault("dynamic", False)
    if cell.compressor or complete:
        given.update(compressor=cell.compressor or "none", memory=cell.memory)
    return plan_diloco(s, s.link if isinstance(s.link, Islands) else None, given)


# planned times to target this close to the least are a tie: e.g. synchronous and dynamic DiLoCo at equal speeds,
# which the model times alike
TIED = 0.01


def averaging_steps(period: int) -> float:
    """Steps to target of model averaging every `period` steps, relative to the no-communication reference's."""
    return min(1.0, AVERAGING_STEPS[0] + AVERAGING_STEPS[1] * math.log2(max(1, period)))


def predict_cell(cell: presets.Cell, network: str, cfg, compute_s: float | None, speeds: str | None = None) -> dict:
    """The planner's step time and time per sync of a (tuned) cell on `network` with workers at `speeds` in the
    matrix `cfg`, from the model size and the reference's step time: `thinwire.plan.diloco` for DiLoCo,
    `thinwire.plan.costmodel.predict` for the rest (a peer as the thinwire algorithm of the same pattern); {}
    where it has no model for the cell."""
    if compute_s is None:
        return {}
    wl = workloads.get(cfg.workload)
    try:
        if family(cell.algorithm) == "diloco":
            plan = diloco_plan(cell, network, wl, cfg.workers, compute_s, complete=True, speeds=speeds)
            return {"step_s": plan.iteration_s, "sync_s": plan.sync_s, "period": plan.period}
        algorithm, compressor = planned_as(cell.algorithm, cell.compressor)
        params, peer = dict(cell.params), peers.find(cell.algorithm)
        if peer is not None:    # the parameters the planner reads as `algorithm`'s
            params = {k: params.get(k, v) for k, v in peer.plan_params.items() if k in params or v is not None}
        s = _scenario(wl, network, cfg.workers, compute_s, speeds)
        pred = predict(s, algorithm, compressor, **params)
        sync = exchange(s, compressor, **{k: v for k, v in params.items() if k in ("ratio", "rank", "levels")})[1]
        period = params.get("period") or algorithms.registry.parameters(algorithm).get("period") or 1
        out = {"step_s": float(pred.iteration_s), "sync_s": float(sync.time) if pred.collective != "none" else None,
               "period": int(period)}
        if full_steps(cell, 1 << 30):     # steps that all-reduce the full-precision gradient: timed as bsp's
            out["full_step_s"] = float(predict(s, "bsp").iteration_s)
        return out
    except (UserError, KeyError, TypeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def full_steps(cell: presets.Cell, steps: int) -> int:
    """Of the cell's first `steps` steps, those that all-reduce the full-precision gradient as bsp does (1-bit
    Adam's warm-up, 0/1 Adam's variance steps: `Algorithm.full_precision_steps`); 0 for a peer or an unknown name."""
    name = cell.algorithm
    if peers.find(name) is not None or name not in algorithms.registry:
        return 0
    return algorithms.registry.lookup(name).full_precision_steps(
        {**algorithms.registry.parameters(name), **cell.params}, steps)


def mean_step(p: dict, cell: presets.Cell, steps: float) -> float:
    """The mean step over the cell's first `steps` steps from its prediction `p` (`predict_cell`): its full-precision
    steps at bsp's step, the others at its own."""
    if "full_step_s" not in p or steps <= 0:
        return p["step_s"]
    k = min(steps, full_steps(cell, math.ceil(steps)))
    return (k * p["full_step_s"] + (steps - k) * p["step_s"]) / steps


def predict_race(tuned: dict, cells: list, cfg, baseline: dict, speeds: str | None = None,
                 compute_s: float | None = None) -> dict:
    """Before any cell runs: per network (its workers at `speeds`: `tuned` keyed by (label, network, speeds)),
    each cell's predicted step (from the compute step `compute_s` at full speed, else the reference's), sync and
    time to target (the reference's steps to target × SYNC_STEPS for a cell that averages every step,
    × PERIODIC_STEPS for DiLoCo, overlapped or not, × `averaging_steps(H)` for model averaging every H steps,
    × ASYNC_STEPS for asynchronous DiLoCo, × its predicted step), the predicted winner (the least predicted time to
    target) and the cells `tied` with it (within TIED of its time)."""
    steps_ref = baseline.get("steps_to_target")
    out = {}
    for network in cfg.networks:
        here = {}
        for cell in cells:
            ran, _ = tuned[cell.label, network, speeds]
            p = predict_cell(ran, network, cfg, compute_s or baseline.get("step_time_s"), speeds)
            if p.get("step_s") and steps_ref:
                lag = ran.params.get("overlap") or ran.params.get("fragment_sync_delay") or ran.params.get("eager")
                mixed = (ran.params.get("alpha") or ran.params.get("fragment_update_alpha") or 0) >= 0.5
                kind = family(ran.algorithm)
                factor = (SYNC_STEPS if syncs_every_step(ran.algorithm) else 1.0 if kind == "none" else
                          PERIODIC_STEPS["plain" if not lag else "mixed" if mixed else "overlapped"]
                          if kind == "diloco" else ASYNC_STEPS if kind == "async" else
                          averaging_steps(p.get("period") or 1))
                net = parse_network(network)
                if ran.params.get("replicas") == "island" and isinstance(net, Islands) and net.size > 1:
                    # each replica data parallel over its island's m workers: between one worker (1) and all n
                    # (islands of different sizes: m = n / A, as many replicas as islands)
                    factor *= SYNC_STEPS ** (math.log(net.workers / net.islands) / math.log(cfg.workers))
                p["steps"] = steps_ref * factor
                p["step_s"] = mean_step(p, ran, p["steps"])
                p["time_to_target_s"] = p["steps"] * p["step_s"]
                p["within_budget"] = cfg.budget_s is None or p["time_to_target_s"] <= cfg.budget_s
            here[cell.label] = p
        timed = {k: v["time_to_target_s"] for k, v in here.items() if v.get("time_to_target_s") is not None}
        winner = min(timed, key=timed.get) if timed else None
        # the model cannot rank apart the cells it gives the same time (within TIED): each is the predicted winner
        tied = [k for k, v in timed.items() if k != winner and v <= timed[winner] * (1 + TIED)] if timed else []
        out[network] = {"cells": here, "winner": winner, "tied": tied}
    return out
