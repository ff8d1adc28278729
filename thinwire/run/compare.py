"""The harness behind `thinwire compare`: every (contestant × network) cell is its own training run on the same
workload, seed, data shards and workers; the results go to `DIR/results.json` after each cell, then
`DIR/report.md` and PNG plots are drawn from it.

- A thinwire cell runs `thinwire.run.train.run_training` (exactly what `thinwire train` runs); a PyTorch peer
  runs `thinwire.run.peers.peer_worker` and is summarised by the same `summarize`, so both have the same fields.
- Worker processes are kept alive across cells (one pool per world size) and restarted after a failed cell.
- Scalability = throughput / throughput of the same workers doing no communication at all (algorithm `local`
  if registered, else a plain local-SGD loop measured here): the DTS issue's definition for a shared machine.
- `--budget S` stops a cell that runs longer than S seconds (recorded as `timeout`, the matrix goes on).
- Interrupted runs keep the cells already done (results.json is rewritten after every cell); `resume` runs the
  missing (or failed) cells of a matrix directory.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError, WorkerError
from ..net import parse_network
from . import presets, workloads
from .train import TrainConfig, _atomic_write, run_training, summarize

_now = time.perf_counter
RESULTS = "results.json"


@dataclass
class CompareConfig:
    workload: str = "digits-mlp"
    workers: int = 4
    networks: list = field(default_factory=lambda: ["wan"])
    cells: list = field(default_factory=lambda: ["bsp"])        # specs (strings or dicts)
    target: float | None = None
    budget_s: float | None = None
    epochs: float | None = None
    seed: int = 0
    trace: bool = False
    netem: bool = False
    preset: str | None = None
    notes: list = field(default_factory=list)

    def validate(self) -> "CompareConfig":
        workloads.registry.lookup(self.workload)
        for n in self.networks:
            parse_network(n)
        if not self.networks:
            raise UserError("give at least one network, e.g. --network wan")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise UserError(f"--workers must be >= 1, got {self.workers}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise UserError(f"--budget must be > 0 seconds, got {self.budget_s}")
        return self


def cell_key(label: str, network: str) -> str:
    return f"{label} @ {network}"


class _PoolView:
    """A pool as `run_training` sees it: with this cell's time limit, and under --netem no in-process
    emulation (the real, shaped network does it)."""

    def __init__(self, pool, timeout, netem):
        self.pool, self.timeout, self.netem = pool, timeout, netem

    def run(self, fn, *args, network="lan", seed=0, timeout=None):
        limit = self.timeout or timeout
        extra = {} if limit is None else {"timeout": limit}
        return self.pool.run(fn, *args, network="lan" if self.netem else network, seed=seed, **extra)


class Harness:
    """Runs a matrix, one cell at a time, keeping worker pools between cells."""

    def __init__(self, cfg: CompareConfig, out: str, netem_env=None, log=None, pool=None):
        self.cfg, self.out = cfg, out
        self.netem_env = netem_env  # a thinwire.run.netem.Emulation when --netem
        self._pools: dict[int, object] = {}
        self._given = pool  # a caller's pool of cfg.workers workers (tests): used, never closed here
        self.log = log or (lambda msg: print(msg, file=sys.stderr))

    # -- pools ---------------------------------------------------------------------------------------
    def pool(self, world: int, network: str):
        if self.cfg.netem:
            self.netem_env.configure(network)  # shape the real links for this cell's network
        if self._given is not None and world == self.cfg.workers and not self.cfg.netem:
            return self._given
        p = self._pools.get(world)
        if p is None or p._closed:
            if self.cfg.netem:
                p = self.netem_env.pool(world)
            else:
                from .launcher import Pool
                p = Pool(world, timeout=3600.0)
            self._pools[world] = p
        return p

    def close(self):
        for p in self._pools.values():
            p.close(force=True)
        self._pools.clear()

    # -- one cell ------------------------------------------------------------------------------------
    def train_config(self, cell: presets.Cell, network: str) -> TrainConfig:
        c = self.cfg
        return TrainConfig(workload=c.workload, algorithm=cell.algorithm, workers=c.workers, network=network,
                           epochs=c.epochs, seed=c.seed, target=c.target, compressor=cell.compressor,
                           memory=cell.memory, params=dict(cell.params), trace=c.trace and not cell.peer,
                           progress=False, servers=0 if cell.peer else _servers(cell))

    def run_cell(self, cell: presets.Cell, network: str) -> dict:
        tc = self.train_config(cell, network)
        if self.cfg.netem:  # the real, shaped link delays the traffic: no in-process emulation on top
            tc = replace(tc, network="lan")
        world = tc.workers + tc.servers
        view = _PoolView(self.pool(world, network), self.cfg.budget_s, self.cfg.netem)
        celldir = os.path.join(self.out, "cells", _slug(cell_key(cell.label, network)))
        t0 = _now()
        if cell.peer:
            from .peers import peer_worker
            results = view.run(peer_worker, tc, network=network, seed=tc.seed)
            summary, rows = summarize(tc, results, _now() - t0)
            summary["network"] = network
            os.makedirs(celldir, exist_ok=True)
            _atomic_write(os.path.join(celldir, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
            _atomic_write(os.path.join(celldir, "summary.json"), json.dumps(summary, indent=2) + "\n")
        else:
            summary = run_training(tc, out=celldir, pool=view)
            summary["network"] = network
        summary["curve"] = _curve(celldir, summary["metric"], summary["bytes_sent_per_worker"])
        return summary

    # -- the no-communication reference (scalability) -------------------------------------------------
    def baseline(self) -> dict:
        from .. import algorithms
        wl = workloads.get(self.cfg.workload)
        probe = TrainConfig(workload=self.cfg.workload, workers=self.cfg.workers, epochs=self.cfg.epochs)
        tc = TrainConfig(workload=self.cfg.workload, algorithm="bsp", workers=self.cfg.workers, network="lan",
                         steps=min(probe.total_steps(wl), 24), seed=self.cfg.seed, progress=False)  # a rate only
        view = _PoolView(self.pool(self.cfg.workers, "lan"), self.cfg.budget_s, self.cfg.netem)
        if "local" in algorithms.registry:
            tc.algorithm = "local"
            s = run_training(tc, pool=view)
            how = "thinwire algorithm `local` (no communication)"
        else:
            results = view.run(nocomm_worker, tc, network="lan", seed=tc.seed)
            s = summarize(tc, results, 0.0)[0]
            how = "plain local SGD, no communication (measured by the harness)"
        return {"throughput_samples_s": s["throughput_samples_s"], "step_time_s": s["step_time_s"],
                "how": how}

    # -- the matrix ----------------------------------------------------------------------------------
    def run(self, results: dict, progress: bool = True) -> dict:
        cfg = self.cfg
        cells, notes = presets.resolve(cfg.cells, strict=cfg.preset is None)
        for n in notes:
            if n not in results["notes"]:
                results["notes"].append(n)
                self.log(f"note: {n}")
        todo = [(c, n) for n in cfg.networks for c in cells]
        done = {r["key"] for r in results["cells"] if r.get("status") == "ok"}
        results["cells"] = [r for r in results["cells"] if r.get("status") == "ok"]
        bar = None
        if progress and not os.environ.get("THINWIRE_NO_PROGRESS"):
            from tqdm import tqdm
            bar = tqdm(total=len(todo) + 1, desc="compare", unit="cell", file=sys.stderr, dynamic_ncols=True,
                       initial=len(done) + (1 if results.get("baseline") else 0))
        write = lambda: _atomic_write(os.path.join(self.out, RESULTS), json.dumps(results, indent=1) + "\n")
        try:
            if not results.get("baseline"):
                if bar is not None:
                    bar.set_description("compare: no-communication reference")
                results["baseline"] = self.baseline()
                write()
                if bar is not None:
                    bar.update(1)
            for cell, network in todo:
                key = cell_key(cell.label, network)
                if key in done:
                    continue
                if bar is not None:
                    bar.set_description(f"compare: {key}")
                t0 = _now()
                row = {"key": key, "label": cell.label, "network": network, "peer": cell.peer,
                       "cell": cell.to_dict(), "config": asdict(self.train_config(cell, network))}
                try:
                    row.update(self.run_cell(cell, network))
                    row["status"] = "ok"
                except WorkerError as e:
                    stalled = "stalled" in str(e)
                    row["status"] = "timeout" if stalled else "failed"
                    row["error"] = (f"stopped after the budget of {cfg.budget_s:.0f} s" if stalled
                                    else str(e).splitlines()[0][:300])
                except UserError as e:
                    row["status"], row["error"] = "failed", str(e)
                row["cell_wall_s"] = _now() - t0
                _derive(row, results["baseline"], cfg)
                results["cells"].append(row)
                write()
                msg = _one_line(row)
                if bar is not None:
                    bar.write(msg)
                    bar.update(1)
                else:
                    self.log(msg)
        finally:
            if bar is not None:
                bar.close()
            results["cells"].sort(key=lambda r: [n for n in cfg.networks].index(r["network"])
                                  if r["network"] in cfg.networks else 99)
            write()
        return results


def _servers(cell: presets.Cell) -> int:
    """Parameter-server ranks to launch: the cell's `servers`, else the algorithm's own default."""
    from .. import algorithms
    if "servers" in cell.params:
        return int(cell.params["servers"])
    if (cell.params.get("architecture") or algorithms.architectures(cell.algorithm)[0]) != "ps":
        return 0
    servers = algorithms.registry.parameters(cell.algorithm).get("servers")
    return int(servers) if isinstance(servers, int) and servers > 0 else 1


def nocomm_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """The scalability reference when no `local` algorithm is registered: the same model, data shard, batch
    and optimizer, never communicating. Returns `train_worker`'s records (evaluated only at the end)."""
    wl = workloads.get(cfg.workload)
    model = wl.model(cfg.seed)
    opt = wl.make_optimizer(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    x, y = wl.shard(rank, world_size)
    loader = workloads.ShardLoader(x, y, cfg.batch_size or wl.batch_size, seed=cfg.seed, rank=rank)
    steps, clock = [], 0.0
    for step in range(1, cfg.total_steps(wl) + 1):
        t0 = _now()
        xb, yb = loader.next()
        loss = wl.loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        dt = _now() - t0
        clock += dt
        steps.append({"step": step, "loss": loss.item(), "t": clock, "step_s": dt, "bytes_sent": 0.0,
                      "emulated_s": 0.0, "wait_s": 0.0})
    value = wl.evaluate(model)
    return {"rank": rank, "role": "worker", "steps": steps,
            "evals": [{"step": 0, "t": 0.0, "value": value}, {"step": len(steps), "t": clock, "value": value}],
            "final": value, "meter": {"total": {"bytes_sent": 0.0, "emulated_s": 0.0, "wait_s": 0.0}},
            "metrics": {}, "trace": [], "num_params": sum(p.numel() for p in model.parameters()),
            "dtype_bytes": 4, "train_s": clock}


def _curve(celldir: str, metric: str, total_sent: float | None = None) -> list:
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
    if pts and total_sent is not None:
        pts[-1][1] = max(pts[-1][1], total_sent)
    return pts


_PEER_AS = {"ddp": ("bsp", "none"), "ddp-fp16": ("bsp", "fp16"), "ddp-powersgd": ("bsp", "powersgd"),
            "ddp-postlocalsgd": ("localsgd", "none")}


def predict_step_time(row: dict, cfg: CompareConfig, compute_s: float | None) -> float | None:
    """The planner's predicted iteration time (`thinwire.plan.costmodel.predict`) from the model size, this
    network and the measured no-communication step time; None where the planner has no model for the cell."""
    try:
        from ..plan.costmodel import Scenario, predict
    except ImportError:
        return None
    c = row["cell"]
    if compute_s is None:
        return None
    algorithm, compressor = _PEER_AS.get(c["algorithm"], (c["algorithm"], c["compressor"] or "none"))
    params = dict(c["params"])
    if c["algorithm"] == "ddp-powersgd":
        params = {"rank": params.get("rank", 4)}
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


def _one_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"  {r['key']}: {r['status']} ({r.get('error', '')})"
    acc = r.get("final_accuracy", r.get("final_loss"))
    ttt = f"target in {r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "target not reached"
    return (f"  {r['key']}: {r['metric']} {acc:.3f}, {ttt}, {r['bytes_sent_per_worker_per_step'] / 1e6:.3f} MB/step, "
            f"step {r['step_time_s'] * 1e3:.0f} ms")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text).strip("_")[:120]


