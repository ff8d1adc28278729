"""The harness behind `thinwire compare`: a race to the target. Every (contestant × network × seed) cell is its own
training run on the same workload, data shards and workers; the results go to `DIR/results.json` after each cell,
then `DIR/report.md` and PNG plots are drawn from it.

**The race.** Every cell runs `thinwire.run.train.run_training` (the one loop of `thinwire.run.loop`, whatever its
stepper: thinwire's Trainer, a PyTorch DDP peer, torchft's DiLoCo) with the same budget of *training time*
(`budget_s`, evaluations excluded) and stops at the first evaluation whose mean metric over the workers reaches
the target, or when the budget is spent, or at the step bound (`epochs` / `steps`, none by default when a budget
is given): a cell that is fast per step is never cut off by a step count. Evaluations come every 2 % of the
training clock (`thinwire.run.loop.EVAL_PRECISION`, from the step time), so time to target is read to within
2 % (plus one step); every worker rank takes the same stop decision (one all-gather of metric and clock per
evaluation, outside the meter and the clock).

**A cell out of budget** is reported with its best metric and, where the matrix allows, a *predicted* time to
target: its steps to target measured elsewhere in the same matrix (the same contestant, settings and seed on
another network, where thinwire's trajectories are the same step by step; or an exact synchronous-SGD cell — bsp,
ssgd, ddp — of the same seed for another exact one) times this cell's own median step time.

**Seeds** (`seeds` > 1): every cell runs with seeds seed, seed+1, ...; the report gives the median and the range
(min–max) per contestant, and says two contestants are *within noise* of each other when their ranges of time to
target overlap (a seed that missed the target counts as +∞): a rule that is conservative with 3 seeds.

**Defaults that suit the network.** Parameters a cell leaves out are picked by the planner for the network, the
workload's size and the measured compute time (`thinwire.plan.advise.tune`); algorithms that compensate SGD only
run with SGD on a workload whose optimizer is another. The report states each cell's parameters and why.

- Scalability = throughput / throughput of the same workers doing no communication (the registered algorithm
  `local`, a short run measured first, which also gives the compute time per step for the planner).
- Worker processes are kept alive across cells (one pool per world size) and restarted after a failed cell; a
  cell whose wall time exceeds 4 × budget + 600 s is stopped and recorded as `timeout`.
- Interrupted runs keep the cells already done; `resume` runs the missing (or failed) cells of a matrix directory.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError, WorkerError
from ..files import atomic_write
from ..net import Islands, parse_network
from ..launcher import MAX_LOCAL_WORKERS, DeadlineError, Pool, pick_backend
from ..run import workloads
from ..run.loop import check_tensorboard, progress_bar, train_worker
from ..run.peers import PEER_AS, PEER_PARAMS
from ..run.train import MAX_SEED, TrainConfig, check_int, check_lengths, check_number, run_training, summarize
from . import presets
from .results import aggregate

_now = time.perf_counter
RESULTS = "results.json"
EXACT_SGD = ("bsp", "ssgd", "ddp")
BASELINE_STEPS = 20   # the same trajectory step by step (ddp up to float rounding)


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

    def validate(self) -> "CompareConfig":
        """Every name known and every number in its range (NaN and infinities included), before any cell starts."""
        workloads.registry.lookup(self.workload)
        for n in self.networks:
            net = parse_network(n)
            if isinstance(net, Islands):
                net.check_workers(self.workers)
        if not self.networks:
            raise UserError("give at least one network, e.g. --network wan")
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
            for network in self.networks:
                try:
                    cell_config(self, with_sgd_where_needed(cell, self.workload), network).validate()
                except UserError as e:
                    raise UserError(f"cell {cell.label!r}" + (f" on {network}" if len(self.networks) > 1
                                                               else "") + f": {e}") from None
        return self


def cell_config(c: CompareConfig, cell: presets.Cell, network: str, seed: int | None = None,
                board: str | None = None) -> TrainConfig:
    """The training run of `cell` on `network` in matrix `c` (before the planner fills in what it leaves out)."""
    params = dict(cell.params)
    servers = 0 if cell.peer else params.pop("servers", None)   # None: the algorithm's default
    tc = TrainConfig(workload=c.workload, algorithm=cell.algorithm, workers=c.workers, network=network,
                     epochs=c.epochs, steps=c.steps, seed=c.seed if seed is None else seed, target=c.target,
                     compressor=cell.compressor, memory=cell.memory, params=params,
                     trace=c.trace and not cell.peer, progress=False,
                     servers=servers,
                     budget_s=c.budget_s, stop_at_target=True, optimizer=cell.optimizer, tensorboard=board,
                     eval_every=c.eval_every, batch_size=c.batch_size, device=c.device)
    return tc


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


def with_sgd_where_needed(cell: presets.Cell, workload: str) -> presets.Cell:
    """A copy of `cell`, with SGD for an algorithm that compensates SGD only on a workload whose optimizer is
    another (unless the cell names one)."""
    out = replace(cell, params=dict(cell.params))
    if not cell.peer and cell.algorithm in presets.SGD_ONLY and cell.optimizer is None \
            and workloads.get(workload).optimizer != "sgd":
        out.optimizer = "sgd"
    return out


def tune_cell(cell: presets.Cell, network: str, workload: str, workers: int,
              compute_s: float | None) -> tuple[presets.Cell, list[str]]:
    """The cell with the parameters it leaves out picked for `network` (and SGD for an algorithm that
    compensates SGD only, on a workload whose optimizer is another); the reasons, one per decision."""
    from .. import algorithms
    from ..plan.advise import TUNABLE, tune
    from ..plan.costmodel import Scenario
    wl = workloads.get(workload)
    out = with_sgd_where_needed(cell, workload)
    why: list[str] = []
    if out.optimizer != cell.optimizer:
        why.append(f"optimizer=sgd: {cell.algorithm} compensates SGD only (the workload trains with {wl.optimizer})")
    plan_as = PEER_AS[cell.algorithm][0] if cell.peer else ("localsgd" if cell.algorithm == "diloco"
                                                            else cell.algorithm)
    if plan_as not in TUNABLE:
        return out, why
    takes = (lambda k: k in PEER_PARAMS[cell.algorithm]) if cell.peer else \
        (lambda k: algorithms.registry.accepts(cell.algorithm, k))
    if not any(takes(k) and k not in out.params for k in TUNABLE[plan_as]):
        return out, why
    if compute_s is None:
        why.append("defaults: no compute time was measured for the planner")
        return out, why
    s = Scenario(params=wl.num_params(), compute_s=compute_s, link=parse_network(network), workers=workers,
                 handshake=True)
    momentum = wl.optimizer_settings(out.optimizer)[1]["momentum"] if not cell.peer else 0.9
    pick, reason = tune(plan_as, s, out.params, compressor=out.compressor or "none", momentum=momentum)
    pick = {k: v for k, v in pick.items() if takes(k)}
    if pick:
        out.params.update(pick)
        why.append(f"{', '.join(f'{k}={v}' for k, v in pick.items())}: {reason}")
    return out, why


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
        if p is None or p._closed:
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
    def key(self, cell: presets.Cell, network: str, seed: int | None) -> str:
        """The cell's name in the results (with its seed when the matrix has several)."""
        return cell_key(cell.label, network, seed if self.cfg.seeds > 1 else None)

    def train_config(self, cell: presets.Cell, network: str, seed: int | None = None) -> TrainConfig:
        c = self.cfg
        board = os.path.join(c.tensorboard, _slug(self.key(cell, network, seed))) if c.tensorboard else None
        tc = cell_config(c, cell, network, seed, board)
        tc.resolve_servers()
        return tc

    def run_cell(self, cell: presets.Cell, network: str, seed: int | None = None) -> dict:
        tc = self.train_config(cell, network, seed)
        if self.cfg.netem:  # the real, shaped link delays the traffic: no in-process emulation on top
            tc = replace(tc, network="lan")
        world = tc.workers + tc.servers
        view = _PoolView(self.pool(world, network), self.wall_limit(), self.cfg.netem)
        celldir = os.path.join(self.out, "cells", _slug(self.key(cell, network, seed)))
        summary = run_training(tc, out=celldir, pool=view)
        summary["network"] = network
        summary["curve"] = _curve(celldir, summary["metric"], summary["bytes_sent_per_worker"])
        return summary

    # -- the no-communication reference (scalability, and the compute time the planner needs) ------------
    def baseline(self) -> dict:
        """`local` for 2 × BASELINE_STEPS steps; the rate and the median step time of the second half (the first
        steps pay warm-up)."""
        c = self.cfg
        tc = TrainConfig(workload=c.workload, algorithm="local", workers=c.workers, network="lan",
                         steps=2 * BASELINE_STEPS, seed=c.seed, progress=False, batch_size=c.batch_size,
                         device=c.device)
        view = _PoolView(self.pool(c.workers, "lan"), self.wall_limit(), c.netem)
        _, rows = summarize(tc, view.run(train_worker, tc.validate(), network="lan", seed=c.seed), 0.0)
        late = [r["step_s"] for r in rows[BASELINE_STEPS:]]
        wl = workloads.get(c.workload)
        return {"throughput_samples_s": len(late) * (c.batch_size or wl.batch_size) * c.workers / sum(late),
                "step_time_s": statistics.median(late),
                "how": f"thinwire algorithm `local` (no communication), steps {BASELINE_STEPS + 1}-"
                       f"{2 * BASELINE_STEPS} of a short run"}

    # -- the matrix ----------------------------------------------------------------------------------
    def run(self, results: dict, progress: bool = True) -> dict:
        cfg = self.cfg
        cells, notes = presets.resolve(cfg.cells, strict=cfg.preset is None)
        for n in notes:
            if n not in results["notes"]:
                results["notes"].append(n)
                self.log(f"note: {n}")
        todo = [(c, n, s) for n in cfg.networks for c in cells for s in range(cfg.seed, cfg.seed + cfg.seeds)]
        results["cells"] = [r for r in results["cells"] if r.get("status") == "ok"]
        done = {r["key"] for r in results["cells"]}
        shown = progress and not os.environ.get("THINWIRE_NO_PROGRESS")
        bar = progress_bar(total=len(todo) + 1, desc="compare", unit="cell", disable=not shown,
                           initial=len(done) + (1 if results.get("baseline") else 0))
        try:
            if not results.get("baseline"):
                bar.set_description("compare: no-communication reference")
                results["baseline"] = self.baseline()
                _save(results, self.out)
                bar.update(1)
            tuned: dict = {}
            for cell, network, seed in todo:
                key = self.key(cell, network, seed)
                if key in done:
                    continue
                bar.set_description(f"compare: {key}")
                if (cell.label, network) not in tuned:
                    tuned[cell.label, network] = tune_cell(cell, network, cfg.workload, cfg.workers,
                                                           results["baseline"].get("step_time_s"))
                ran, why = tuned[cell.label, network]
                t0 = _now()
                row = {"key": key, "label": cell.label, "network": network, "seed": seed, "device": cfg.device,
                       "peer": cell.peer, "cell": ran.to_dict(), "ran_with": _ran_with(ran), "why": why,
                       "config": asdict(self.train_config(ran, network, seed))}
                try:
                    row.update(self.run_cell(ran, network, seed))
                    row["status"] = "ok"
                except WorkerError as e:
                    stalled = isinstance(e, DeadlineError) or "stalled" in str(e)
                    row["status"] = "timeout" if stalled else "failed"
                    row["error"] = (f"stopped after {self.wall_limit():.0f} s of wall time" if stalled and
                                    self.wall_limit() else str(e).splitlines()[0][:300])
                except UserError as e:
                    row["status"], row["error"] = "failed", str(e)
                row["cell_wall_s"] = _now() - t0
                _derive(row, results["baseline"], cfg)
                results["cells"].append(row)
                _save(results, self.out)
                (bar.write if shown else self.log)(_one_line(row))
                bar.update(1)
        finally:
            bar.close()
            order = {n: i for i, n in enumerate(cfg.networks)}
            results["cells"].sort(key=lambda r: order.get(r["network"], 99))
            _save(results, self.out)
        return results


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


