"""The harness behind `thinwire compare`: a race to the target. Every (contestant × network × seed) cell is its own
training run on the same workload, data shards and workers; the results go to `DIR/results.json` after each cell,
then `DIR/report.md` and PNG plots are drawn from it.

**The race.** Every cell runs `thinwire.run.train.run_training` (the one loop of `thinwire.run.loop`, whatever its
stepper) with the same budget of *training time* (`budget_s`, evaluations excluded) and stops at the first
evaluation whose mean metric over the workers reaches the target, when the budget is spent, or at the step bound
(`epochs` / `steps`, none by default with a budget: a cell fast per step is never cut off by a step count).
Evaluations close in on the crossing (`thinwire.run.schedule`), so time to target is read to within 5 % (or
one step); every worker rank takes the same stop decision.

**A cell out of budget** is reported with its best metric and, where the matrix allows, a *predicted* time to
target (`predict_missing`): the steps to target of the same trajectory elsewhere in the matrix (the same
contestant, settings and seed on another network; or an exact synchronous-SGD cell — bsp, ssgd, ddp — of the same
seed for another exact one) times this cell's own median step time.

**Seeds** (`seeds` > 1): the report gives the median and the range (min–max) per contestant, and compares each
with the winner seed by seed (the same seed is the same data and initialization for every contestant; a seed that
missed the target counts as +∞): the winner's lead is real only where it is ahead in every seed beyond a reading's
precision, else the contestant is *within noise* of it (`results.paired`).

**The planner's side** (`forecast.py`): the parameters a cell leaves out, picked for its network, and, before the
first cell runs, every cell's predicted step, sync and time to target and the predicted winner per network
(`predictions` in results.json); the report states each cell's parameters and why, and whether the measurement
agreed.

**Scalability** = throughput / throughput of the same workers doing no communication: `local`, raced first like
every cell (the same workers, data, batch, budget, target and process layout), once per seed (its spread is
reported); a cell is divided by the reference of its own seed, scaled by the machine's speed during the cell (the
median of its own steps that sent nothing, else a short `local` run just before it, `calibrate`), so a reading
above 1 is a bug. The reference's median step is the compute time the planner predicts from, its steps to target
the convergence the predicted times to target start from.

Worker processes are kept alive across cells (one pool per world size) and restarted after a failed cell; a cell
whose wall time exceeds 4 × budget + 600 s is stopped and recorded as `timeout`. Interrupted runs keep the cells
already done; `resume` runs the missing (or failed) cells of a matrix directory.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError, WorkerError
from ..files import atomic_write
from ..launcher import MAX_LOCAL_WORKERS, DeadlineError, Pool, pick_backend
from ..launcher.netem import Emulation
from ..net import Islands, parse_network
from ..run import workloads
from ..run.loop import check_tensorboard, progress_bar, train_worker
from ..run.train import MAX_SEED, TrainConfig, check_int, check_lengths, check_number, run_training, summarize
from . import cluster, peers, presets
from .forecast import (SYNC_STEPS, averaging_steps, family, mean_step, planned_as, predict_cell, predict_race,
                       syncs_every_step, tune_cell, with_needed_optimizer)
from .plots import plot_all
from .report import write_report
from ..speeds import parse as parse_speeds
from .results import aggregate, place, places

_now = time.perf_counter
RESULTS = "results.json"
REFERENCE = presets.Cell("no communication (reference)", "local")
CALIBRATION_STEPS = 9   # a short `local` run before the reference and every cell: the machine's speed then


@dataclass
class CompareConfig:
    workload: str = "digits-mlp"
    workers: int = 4
    networks: list = field(default_factory=lambda: ["wan"])
    cells: list = field(default_factory=lambda: ["bsp"])        # specs (strings or dicts)
    target: float | None = None
    budget_s: float | None = None      # seconds of training time per cell (evaluations excluded)
    epochs: float | None = None        # an upper bound on a cell's steps (None with a budget: no bound)
    seed: int = 0
    seeds: int = 1                     # every cell runs with seeds seed .. seed + seeds - 1
    trace: bool = False
    netem: bool = False
    preset: str | None = None
    notes: list = field(default_factory=list)
    tensorboard: str | None = None     # DIR: TensorBoard scalars per cell under DIR/<cell>
    steps: int | None = None           # an upper bound in steps instead of epochs
    eval_every: int | None = None      # a fixed evaluation cadence instead of the race's
    batch_size: int | None = None      # per worker (None: the workload's), the same for every cell
    device: str = "cpu"                # "cuda": every cell's workers on GPUs (NCCL one per GPU, else shared on gloo)
    speeds: list = field(default_factory=lambda: [None])   # worker speed profiles (`thinwire.speeds`; None: equal)
    faulty: str | None = None          # "RANK:KIND": that worker's contributions corrupted in every cell (robust.md)
    torchrun: bool = False             # the processes torchrun started run every cell (`cluster.py`)

    def validate(self) -> "CompareConfig":
        """Every name known and every number in its range (NaN and infinities included), before any cell starts."""
        workloads.registry.lookup(self.workload)
        for n in self.networks:
            net = parse_network(n)
            if isinstance(net, Islands):
                net.check_workers(self.workers)
        if not self.networks:
            raise UserError("give at least one network, e.g. --network wan")
        self.speeds = [None if parse_speeds(sp) is None else sp.strip() for sp in (self.speeds or [None])]
        for sp in self.speeds:
            if parse_speeds(sp) is not None:
                parse_speeds(sp).check_workers(self.workers)
        check_int("--workers", self.workers, 1, MAX_LOCAL_WORKERS - 1)  # + 1 rank for a parameter server
        check_lengths(self, counts=("eval_every",))
        if self.target is not None:
            check_number("--target", self.target, 0, why=" (an accuracy in [0, 1], or a loss)")
        if self.budget_s is not None:
            check_number("--budget", self.budget_s, 0, low_open=True, why=" (seconds of training time per cell)")
        check_int("--seeds", self.seeds, 1, 100)
        check_int("--seed", self.seed, 0, MAX_SEED)
        if self.batch_size is not None:
            check_int("batch size", self.batch_size, 1, 1 << 20)
        if self.tensorboard is not None:
            check_tensorboard(self.tensorboard)
        pick_backend(None, self.device, self.workers)      # `train --device`'s check
        workloads.get(self.workload).check_target(self.target)
        cells, _ = presets.resolve(self.cells, strict=self.preset is None)  # bad cell names
        for cell in cells:    # every cell's run checked as `thinwire train` checks one (train's one path)
            for name, network, sp in places(asdict(self)):
                try:
                    cell_config(self, with_needed_optimizer(cell, self.workload), network, speeds=sp).validate()
                except UserError as e:
                    raise UserError(f"cell {cell.label!r}" + (f" on {name}" if len(places(asdict(self))) > 1
                                                               else "") + f": {e}") from None
        cluster.matches(self.torchrun)
        if self.torchrun:
            cluster.check(self, cells, lambda c: cell_config(self, c, self.networks[0]).resolve_servers())
        return self


def cell_config(c: CompareConfig, cell: presets.Cell, network: str, seed: int | None = None,
                board: str | None = None, speeds: str | None = None) -> TrainConfig:
    """The training run of `cell` on `network` with worker `speeds` in matrix `c` (before the planner fills in
    what it leaves out)."""
    params = dict(cell.params)
    servers = 0 if cell.peer else params.pop("servers", None)   # None: the algorithm's default
    return TrainConfig(workload=c.workload, algorithm=cell.algorithm, workers=c.workers, network=network,
                       epochs=c.epochs, steps=c.steps, seed=c.seed if seed is None else seed, target=c.target,
                       compressor=cell.compressor, memory=cell.memory, params=params, trace=c.trace and not cell.peer,
                       progress=False, servers=servers, peer=peers.find(cell.algorithm), budget_s=c.budget_s,
                       stop_at_target=True, optimizer=cell.optimizer, tensorboard=board, eval_every=c.eval_every,
                       batch_size=c.batch_size, device=c.device, speeds=speeds,
                       faulty=None if cell == REFERENCE else c.faulty)    # the reference sends nothing


def cell_key(label: str, network: str, seed: int | None = None) -> str:
    return f"{label} @ {network}" + ("" if seed is None else f" #seed {seed}")


class _PoolView:
    """A pool as `run_training` sees it: with this cell's time limit, and under --netem no in-process
    emulation (the real, shaped network does it)."""

    def __init__(self, pool, timeout, netem):
        self.pool, self.timeout, self.netem = pool, timeout, netem

    def run(self, fn, *args, network="lan", seed=0, timeout=None):
        # the cell's wall limit is a deadline: it ends the cell however it progresses
        extra = {k: v for k, v in (("timeout", timeout), ("deadline", self.timeout)) if v is not None}
        return self.pool.run(fn, *args, network="lan" if self.netem else network, seed=seed, **extra)


class Harness:
    """Runs a matrix, one cell at a time, keeping worker pools between cells."""

    def __init__(self, cfg: CompareConfig, out: str, netem_env=None, pool=None):
        self.cfg, self.out = cfg, out
        self.netem_env = netem_env  # a thinwire.launcher.netem.Emulation when --netem
        self._pools: dict[int, object] = {}
        self._given = pool  # a caller's pool of cfg.workers workers (tests): used, never closed here
        self.log = lambda msg: print(msg, file=sys.stderr)

    # -- pools ---------------------------------------------------------------------------------------
    def pool(self, world: int, network: str):
        if self.cfg.netem:
            self.netem_env.configure(network)  # shape the real links for this cell's network
        if self._given is not None and world == self.cfg.workers and not self.cfg.netem:
            return self._given
        p = self._pools.get(world)
        if p is None or p.closed:
            p = self.netem_env.pool(world) if self.cfg.netem else Pool(world, timeout=3600.0, device=self.cfg.device)
            self._pools[world] = p
        return p

    def close(self):
        for p in self._pools.values():
            p.close(force=True)
        self._pools.clear()

    def wall_limit(self) -> float | None:
        """The wall time a cell may take before it is stopped as `timeout` (start-up and evaluations included)."""
        return None if self.cfg.budget_s is None else 4 * self.cfg.budget_s + 600

    # -- one cell ------------------------------------------------------------------------------------
    def key(self, cell: presets.Cell, network: str, seed: int | None, speeds: str | None = None) -> str:
        """The cell's name in the results (with its seed when the matrix has several)."""
        return cell_key(cell.label, place(network, speeds), seed if self.cfg.seeds > 1 else None)

    def train_config(self, cell: presets.Cell, network: str, seed: int | None = None,
                     speeds: str | None = None) -> TrainConfig:
        c = self.cfg
        board = os.path.join(c.tensorboard, _slug(self.key(cell, network, seed, speeds))) if c.tensorboard else None
        tc = cell_config(c, cell, network, seed, board, speeds)
        tc.resolve_servers()
        return tc

    def run_cell(self, cell: presets.Cell, network: str, seed: int | None = None, speeds: str | None = None) -> dict:
        tc = self.train_config(cell, network, seed, speeds)
        if self.cfg.netem:  # the real, shaped link delays the traffic: no in-process emulation on top
            tc = replace(tc, network="lan")
        world = tc.workers + tc.servers
        view = _PoolView(self.pool(world, network), self.wall_limit(), self.cfg.netem)
        celldir = os.path.join(self.out, "cells", _slug(self.key(cell, network, seed, speeds)))
        summary = run_training(tc, out=celldir, pool=view)
        summary["network"], summary["link"] = place(network, speeds), network
        summary["curve"] = _curve(celldir, summary["metric"], summary["bytes_sent_per_worker"])
        summary["quiet_step_s"], summary["quiet_mean_step_s"] = quiet_step_s(celldir)
        return summary

    # -- the no-communication reference (scalability, and the compute time the planner needs) ------------
    def reference(self, seed: int, speeds: str | None = None) -> dict:
        """`local` (no communication) raced like a cell, one run per seed of the matrix: the same workers, data
        shards, batch, budget, target, evaluations, worker speeds and process layout (this pool) as every cell.
        Its throughput (every worker at its own speed, waiting for no one) is the denominator of scalability, its
        median step the compute time the planner predicts from, its steps to target the convergence the planner's
        times to target start from."""
        calibration, calibration_mean = self.calibrate()
        tc = self.train_config(REFERENCE, "lan", seed, speeds)
        view = _PoolView(self.pool(tc.workers, "lan"), self.wall_limit(), self.cfg.netem)
        celldir = os.path.join(self.out, "cells", _slug(self.key(REFERENCE, "lan", seed, speeds)))
        s = run_training(tc, out=celldir, pool=view)
        name = "best_accuracy" if s["metric"] == "accuracy" else "best_loss"
        out = {"seed": seed, "config": tc.to_dict(), "throughput_samples_s": s["throughput_samples_s"],
               "step_time_s": s["step_time_s"],
               "steps": s["steps"], "steps_to_target": s["steps_to_target"], "time_to_target_s":
               s["time_to_target_s"], "train_s": s["train_s"], name: s[name], "metric": s["metric"],
               "curve": _curve(celldir, s["metric"], 0.0), "calibration_step_s": calibration,
               "calibration_mean_step_s": calibration_mean, "quiet_mean_step_s": quiet_step_s(celldir)[1]}
        if s["steps_to_target"] is None:    # out of budget: where its trend would have met the target
            out["steps_to_target_extrapolated"] = extrapolate_steps(celldir, s["metric"], s["target"])
        return out

    def calibrate(self, steps: int = CALIBRATION_STEPS) -> tuple[float, float]:
        """The machine's speed now: (median, mean) step of a short `local` run in the pool (its last 2/3 of
        steps), taken right before the reference and before every cell, so that a load that changes under the
        matrix is measured where it matters (a cell's prediction at run time from the median, its scalability
        against the reference from the mean)."""
        tc = replace(self.train_config(REFERENCE, "lan", self.cfg.seed), steps=steps, epochs=None, budget_s=None,
                     stop_at_target=False, target=None, tensorboard=None, eval_every=steps)
        view = _PoolView(self.pool(tc.workers, "lan"), self.wall_limit(), self.cfg.netem)
        rows = summarize(tc, view.run(train_worker, tc.validate(), network="lan", seed=tc.seed), 0.0)[1]
        kept = [r["step_s"] for r in rows[steps // 3:]]
        return statistics.median(kept), statistics.fmean(kept)

    def baseline(self, runs: list[dict]) -> dict:
        """The reference over its seeds: median throughput and step, the throughput's range (its spread)."""
        rate = [r["throughput_samples_s"] for r in runs]
        reached = [r["steps_to_target"] or r.get("steps_to_target_extrapolated") for r in runs
                   if r.get("steps_to_target") or r.get("steps_to_target_extrapolated")]
        return {"runs": runs, "throughput_samples_s": statistics.median(rate), "throughput_min": min(rate),
                "throughput_max": max(rate), "spread": (max(rate) - min(rate)) / statistics.median(rate),
                "step_time_s": statistics.median(r["step_time_s"] for r in runs),
                "calibration_step_s": statistics.median(r["calibration_step_s"] for r in runs),
                **{k: statistics.median(r[k] for r in runs) for k in ("calibration_mean_step_s", "quiet_mean_step_s")
                   if all(r.get(k) for r in runs)},
                "steps_to_target": statistics.median(reached) if reached else None,
                "time_to_target_s": statistics.median(r["time_to_target_s"] for r in runs
                                                      if r.get("time_to_target_s"))
                if any(r.get("time_to_target_s") for r in runs) else None,
                "steps_extrapolated": not any(r.get("steps_to_target") for r in runs) and bool(reached),
                "how": f"thinwire algorithm `local` (no communication) raced like every cell: the same workers, "
                       f"data, batch, budget, target and process layout, {len(runs)} run(s), one per seed"}

    # -- the matrix ----------------------------------------------------------------------------------
    def run(self, results: dict, progress: bool = True) -> dict:
        cfg = self.cfg
        cells, notes = presets.resolve(cfg.cells, strict=cfg.preset is None)
        for n in notes:
            if n not in results["notes"]:
                results["notes"].append(n)
                self.log(f"note: {n}")
        todo = [(c, n, sp, s) for _, n, sp in places(asdict(cfg)) for c in cells
                for s in range(cfg.seed, cfg.seed + cfg.seeds)]
        results["cells"] = [r for r in results["cells"] if r.get("status") == "ok"]
        done = {r["key"] for r in results["cells"]}
        shown = progress and not os.environ.get("THINWIRE_NO_PROGRESS")
        if results.get("baseline") and not results.get("baselines"):    # an older matrix: one reference
            results["baselines"] = {speeds_key(cfg.speeds[0]): results["baseline"]}
        baselines = results.setdefault("baselines", {})
        bar = progress_bar(total=len(todo) + len(cfg.speeds), desc="compare", unit="cell", disable=not shown,
                           initial=len(done) + len(baselines))
        try:
            for sp in cfg.speeds:   # the reference races the same speeds as the cells it is read against
                if speeds_key(sp) in baselines:
                    continue
                if not baselines:
                    # two steps of `local`, not recorded: every measured run (the reference first) starts in
                    self.calibrate(steps=2)    # processes that have built the model and run a step, as every cell
                runs = []
                for seed in range(cfg.seed, cfg.seed + cfg.seeds):
                    bar.set_description(f"compare: no-communication reference (seed {seed}"
                                        + (f", speeds {sp})" if sp else ")"))
                    runs.append(self.reference(seed, sp))
                baselines[speeds_key(sp)] = self.baseline(runs)
                results["baseline"] = baselines.get(speeds_key(cfg.speeds[0]))
                _save(results, self.out)
                bar.update(1)
            # the planner's compute step at full speed: the reference's at equal speeds, else the calibration's
            compute = (baselines.get("equal") or {}).get("step_time_s") or results["baseline"].get(
                "calibration_step_s")
            tuned = {(cell.label, network, sp): tune_cell(cell, network, cfg.workload, cfg.workers, compute, sp)
                     for cell in cells for _, network, sp in places(asdict(cfg))}
            if not results.get("predictions"):    # the planner's race, recorded before any cell runs
                results["predictions"] = {
                    place(n, sp): p for sp in cfg.speeds
                    for n, p in predict_race(tuned, cells, cfg, baselines[speeds_key(sp)], sp, compute).items()}
                _save(results, self.out)
            for cell, network, sp, seed in todo:
                key = self.key(cell, network, seed, sp)
                if key in done:
                    continue
                bar.set_description(f"compare: {key}")
                ran, why = tuned[cell.label, network, sp]
                t0 = _now()
                row = {"key": key, "label": cell.label, "network": place(network, sp), "link": network,
                       "speeds": sp, "seed": seed, "device": cfg.device, "peer": cell.peer, "cell": ran.to_dict(),
                       "ran_with": _ran_with(ran), "why": why,
                       "config": self.train_config(ran, network, seed, sp).to_dict()}
                try:
                    row["calibration_step_s"], row["calibration_mean_step_s"] = self.calibrate()
                    row.update(self.run_cell(ran, network, seed, sp))
                    row["status"] = "ok"
                except WorkerError as e:
                    stalled = isinstance(e, DeadlineError) or "stalled" in str(e)
                    row["status"] = "timeout" if stalled else "failed"
                    row["error"] = (f"stopped after {self.wall_limit():.0f} s of wall time" if stalled and
                                    self.wall_limit() else str(e).splitlines()[0][:300])
                except UserError as e:
                    row["status"], row["error"] = "failed", str(e)
                row["cell_wall_s"] = _now() - t0
                _derive(row, baselines[speeds_key(sp)], cfg, results["predictions"])
                results["cells"].append(row)
                _save(results, self.out)
                (bar.write if shown else self.log)(_one_line(row))
                bar.update(1)
        finally:
            bar.close()
            order = {n: i for i, (n, _, _) in enumerate(places(asdict(cfg)))}
            results["cells"].sort(key=lambda r: order.get(r["network"], 99))
            _save(results, self.out)
        return results


def speeds_key(speeds: str | None) -> str:
    """A speeds profile as the results' `baselines` name it."""
    return speeds or "equal"


def _save(results: dict, out: str) -> None:
    atomic_write(os.path.join(out, RESULTS), json.dumps(results, indent=1) + "\n")


def _ran_with(cell: presets.Cell) -> str:
    parts = [f"{k}={v}" for k, v in cell.params.items()]
    if cell.compressor:
        parts.insert(0, f"compressor={cell.compressor}" + (f", memory={cell.memory}" if cell.memory else ""))
    if cell.optimizer:
        parts.append(f"optimizer={cell.optimizer}")
    return ", ".join(parts) or "defaults"


def _curve(celldir: str, metric: str, total_sent: float) -> list:
    """[training time s, bytes sent per worker so far, metric] at every evaluation (for the plots). Bytes of
    transfers still in flight at the last step (drained by `close()`) are counted at the last point."""
    pts, sent = [], 0.0
    name = "accuracy" if metric == "accuracy" else "test_loss"
    with open(os.path.join(celldir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            sent += r["bytes_sent"]
            if name in r:
                pts.append([r["t"], sent, r[name]])
    if pts:
        pts[-1][1] = max(pts[-1][1], total_sent)
    return pts


def quiet_step_s(celldir: str, least: int = 5) -> tuple[float | None, float | None]:
    """(median, mean) of a run's steps that sent nothing (its compute, measured alongside its communication:
    DiLoCo's and local SGD's inner steps), past the first two; Nones with fewer than `least` of them."""
    with open(os.path.join(celldir, "metrics.jsonl")) as f:
        quiet = [r["step_s"] for r in map(json.loads, f) if r["step"] > 2 and not r["bytes_sent"]]
    return (statistics.median(quiet), statistics.fmean(quiet)) if len(quiet) >= least else (None, None)


def extrapolate_steps(celldir: str, metric: str, target: float) -> float | None:
    """The step where the metric's trend over the second half of a run's evaluations (a straight line in
    log(step)) meets the target; None if it moves away from it or would take over 10 times the run."""
    name = "accuracy" if metric == "accuracy" else "test_loss"
    with open(os.path.join(celldir, "metrics.jsonl")) as f:
        pts = [(r["step"], r[name]) for r in map(json.loads, f) if name in r and r["step"] > 0]
    pts = pts[len(pts) // 2:]
    if len(pts) < 3:
        return None
    xs, ys = [math.log(st) for st, _ in pts], [v for _, v in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope == 0 or (target - my) / slope < 0:
        return None
    steps = math.exp(mx + (target - my) / slope)
    return steps if steps <= 10 * pts[-1][0] else None


def measured_sync_s(row: dict) -> float | None:
    """The time one sync took: DiLoCo's own clock (from a fragment's first piece out to its last delivered: the
    sync hidden or not); for a blocking sync, the exposed time per sync (every H steps), or per step."""
    m = row.get("algorithm_metrics") or {}
    if m.get("sync_s") is not None:
        return m["sync_s"]
    syncs = m.get("syncs") if isinstance(m.get("syncs"), (int, float)) else None
    exposed = row.get("exposed_comm_s")
    if exposed is None or family(row.get("algorithm")) == "none":
        return None
    if syncs_every_step(row["cell"]["algorithm"]):
        return exposed / max(1, row.get("steps") or 1)
    return exposed / syncs if syncs else None


def _derive(row: dict, baseline: dict, cfg: CompareConfig, predictions: dict | None = None) -> None:
    """Fields computed from a cell's summary, the no-communication reference (the run of the same seed) and the
    planner's predictions."""
    ok = row.get("status") == "ok"
    same = [r for r in baseline.get("runs", []) if r.get("seed") == row.get("seed")]
    ref = same[0]["throughput_samples_s"] if same else baseline.get("throughput_samples_s")
    # the reference as the machine ran during this cell: the cell's compute step then — its own steps that sent
    # nothing (measured alongside its communication) where it has enough, else the calibration run just before it
    # — against the reference's same measure. The median is the compute the planner predicts from; the load drift
    # is a ratio of means, as the throughputs it scales are (a ratio of medians beside a ratio of means read
    # DiLoCo's scalability 1.04 where the reference's mean step lay 3.5 % over its median).
    drift = 1.0
    ref_run = same[0] if same else baseline
    # Workers of different speeds: a step of a synchronous cell lasts its slowest worker's, so its own quiet steps
    # measure the speeds, not the machine; and the short calibration runs scatter more than the effect they would
    # correct (one race read a calibration 2.6× slower before the reference than before a cell, whose throughputs
    # differed by 4 %). So there no correction is made, and the reference is its median over the seeds.
    quiet = row.get("quiet_step_s") if not row.get("speeds") else None
    row["compute_step_s"] = quiet or row.get("calibration_step_s")
    row["compute_basis"] = ("its own steps without communication" if quiet else
                            "the calibration run before it" if row.get("calibration_step_s") else None)
    if row.get("speeds"):
        ref = baseline.get("throughput_samples_s") or ref
    pairs = [] if row.get("speeds") else [(mine, theirs) for mine, theirs in (
        ("quiet_mean_step_s", "quiet_mean_step_s"), ("calibration_mean_step_s", "calibration_mean_step_s"),
        ("quiet_step_s", "step_time_s"), ("calibration_step_s", "step_time_s"))     # the last two: older results
        if quiet or not mine.startswith("quiet")]
    for mine, theirs in pairs:
        if row.get(mine) and ref_run.get(theirs):
            drift = ref_run[theirs] / row[mine]
            row["load_drift"] = drift
            break
    raw = (row["throughput_samples_s"] / (ref * drift)) if ok and ref and row.get("throughput_samples_s") else None
    # a cell cannot train faster than the same workers without communication: a reading above 1 is the speed
    # correction's noise (the machine's speed measured at the cell against at the reference: +0.4 % at most in the
    # map's runs), kept as `scalability_measured` and shown as 1
    row["scalability_measured"] = raw
    row["scalability"] = None if raw is None else min(1.0, raw)
    row["compression_ratio"] = (row["nominal_bytes_per_worker_per_step"] / row["bytes_sent_per_worker_per_step"]
                                if ok and row.get("bytes_sent_per_worker_per_step") else None)
    pred = ((predictions or {}).get(row["network"]) or {}).get("cells", {}).get(row["label"], {})
    row["predicted_step_time_s"] = pred.get("step_s") if ok else None
    if ok and row.get("compute_step_s"):    # predicted again from the compute the cell met (see above)
        cell = presets.Cell(row["label"], **{k: row["cell"][k] for k in ("algorithm", "compressor", "memory",
                                                                         "params", "optimizer")})
        now = predict_cell(cell, row.get("link", row["network"]), cfg, row["compute_step_s"], row.get("speeds"))
        if now.get("step_s"):
            row["predicted_step_time_s"] = mean_step(now, cell, row.get("steps") or 0)
    row["predicted_sync_s"] = pred.get("sync_s") if ok else None
    row["planned_time_to_target_s"] = pred.get("time_to_target_s")
    row["measured_sync_s"] = measured_sync_s(row) if ok else None
    row["mean_step_s"] = ((row["train_s"] - (row.get("drain_s") or 0.0)) / row["steps"]
                          if ok and row.get("steps") else None)


# -- across cells: predictions for cells out of budget, and the seeds' statistics --------------------------------
def _same_run(a: dict, b: dict) -> bool:
    """Whether rows a and b train the same trajectory step by step (the network changes time only)."""
    ca, cb = a["cell"], b["cell"]
    if a.get("seed") != b.get("seed") or ca.get("optimizer") != cb.get("optimizer"):
        return False
    if (ca["algorithm"], ca["compressor"], ca["memory"], ca["params"]) == \
            (cb["algorithm"], cb["compressor"], cb["memory"], cb["params"]):
        return True
    exact = lambda c: (family(c["algorithm"]) == "every_step" and not c["compressor"] and not c["params"]
                       and planned_as(c["algorithm"])[1] == "none")   # bsp, ssgd, ddp
    return exact(ca) and exact(cb)


def predict_missing(rows: list[dict]) -> None:
    """For every cell that ran out of budget (or steps) before the target: `predicted_time_to_target_s` = the
    steps to target of the same trajectory elsewhere in the matrix × this cell's median step time, with the
    basis in words (None where the matrix has no such reference)."""
    reached = [r for r in rows if r.get("status") == "ok" and r.get("steps_to_target")]
    for r in rows:
        r.pop("predicted_time_to_target_s", None)
        r.pop("prediction_basis", None)
        if r.get("status") != "ok" or r.get("time_to_target_s") is not None or not r.get("step_time_s"):
            continue
        refs = [x for x in reached if x is not r and _same_run(r, x)]
        if not refs:
            continue
        ref = min(refs, key=lambda x: x["steps_to_target"])
        r["predicted_time_to_target_s"] = ref["steps_to_target"] * r["step_time_s"]
        r["prediction_basis"] = (f"{ref['steps_to_target']} steps to target of `{ref['label']}` on "
                                 f"{ref['network']} (the same trajectory) × this cell's median step "
                                 f"{r['step_time_s'] * 1e3:.0f} ms")


def finish(results: dict) -> None:
    """The cross-cell fields: predictions for cells out of budget, then the per-contestant summary."""
    predict_missing(results["cells"])
    results["summary"] = aggregate(results["cells"], [name for name, _, _ in places(results["matrix"])])


def _one_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"  {r['key']}: {r['status']} ({r.get('error', '')})"
    acc = r.get("final_accuracy", r.get("final_loss"))
    ttt = (f"target in {r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else
           f"target not reached ({r.get('stop_reason')} after {r['train_s']:.1f} s)")
    return (f"  {r['key']} [{r.get('ran_with')}]: {r['metric']} {acc:.3f}, {ttt}, "
            f"{r['bytes_sent_per_worker_per_step'] / 1e6:.3f} MB/step, step {r['step_time_s'] * 1e3:.0f} ms")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text).strip("_")[:120]


def new_results(cfg: CompareConfig) -> dict:
    return {"version": 2, "matrix": asdict(cfg), "baseline": None, "cells": [], "notes": list(cfg.notes),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def load(out: str) -> tuple[CompareConfig, dict]:
    path = os.path.join(out, RESULTS)
    if not os.path.exists(path):
        raise UserError(f"nothing to resume: {path} does not exist")
    with open(path) as f:
        results = json.load(f)
    known = set(CompareConfig.__dataclass_fields__)
    return CompareConfig(**{k: v for k, v in results["matrix"].items() if k in known}), results


def compare(cfg: CompareConfig | None, out: str, resume: bool = False, progress: bool = True, pool=None) -> dict:
    """Run (or resume) the matrix into `out`; write results.json, report.md and the plots; return the results."""
    cfg, results = load(out) if resume else (cfg, new_results(cfg))
    cfg.validate()  # bad names and numbers fail here, before anything is started
    os.makedirs(out, exist_ok=True)
    env = Emulation(cfg.workers + 1).__enter__() if cfg.netem else None
    harness = Harness(cfg, out, netem_env=env, pool=pool)
    t0 = _now()
    try:
        harness.run(results, progress=progress)
    finally:
        harness.close()
        if env is not None:
            env.close()
        results["matrix_wall_s"] = results.get("matrix_wall_s", 0.0) + (_now() - t0)
        if results["cells"]:
            finish(results)
            _save(results, out)
            results["plots"] = plot_all(results, out)
            write_report(results, os.path.join(out, "report.md"))
            _save(results, out)
    return results