def new_results(cfg: CompareConfig) -> dict:
    return {"version": 1, "matrix": asdict(cfg), "baseline": None, "cells": [], "notes": list(cfg.notes),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def load(out: str) -> tuple[CompareConfig, dict]:
    path = os.path.join(out, RESULTS)
    if not os.path.exists(path):
        raise UserError(f"nothing to resume: {path} does not exist")
    with open(path) as f:
        results = json.load(f)
    return CompareConfig(**results["matrix"]), results


def compare(cfg: CompareConfig | None, out: str, resume: bool = False, progress: bool = True, log=None,
            pool=None) -> dict:
    """Run (or resume) the matrix into `out`; write results.json, report.md and the plots; return the results."""
    from .plots import plot_all
    from .report import write_report
    if resume:
        cfg, results = load(out)
    else:
        results = new_results(cfg)
    cfg.validate()
    presets.resolve(cfg.cells, strict=cfg.preset is None)  # bad names fail here, before anything is started
    os.makedirs(out, exist_ok=True)
    env = None
    if cfg.netem:
        from .netem import Emulation
        env = Emulation(cfg.workers + 1)
        env.__enter__()
    harness = Harness(cfg, out, netem_env=env, log=log, pool=pool)
    t0 = _now()
    try:
        harness.run(results, progress=progress)
    finally:
        harness.close()
        if env is not None:
            env.__exit__(None, None, None)
        results["matrix_wall_s"] = results.get("matrix_wall_s", 0.0) + (_now() - t0)
        if results["cells"]:
            _atomic_write(os.path.join(out, RESULTS), json.dumps(results, indent=1) + "\n")
            results["plots"] = plot_all(results, out)
            write_report(results, os.path.join(out, "report.md"))
            _atomic_write(os.path.join(out, RESULTS), json.dumps(results, indent=1) + "\n")
    return results