def predict_step_time(row: dict, cfg: CompareConfig, compute_s: float | None) -> float | None:
    """The planner's predicted iteration time (`thinwire.plan.costmodel.predict`) from the model size, this
    network and the measured no-communication step time; None where the planner has no model for the cell."""
    from ..plan.costmodel import Scenario, predict
    c = row["cell"]
    if compute_s is None:
        return None
    algorithm, compressor = PEER_AS.get(c["algorithm"], (c["algorithm"], c["compressor"] or "none"))
    params = dict(c["params"])
    if c["algorithm"] == "ddp-powersgd":
        params = {"rank": params.get("rank", 4)}
    elif c["peer"]:
        params = {k: v for k, v in params.items() if k == "period"}
    try:
        s = Scenario(params=workloads.get(cfg.workload).num_params(), compute_s=compute_s,
                     link=parse_network(row["network"]), workers=cfg.workers, handshake=True)
        return float(predict(s, algorithm, compressor, **params).iteration_s)
    except (UserError, KeyError, TypeError, ValueError) as e:
        row["prediction_error"] = f"{type(e).__name__}: {e}"
        return None


def _derive(row: dict, baseline: dict, cfg: CompareConfig) -> None:
    """Fields computed from a cell's summary and the no-communication reference."""
    ok = row.get("status") == "ok"
    ref = baseline.get("throughput_samples_s")
    row["scalability"] = (row["throughput_samples_s"] / ref) if ok and ref and row.get("throughput_samples_s") else None
    row["compression_ratio"] = (row["nominal_bytes_per_worker_per_step"] / row["bytes_sent_per_worker_per_step"]
                                if ok and row.get("bytes_sent_per_worker_per_step") else None)
    row["predicted_step_time_s"] = predict_step_time(row, cfg, baseline.get("step_time_s")) if ok else None


# -- across cells: predictions for cells out of budget, and the seeds' statistics --------------------------------
def _same_run(a: dict, b: dict) -> bool:
    """Whether rows a and b train the same trajectory step by step (the network changes time only)."""
    ca, cb = a["cell"], b["cell"]
    if a.get("seed") != b.get("seed") or ca.get("optimizer") != cb.get("optimizer"):
        return False
    if (ca["algorithm"], ca["compressor"], ca["memory"], ca["params"]) == \
            (cb["algorithm"], cb["compressor"], cb["memory"], cb["params"]):
        return True
    exact = lambda c: c["algorithm"] in EXACT_SGD and not c["compressor"] and not c["params"]
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
    results["summary"] = aggregate(results["cells"], results["matrix"]["networks"])


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
    from .plots import plot_all
    from .report import write_report
    cfg, results = load(out) if resume else (cfg, new_results(cfg))
    cfg.validate()  # bad names and numbers fail here, before anything is started
    os.makedirs(out, exist_ok=True)
    env = None
    if cfg.netem:
        from ..launcher.netem import Emulation
        env = Emulation(cfg.workers + 1).__enter__()
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
