"""`thinwire compare`: cell specs and presets (pure logic), a tiny matrix end to end on lan with 2 real gloo
workers (thinwire cells, PyTorch peers, torchft's DiLoCo where installed), the race's semantics (the same budget of
training time for every cell, no step count cutting a fast cell, the stop at the target, seeds), the defaults the
planner picks, interruption/resume, and the real-network mode (root only)."""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import replace

import pytest

from thinwire.cli.compare import _networks, split_cells
from thinwire.errors import UserError
from thinwire.net import parse_network
from thinwire.compare import matrix as cmp
from thinwire.compare import results
from thinwire.compare import presets


# -- pure logic ------------------------------------------------------------------------------------------------
def test_cell_specs_parse():
    c = presets.parse_cell("bsp+topk:ratio=0.01,memory=residual")
    assert (c.algorithm, c.compressor, c.memory, c.params) == ("bsp", "topk", "residual", {"ratio": 0.01})
    c = presets.parse_cell("dts:delay=4,period=2")
    assert (c.algorithm, c.compressor, c.params) == ("dts", None, {"delay": 4, "period": 2})
    d = presets.parse_cell({"algorithm": "bsp", "compressor": "fp16", "params": {}})
    assert d.label == "bsp+fp16" and d.compressor == "fp16"
    assert presets.parse_cell("ddp-powersgd").peer and not presets.parse_cell("bsp").peer
    with pytest.raises(UserError):
        presets.parse_cell("bsp:ratio")
    with pytest.raises(UserError):
        presets.parse_cell({"compressor": "topk"})
    assert split_cells("bsp,dts:delay=4,period=4,ddp") == ["bsp", "dts:delay=4,period=4", "ddp"]
    assert split_cells("bsp+topk:ratio=0.01,memory=residual,ddp-fp16") == ["bsp+topk:ratio=0.01,memory=residual",
                                                                           "ddp-fp16"]
    assert split_cells("a;b:x=1,y=2") == ["a", "b:x=1,y=2"]
    assert _networks("lan,wan,custom:bandwidth=1gbit,latency=5ms") == ["lan", "wan",
                                                                      "custom:bandwidth=1gbit,latency=5ms"]


def test_strict_cells_raise_and_presets_skip_with_notes():
    with pytest.raises(UserError, match="valid:"):
        presets.resolve(["no-such-algorithm"], strict=True)
    with pytest.raises(UserError, match="parameter"):
        presets.resolve(["bsp:no_such_param=1"], strict=True)
    cells, notes = presets.resolve(["bsp", "no-such-algorithm", "bsp:no_such_param=1", "ddp"], strict=False)
    assert [c.label for c in cells] == ["bsp", "bsp:no_such_param=1", "ddp"]
    assert cells[1].params == {}
    assert any("no-such-algorithm" in n for n in notes) and any("no_such_param" in n for n in notes)
    for name in presets.names():  # every preset resolves to something runnable today
        pr = presets.get(name)
        cells, _ = presets.resolve(pr.cells, strict=False)
        assert cells and all(c.peer or c.algorithm for c in cells)
    with pytest.raises(UserError, match="quick"):
        presets.get("nope")
    assert "bsp" in [c.label for c in presets.resolve(presets.get("quick").cells, strict=False)[0]]


# -- end to end ------------------------------------------------------------------------------------------------
def _torchft() -> bool:
    from thinwire.compare.peers import find
    return find("torchft-diloco").missing() is None


CELLS = ["bsp", "bsp+fp16", "ddp", "ddp-fp16", "ddp-powersgd", "ddp-postlocalsgd:period=2,warmup=2",
         "ddp-hierarchical:period=4,local_period=2,group=1,warmup=2"] + (["torchft-diloco:period=4"] if _torchft()
                                                                         else [])


@pytest.fixture(scope="module")
def matrix(pool2, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cmp"))
    # evaluations every step: the step a cell stops at is then the first on target, whatever the timing
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan"], cells=CELLS, epochs=1.0,
                            target=0.8, eval_every=1)
    t0 = time.perf_counter()
    results = cmp.compare(cfg, out, progress=False, pool=pool2)
    return out, results, time.perf_counter() - t0


def test_matrix_end_to_end(matrix):
    out, results, _ = matrix
    on_disk = json.load(open(os.path.join(out, "results.json")))
    assert [r["label"] for r in on_disk["cells"]] == CELLS
    assert on_disk["baseline"]["throughput_samples_s"] > 0
    for r in on_disk["cells"]:
        assert r["status"] == "ok", r.get("error")
        for k in ("config", "final_accuracy", "best_accuracy", "time_to_target_s", "steps",
                  "bytes_sent_per_worker_per_step", "nominal_bytes_per_worker_per_step", "exposed_comm_s",
                  "throughput_samples_s", "scalability", "predicted_step_time_s", "curve"):
            assert k in r, k
        assert r["steps"] > 0 and r["config"]["workers"] == 2
        assert r["final_accuracy"] > 0.5 and r["scalability"] > 0
        assert r["curve"][0][1] >= 0 and r["curve"][-1][2] == pytest.approx(r["final_accuracy"])
    by = {r["label"]: r for r in on_disk["cells"]}
    nominal = by["bsp"]["nominal_bytes_per_worker_per_step"]
    # byte accounting: thinwire's meter and the peers' counted all-reduces agree on the fp32 and fp16 volumes
    assert by["bsp"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal, rel=0.02)
    assert by["ddp"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal, rel=0.02)
    assert by["ddp-fp16"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal / 2, rel=0.02)
    assert by["bsp+fp16"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal / 2, rel=0.05)
    assert by["ddp-powersgd"]["bytes_sent_per_worker_per_step"] < nominal / 2
    assert by["ddp-postlocalsgd:period=2,warmup=2"]["bytes_sent_per_worker_per_step"] < nominal
    assert by["ddp-hierarchical:period=4,local_period=2,group=1,warmup=2"]["bytes_sent_per_worker_per_step"] < nominal
    if _torchft():  # one fp32 bucket of the model every 4 steps, through the wrapped process group
        r = by["torchft-diloco:period=4"]
        assert r["bytes_sent_per_worker"] == pytest.approx(r["steps"] // 4 * nominal)
        assert "torchft" in r["algorithm_metrics"]["peer"]
    assert all(by[p]["peer"] for p in ("ddp", "ddp-fp16", "ddp-powersgd")) and not by["bsp"]["peer"]
    # the same workload, seed and shards: plain DDP and thinwire's bsp train the same model
    assert by["ddp"]["final_accuracy"] == pytest.approx(by["bsp"]["final_accuracy"], abs=0.02)
    assert by["ddp"]["steps_to_target"] == by["bsp"]["steps_to_target"]
    for r in on_disk["cells"]:  # the race: each cell stopped at the first evaluation on target, or at its bound
        assert r["stop_reason"] in ("target", "steps") and r["config"]["stop_at_target"]
        if r["stop_reason"] == "target":
            assert r["steps"] == r["steps_to_target"] and r["best_accuracy"] >= 0.8


def test_the_reference_races_like_the_cells_and_the_planner_predicts_first(matrix):
    """The no-communication reference is `local` raced with every cell's workers, data, batch, target, step bound
    and process layout (one run per seed, its spread reported); each cell's scalability is against the reference
    of its seed, scaled by the machine's speed measured before each (a short calibration run); the planner's
    predicted steps, syncs and times to target were recorded before the cells ran."""
    out, results, _ = matrix
    base = results["baseline"]
    assert len(base["runs"]) == 1 and base["throughput_min"] <= base["throughput_samples_s"] <= base["throughput_max"]
    ref = base["runs"][0]
    assert ref["config"]["algorithm"] == "local" and ref["steps"] > 0 and ref["curve"]
    for r in results["cells"]:
        mine = {k: v for k, v in r["config"].items() if k not in ("algorithm", "network", "params", "compressor",
                                                                  "memory", "servers", "trace", "tensorboard")}
        theirs = {k: v for k, v in ref["config"].items() if k in mine}
        assert mine == theirs, (r["label"], mine, theirs)
        # against the reference as the machine ran during the cell: its compute step then against the reference's
        # same measure, a ratio of means as the throughputs are (the median is what the planner predicts from)
        assert r["compute_step_s"] in (r["quiet_step_s"], r["calibration_step_s"]) and r["compute_basis"]
        mean = "quiet_mean_step_s" if r["quiet_step_s"] else "calibration_mean_step_s"
        assert r["load_drift"] == pytest.approx(ref[mean] / r[mean])
        assert r["scalability_measured"] == pytest.approx(r["throughput_samples_s"] / ref["throughput_samples_s"]
                                                          / r["load_drift"])
        assert r["scalability"] == min(1.0, r["scalability_measured"])
    pred = results["predictions"]["lan"]
    assert set(pred["cells"]) == set(CELLS)
    assert all(p.get("step_s", 0) > 0 for label, p in pred["cells"].items() if not label.startswith("ddp-hier"))
    if base["steps_to_target"]:
        assert pred["winner"] in CELLS and all(
            p["time_to_target_s"] == pytest.approx(p["steps"] * p["step_s"]) for p in pred["cells"].values()
            if "steps" in p)
        assert "**Predicted before the race**" in open(os.path.join(out, "report.md")).read()


def test_report_and_plots(matrix):
    out, results, _ = matrix
    report = open(os.path.join(out, "report.md")).read()
    assert "**Winner: `" in report and "| rank | contestant |" in report
    assert "PyTorch peer" in report and "bucket" in report
    for png in ("accuracy_vs_time.png", "accuracy_vs_bytes.png"):
        path = os.path.join(out, png)
        assert os.path.getsize(path) > 10_000 and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        assert png in report


def test_interrupted_matrix_keeps_cells_and_resumes(matrix, pool2, tmp_path, monkeypatch):
    src, results, _ = matrix
    out = str(tmp_path)
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan", "dc"], cells=["bsp", "ddp-fp16"],
                            epochs=1.0, target=0.5)
    state = cmp.new_results(cfg)
    state["baseline"] = results["baseline"]
    real = cmp.Harness.run_cell
    calls = []

    def interrupt_on_third(self, cell, network, seed=None, speeds=None):
        calls.append(cmp.cell_key(cell.label, network))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, cell, network, seed, speeds)

    monkeypatch.setattr(cmp.Harness, "run_cell", interrupt_on_third)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(state, f)
    with pytest.raises(KeyboardInterrupt):
        cmp.compare(None, out, resume=True, progress=False, pool=pool2)
    kept = json.load(open(os.path.join(out, "results.json")))
    assert [r["key"] for r in kept["cells"]] == ["bsp @ lan", "ddp-fp16 @ lan"]
    assert os.path.exists(os.path.join(out, "report.md"))  # a partial report of what is done
    first = {r["key"]: r["train_s"] for r in kept["cells"]}
    monkeypatch.setattr(cmp.Harness, "run_cell", real)
    done = cmp.compare(None, out, resume=True, progress=False, pool=pool2)
    assert [r["key"] for r in done["cells"]] == ["bsp @ lan", "ddp-fp16 @ lan", "bsp @ dc", "ddp-fp16 @ dc"]
    assert {r["key"]: r["train_s"] for r in done["cells"][:2]} == first  # kept, not re-run
    assert os.path.exists(os.path.join(out, "time_to_target_vs_network.png"))
    with pytest.raises(UserError, match="nothing to resume"):
        cmp.compare(None, str(tmp_path / "empty"), resume=True)


def test_cli_rejects_bad_input():
    import argparse
    import subprocess
    import sys

    from thinwire.cli.compare import config_from_args
    r = subprocess.run([sys.executable, "-m", "thinwire", "compare", "--algorithms", "bsp,nope", "--network", "lan",
                        "--out", "/tmp/thinwire-never"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "valid:" in r.stderr and not os.path.exists("/tmp/thinwire-never")
    base = dict(preset=None, algorithms=None, workload=None, workers=None, network=None, epochs=None, target=None,
                budget=None, seed=0, trace=False, netem=False)
    with pytest.raises(UserError, match="quick"):
        config_from_args(argparse.Namespace(**{**base, "preset": "nope"}))
    with pytest.raises(UserError, match="--algorithms"):
        config_from_args(argparse.Namespace(**base))
    cfg = config_from_args(argparse.Namespace(**{**base, "preset": "quick", "network": "lan,wan", "workers": 2}))
    assert cfg.networks == ["lan", "wan"] and cfg.workers == 2
    assert cfg.workload == presets.get("quick").workload and cfg.budget_s == presets.get("quick").budget_s
    cfg = config_from_args(argparse.Namespace(**{**base, "preset": "world", "seeds": 2}))
    assert cfg.seeds == 2 and config_from_args(argparse.Namespace(**{**base, "preset": "world"})).seeds == 3


# -- the race ----------------------------------------------------------------------------------------------------
def test_every_cell_gets_the_same_budget_and_a_fast_cell_is_not_cut_off_by_steps(pool2, tmp_path):
    """A slow-per-step cell (bsp behind 30 ms of emulated latency) and a fast one (`local`: no communication) with
    a target out of reach (perfect accuracy, in 2 s): both train until the first evaluation whose (agreed) training
    clock reached the same budget; the fast one runs far more steps than the workload's epochs would have allowed."""
    from thinwire.run.train import TrainConfig
    from thinwire.run.workloads import get
    budget = 2.0
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["custom:latency=30ms"],
                            cells=["bsp", "local"], budget_s=budget, target=1.0)
    res = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    by = {r["label"]: r for r in res["cells"]}
    for r in by.values():
        assert r["status"] == "ok" and r["config"]["budget_s"] == budget and r["stop_reason"] == "budget"
        ts = [p[0] for p in r["curve"]]  # the evaluations' training clocks (the slowest worker's)
        assert ts[-2] < budget <= ts[-1] <= r["train_s"]
    old_bound = TrainConfig(workload="digits-mlp", workers=2).total_steps(get("digits-mlp"))
    assert by["local"]["steps"] > max(old_bound, 5 * by["bsp"]["steps"])
    report = open(tmp_path / "report.md").read()
    assert f"same budget of {budget:g} s of training time" in report and "not reached (budget)" in report


def test_seeds_give_median_range_and_noise(pool2, tmp_path):
    """Two seeds per cell: a row per seed, the summary's median and range, the stop at the target, the same
    trajectory for bsp and DDP seed by seed, and the report's statement about noise."""
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan"], cells=["bsp", "ddp"], epochs=2.0,
                            target=0.8, seeds=2, seed=3, eval_every=1)
    res = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    rows = {(r["label"], r["seed"]): r for r in res["cells"]}
    assert set(rows) == {("bsp", 3), ("bsp", 4), ("ddp", 3), ("ddp", 4)}
    for (label, seed), r in rows.items():
        assert r["key"] == cmp.cell_key(label, "lan", seed) and r["config"]["seed"] == seed
        assert r["stop_reason"] == "target" and r["steps"] == r["steps_to_target"]
        assert r["steps_to_target"] == rows["bsp", seed]["steps_to_target"]  # DDP = bsp, step by step
    for e in res["summary"]:
        ttt = sorted(rows[e["label"], s]["time_to_target_s"] for s in (3, 4))
        assert e["seeds"] == e["reached"] == 2
        assert (e["ttt_min"], e["ttt_max"]) == (ttt[0], ttt[1]) and e["ttt_median"] == pytest.approx(sum(ttt) / 2)
    best, other = results.rank(res["summary"])
    ahead = all(rows[other["label"], s]["time_to_target_s"] - (rows[other["label"], s]["time_to_target_resolution_s"]
                                                               or 0) > rows[best["label"], s]["time_to_target_s"]
                for s in (3, 4))
    assert other["within_noise_of_best"] == (not ahead) and len(other["paired_ratios"]) == 2
    report = open(tmp_path / "report.md").read()
    assert "median over 2 seeds" in report and ("Within noise of it" in report or "in every seed" in report)


def test_scalability_compares_means_with_means():
    """The map read DiLoCo's scalability 1.04-1.05: the reference's mean step (its throughput) lay 3.5 % over its
    median, and the drift scaled it by a ratio of medians. A reference with a few slow steps and a DiLoCo cell
    whose inner steps are the reference's fast ones plus three slower syncs: the cell's scalability stays under 1."""
    ref_steps = [0.1185] * 95 + [0.2] * 5
    cell_steps = [0.1185] * 97 + [0.15] * 3
    batch = 64
    run = {"seed": 0, "throughput_samples_s": batch * len(ref_steps) / sum(ref_steps),
           "step_time_s": statistics.median(ref_steps), "quiet_mean_step_s": statistics.fmean(ref_steps),
           "calibration_step_s": 0.1185, "calibration_mean_step_s": 0.1226}
    row = {"status": "ok", "seed": 0, "network": "wan", "label": "diloco", "steps": len(cell_steps),
           "throughput_samples_s": batch * len(cell_steps) / sum(cell_steps), "train_s": sum(cell_steps),
           "quiet_step_s": 0.1185, "quiet_mean_step_s": 0.1185, "calibration_step_s": 0.1185,
           "nominal_bytes_per_worker_per_step": 1.0, "bytes_sent_per_worker_per_step": 0.03,
           "cell": {"algorithm": "diloco", "compressor": None, "memory": None, "params": {}, "optimizer": None}}
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["wan"], cells=["diloco"])
    cmp._derive(row, {"runs": [run]}, cfg)
    assert row["load_drift"] == pytest.approx(statistics.fmean(ref_steps) / 0.1185)
    assert row["scalability"] == pytest.approx(statistics.fmean(cell_steps[:97]) / statistics.fmean(cell_steps))
    assert row["scalability"] < 1
    del row["quiet_step_s"], row["quiet_mean_step_s"]        # no quiet steps: the calibration runs' means
    row["calibration_mean_step_s"] = 0.1226
    cmp._derive(row, {"runs": [run]}, cfg)
    assert row["load_drift"] == 1.0 and row["compute_basis"] == "the calibration run before it"
    # the machine ran faster during the cell than the correction saw (the map once read 1.004): shown as 1
    row["throughput_samples_s"] = 1.01 * run["throughput_samples_s"]
    cmp._derive(row, {"runs": [run]}, cfg)
    assert row["scalability_measured"] == pytest.approx(1.01) and row["scalability"] == 1.0


def test_predicted_time_to_target_of_a_cell_out_of_budget():
    """A cell that ran out of budget gets the steps to target of the same trajectory elsewhere in the matrix
    (the same settings and seed on another network; or an exact synchronous-SGD cell) × its own step time."""
    def row(label, network, alg, steps_to_target, step_s, seed=0, params=None, compressor=None):
        return {"label": label, "network": network, "seed": seed, "status": "ok", "step_time_s": step_s,
                "steps_to_target": steps_to_target, "time_to_target_s": None if steps_to_target is None else 1.0,
                "cell": {"algorithm": alg, "compressor": compressor, "memory": None, "params": params or {},
                         "optimizer": None}}
    rows = [row("bsp", "lan", "bsp", 40, 0.01), row("bsp", "world", "bsp", None, 2.0),
            row("ddp", "world", "ddp", None, 1.5), row("dts", "world", "dts", None, 0.3, params={"delay": 2}),
            row("dts", "lan", "dts", 60, 0.01, params={"delay": 3}), row("bsp", "world", "bsp", None, 2.0, seed=1)]
    cmp.predict_missing(rows)
    assert rows[1]["predicted_time_to_target_s"] == pytest.approx(40 * 2.0) and "`bsp` on lan" in rows[1]["prediction_basis"]
    assert rows[2]["predicted_time_to_target_s"] == pytest.approx(40 * 1.5)   # DDP: exact synchronous SGD as bsp
    assert "predicted_time_to_target_s" not in rows[3]   # other settings: another trajectory, no prediction
    assert "predicted_time_to_target_s" not in rows[5]   # another seed
    assert "predicted_time_to_target_s" not in rows[0]   # reached: measured, not predicted


def test_a_lead_is_real_only_when_ahead_in_every_seed():
    """Seed by seed (the same data and initialization for every contestant): `b`'s range overlaps `a`'s, but it is
    behind in every seed, so `a`'s lead is real; `e` is ahead of `a` in one seed, so it is within noise."""
    def e(label, ttts):
        finite = [t for t in ttts if t is not None]
        vals = [t if t is not None else math.inf for t in ttts]
        return {"label": label, "network": "wan", "status": "ok", "metric": "accuracy", "best_accuracy": 0.9,
                "seeds": len(ttts), "ok": len(ttts), "reached": len(finite), "ttt_median": statistics.median(vals),
                "ttt_min": min(vals), "ttt_max": max(vals)}
    rows = []
    for label, ttts in (("a", [10, 11, 12]), ("b", [11.5, 13, 14]), ("c", [20, 21, 22]), ("d", [None, None, 9]),
                        ("e", [9.5, 12, 13])):
        for i, t in enumerate(ttts):
            rows.append({"label": label, "network": "wan", "seed": i, "status": "ok", "metric": "accuracy",
                         "time_to_target_s": t, "best_accuracy": 0.9, "cell": {}})
    out = {x["label"]: x for x in results.aggregate(rows, ["wan"])}
    assert [x["label"] for x in results.rank(list(out.values()))] == ["a", "e", "b", "c", "d"]  # d: 1/3 reached
    assert not out["b"]["within_noise_of_best"] and not out["c"]["within_noise_of_best"]
    assert out["b"]["paired_ratios"] == pytest.approx([1.15, 13 / 11, 14 / 12]) and out["b"]["lead_real"]
    assert out["d"]["within_noise_of_best"]  # ahead of a in its one good seed: no lead
    assert out["e"]["within_noise_of_best"] and not out["e"]["lead_real"]
    assert (out["a"]["ttt_median"], out["a"]["ttt_min"], out["a"]["ttt_max"]) == (11, 10, 12)
    # one seed each: a point and the precision of its reading (read between evaluations 2 % apart here)
    rows = [{"label": label, "network": "dc", "seed": 0, "status": "ok", "metric": "accuracy", "time_to_target_s": t,
             "time_to_target_resolution_s": 0.02 * t, "best_accuracy": 0.9, "cell": {}}
            for label, t in (("a", 16.6), ("b", 16.7), ("c", 18.0))]
    out = {x["label"]: x for x in results.aggregate(rows, ["dc"])}
    assert out["b"]["within_noise_of_best"] and not out["c"]["within_noise_of_best"]


# -- defaults that suit the network ---------------------------------------------------------------------------------
def test_defaults_are_picked_for_the_network_and_stated():
    cell = presets.parse_cell("localsgd")
    lan, why_lan = cmp.tune_cell(cell, "cluster", "wide-mlp", 4, compute_s=0.05)
    wan, why_wan = cmp.tune_cell(cell, "world", "wide-mlp", 4, compute_s=0.05)
    assert lan.params["period"] < wan.params["period"] and cell.params == {}   # the cell itself is untouched
    assert "planner: world" in why_wan[0] and "M params" in why_wan[0] and why_wan[0].startswith("period=")
    dts, why = cmp.tune_cell(presets.parse_cell("dts:delay=2"), "world", "wide-mlp", 4, compute_s=0.05)
    assert dts.params["delay"] == 2 and "period" in dts.params and why[0].startswith("period=")  # given ones stay
    peer, _ = cmp.tune_cell(presets.parse_cell("ddp-postlocalsgd"), "world", "wide-mlp", 4, compute_s=0.05)
    assert peer.params["period"] == wan.params["period"]   # planned as the same model averaging
    same, why = cmp.tune_cell(presets.parse_cell("localsgd:period=8"), "world", "wide-mlp", 4, compute_s=0.05)
    assert same.params == {"period": 8} and why == []
    assert cmp.tune_cell(presets.parse_cell("bsp"), "world", "wide-mlp", 4, compute_s=0.05) == (presets.parse_cell("bsp"), [])


def test_sgd_only_algorithms_run_with_sgd_on_another_optimizer(monkeypatch):
    from thinwire.run import workloads
    real = workloads.get
    monkeypatch.setattr(workloads, "get", lambda name: _Adam(real(name)))
    cell, why = cmp.tune_cell(presets.parse_cell("dts"), "world", "wide-mlp", 4, compute_s=0.05)
    assert cell.optimizer == "sgd" and why[0].startswith("optimizer=sgd: dts compensates SGD only")
    cell, why = cmp.tune_cell(presets.parse_cell("localsgd"), "world", "wide-mlp", 4, compute_s=0.05)
    assert cell.optimizer is None


class _Adam:
    def __init__(self, wl):
        self._wl, self.optimizer = wl, "adamw"

    def __getattr__(self, name):
        return getattr(self._wl, name)


def test_a_presets_batch_size_reaches_every_cell_and_the_reference():
    """paper-dts trains with a larger per-worker batch (compute per step ≈ one-way latency, as in Zhu et al. 2019, DTS): the
    preset's batch goes to the matrix (not when another workload is named), to every cell and the baseline."""
    import argparse

    from thinwire.cli.compare import config_from_args
    base = dict(preset="paper-dts", algorithms=None, workload=None, workers=None, network=None, epochs=None,
                target=None, budget=None, seed=0, trace=False, netem=False)
    cfg = config_from_args(argparse.Namespace(**base))
    assert cfg.batch_size == presets.get("paper-dts").batch_size == 128
    assert config_from_args(argparse.Namespace(**{**base, "workload": "digits-mlp"})).batch_size is None
    assert config_from_args(argparse.Namespace(**{**base, "preset": "quick"})).batch_size is None
    h = cmp.Harness(cfg.validate(), "/tmp/thinwire-never")
    assert h.train_config(presets.parse_cell("bsp"), cfg.networks[0]).batch_size == 128
    with pytest.raises(UserError, match="batch size"):
        replace(cfg, batch_size=0).validate()


def test_presets_name_the_papers_matrices():
    quick = presets.get("quick")
    assert quick.workload == "stdlib-lm" and quick.networks in (["world"], ["wan"]) and quick.budget_s
    names = {presets.parse_cell(c).algorithm for c in quick.cells}
    assert {"bsp", "ddp", "localsgd", "diloco", "torchft-diloco"} <= names
    assert names & {"ddp-postlocalsgd", "ddp-powersgd", "ddp-hierarchical"}
    assert any(presets.parse_cell(c).memory for c in quick.cells)   # a compressor with error feedback
    dts = presets.get("paper-dts")
    lat = [parse_network(n).latency for n in dts.networks]
    assert lat[0] == 0 and max(lat) == pytest.approx(1.0) and 0.25 in [round(x, 3) for x in lat]
    assert {presets.parse_cell(c).algorithm for c in dts.cells} == {"bsp", "delayed", "tsparse", "dts"}
    assert any(presets.parse_cell(c).compressor == "dgc" for c in dts.cells)
    assert "dts" in dts.cells       # the planner's DTS (within the accuracy bound) beside the paper's t = p = 4
    cd = presets.get("paper-cdsgd")
    assert {"ssgd", "bitsgd", "odsgd", "cdsgd"} == {presets.parse_cell(c).algorithm for c in cd.cells}
    assert sorted(presets.parse_cell(c).params["k"] for c in cd.cells if "k=" in c) == [2, 5, 10, 20]
    world = presets.get("world")
    assert world.seeds == 3 and world.networks == ["world"]
    algos = {presets.parse_cell(c).algorithm for c in world.cells}   # every family once, against the peers
    assert {"bsp", "localsgd", "dts", "cdsgd", "diloco", "ddp", "ddp-powersgd", "ddp-postlocalsgd",
            "torchft-diloco"} <= algos and any(presets.parse_cell(c).memory for c in world.cells)
    isl = presets.get("islands")      # hierarchical DiLoCo against flat DiLoCo and the peers, on islands
    assert isl.seeds == 3 and len(isl.networks) == 1 and parse_network(isl.networks[0]).islands == 2
    assert {"diloco", "diloco:replicas=worker", "ddp", "torchft-diloco"} <= set(isl.cells)
    m = presets.get("map")            # six networks: the four profiles, a consumer link and islands
    assert m.networks[:5] == ["dc", "cluster", "wan", "world", "home"] and m.networks[5].startswith("islands:")
    assert {presets.parse_cell(c).algorithm for c in m.cells} >= {"bsp", "localsgd", "diloco", "ddp",
                                                                   "ddp-postlocalsgd", "torchft-diloco"}
    assert "diloco" in quick.cells      # named without parameters: the planner's DiLoCo in the demo
    from thinwire.run import workloads
    assert all(p.workload in workloads.registry for p in presets.PRESETS.values())


# -- real-network mode -----------------------------------------------------------------------------------------
def _netem_skip():
    from thinwire.launcher.netem import available
    return available()


needs_root = pytest.mark.skipif(_netem_skip() is not None, reason=f"--netem: {_netem_skip()}")


def _timings(rank, world, nbytes):
    import torch
    import torch.distributed as dist
    t = torch.zeros(nbytes // 4)
    dist.barrier()
    out = []
    for _ in range(3):  # ping-pong between ranks 0 and 1: one round trip
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t[:1], 1)
            dist.recv(t[:1], 1)
        elif rank == 1:
            dist.recv(t[:1], 0)
            dist.send(t[:1], 0)
        out.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t[:1], 1)
    elif rank == 1:
        dist.recv(t, 0)
        dist.send(t[:1], 0)
    return min(out), time.perf_counter() - t0


@needs_root
def test_netem_shapes_real_links_and_cleans_up():
    import subprocess

    from thinwire.launcher.netem import Emulation
    with Emulation(2) as em:
        assert em.netem_qdisc is False or em.netem_qdisc is True
        prefix = em.prefix
        assert sum(prefix in ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines()) == 2
        em.configure("custom:bandwidth=20mbit,latency=20ms")
        pool = em.pool(2)
        try:
            rtt, bulk = pool.run(_timings, 1_000_000)[0]
            em.configure("lan")
            rtt_lan, _ = pool.run(_timings, 1_000_000)[0]
        finally:
            pool.close()
    assert 0.038 < rtt < 0.2          # 2 × 20 ms one-way, through the forwarder
    assert rtt_lan < 0.02
    assert bulk > 0.35                 # 1 MB at 20 Mbit/s is 0.4 s by tbf (+ one round trip)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left
    assert f"twb{prefix[2:]}" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def emulated_vs_real():
    """bsp and dts on `wan`, 4 workers, in the same namespaces: once with the Transport's in-process emulation
    over an unshaped link, once on the real shaped link with no in-process emulation."""
    from thinwire.compare.matrix import _PoolView
    from thinwire.launcher.netem import Emulation
    from thinwire.run.train import TrainConfig, run_training
    out = {}
    with Emulation(4) as em:
        pool = em.pool(4)
        try:
            for mode in ("emulated", "real"):
                em.configure("lan" if mode == "emulated" else "wan")
                view = _PoolView(pool, 300, netem=mode == "real")
                for algo in ("bsp", "dts"):
                    cfg = TrainConfig(workload="digits-mlp", algorithm=algo, workers=4, steps=6, eval_every=6,
                                      network="wan" if mode == "emulated" else "lan", progress=False)
                    out[mode, algo] = run_training(cfg, pool=view)
        finally:
            pool.close()
    return out


@needs_root
@pytest.mark.slow
def test_real_network_mode_trains_the_same(emulated_vs_real):
    for algo in ("bsp", "dts"):
        e, r = emulated_vs_real["emulated", algo], emulated_vs_real["real", algo]
        assert r["final_accuracy"] == pytest.approx(e["final_accuracy"], abs=1e-9)  # same computation
        assert r["bytes_sent_per_worker"] == e["bytes_sent_per_worker"]
        assert r["emulated_comm_s"] == 0 < e["emulated_comm_s"]  # the real link, not the model, delays it
    real_bsp = emulated_vs_real["real", "bsp"]
    assert real_bsp["train_s"] / real_bsp["steps"] > 6 * 0.05  # a ring all-reduce: >= 2(n-1) one-way latencies


# How close the emulator's step time comes to the real shaped link's is a measurement, not a test (issue 19):
# `thinwire compare ... --netem` against the same command without it; BENCHMARKS.md has the command and result.


def test_the_plots_take_the_metric_from_a_cell_that_ran():
    # the learning-curve plots read the first cell's metric: a failed first cell has none, so a loss race's
    # curves were labelled "test accuracy"
    from thinwire.compare import plots
    assert plots._metric({"cells": [{"status": "error"}, {"metric": "loss"}]}) == "loss"
    assert plots._metric({"cells": [{"status": "error"}]}) == "accuracy"


def test_a_race_where_nothing_was_sent_is_plotted_on_a_linear_axis(tmp_path):
    # one worker sends no bytes: every point of "accuracy vs bytes" is at 0, which a log axis cannot show
    # ("Data cannot be log-scaled"), so `compare --workers 1` failed on any device
    import matplotlib.image
    from thinwire.compare import plots
    cell = {"label": "bsp", "network": "lan", "status": "ok", "metric": "accuracy", "target": 0.9,
            "curve": [[0.0, 0, 0.1], [1.0, 0, 0.5], [2.0, 0, 0.9]]}
    sent = {**cell, "label": "dts", "network": "wan", "curve": [[0.0, 0, 0.1], [1.0, 5e5, 0.6], [2.0, 1e6, 0.9]]}
    for cells, nets in (([cell], ["lan"]), ([cell, sent], ["lan", "wan"])):
        res = {"matrix": {"networks": nets, "workload": "digits-mlp", "workers": 1}, "cells": cells}
        out = tmp_path / "-".join(nets)
        out.mkdir()
        files = plots.plot_all(res, str(out))
        assert files["accuracy vs bytes sent"] == "accuracy_vs_bytes.png"
        assert matplotlib.image.imread(out / "accuracy_vs_bytes.png").shape[0] > 100


def test_model_averaging_needs_more_steps_the_longer_its_period():
    """The planner's steps to target for model averaging every H steps grow with H (log-linear, at most the
    reference's): every step it averages like bsp or better, and from H = 128 it nears independent workers."""
    from thinwire.compare.matrix import SYNC_STEPS, averaging_steps
    factors = [averaging_steps(h) for h in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1 << 20)]
    assert factors == sorted(factors) and factors[-1] == 1.0
    assert averaging_steps(1) < SYNC_STEPS < averaging_steps(16) and 0.85 < averaging_steps(128) <= 1.0


def test_a_predicted_winner_within_noise_is_a_tie():
    from thinwire.compare import report
    rows = [{"label": label, "network": "dc", "seed": 0, "status": "ok", "metric": "accuracy", "time_to_target_s": t,
             "time_to_target_resolution_s": 0.02 * t, "best_accuracy": 0.9, "cell": {}}
            for label, t in (("postlocal", 16.6), ("localsgd", 16.7), ("bsp", 23.6))]
    entries = results.aggregate(rows, ["dc"])
    cells = {"localsgd": {"time_to_target_s": 13.3}, "bsp": {"time_to_target_s": 16.7}}
    for guess, says in (("localsgd", "a tie (`localsgd` took 16.7 s"), ("bsp", "disagreed."),
                        ("postlocal", "**agreed**.")):
        res = {"predictions": {"dc": {"winner": guess, "cells": {**cells, "postlocal": {"time_to_target_s": 13.3}}}}}
        assert says in report.prediction(res, "dc", entries)


def test_a_tie_in_the_model_names_each_tied_cell_the_predicted_winner():
    """Two cells the planner times alike (synchronous and dynamic DiLoCo at equal speeds) are both the predicted
    winner: the measured winner agrees if it is either of them, and only then."""
    from thinwire.compare import report
    rows = [{"label": label, "network": "dc", "seed": 0, "status": "ok", "metric": "accuracy", "time_to_target_s": t,
             "time_to_target_resolution_s": 0.02 * t, "best_accuracy": 0.9, "cell": {}}
            for label, t in (("dynamic", 16.0), ("sync", 19.0), ("async", 30.0))]
    entries = results.aggregate(rows, ["dc"])
    cells = {"sync": {"time_to_target_s": 13.0}, "dynamic": {"time_to_target_s": 13.0},
             "async": {"time_to_target_s": 20.0}}
    for tied, says in ((["dynamic"], "tied in the model with `dynamic`); measured winner `dynamic` (16 s): **agreed**"),
                       ([], "disagreed.")):
        res = {"predictions": {"dc": {"winner": "sync", "tied": tied, "cells": cells}}}
        assert says in report.prediction(res, "dc", entries)


def test_asynchronous_diloco_is_planned_at_its_own_period_and_charged_its_staleness_in_steps():
    """A cell that names `async-diloco` alone is predicted at the algorithm's own period (not as a sync every step),
    and its steps to target are more than the no-communication reference's (ASYNC_STEPS), where synchronous
    DiLoCo's are fewer."""
    from thinwire.compare import forecast
    cfg = cmp.CompareConfig(workload="stdlib-lm", workers=4, networks=["world"], cells=["async-diloco", "diloco"])
    cells = [presets.parse_cell(c) for c in cfg.cells]
    tuned = {(c.label, "world", None): forecast.tune_cell(c, "world", cfg.workload, cfg.workers, 0.12) for c in cells}
    out = forecast.predict_race(tuned, cells, cfg, {"steps_to_target": 150, "step_time_s": 0.12})["world"]["cells"]
    assert out["async-diloco"]["period"] == 50 and out["async-diloco"]["steps"] == pytest.approx(150 * 1.34)
    assert forecast.ASYNC_STEPS > 1 > out["diloco"]["steps"] / 150


def test_warm_up_steps_are_planned_at_bsps_step():
    """1-bit Adam's warm-up (Tang et al. 2021: full-precision Adam for `warmup` steps) and 0/1 Adam's variance steps
    all-reduce the full-precision gradient: the race's forecast times them as bsp's step (on `world`, over twice the
    compressed one), the other steps at the algorithm's own."""
    from thinwire.compare import forecast
    cfg = cmp.CompareConfig(workload="stdlib-lm", workers=4, networks=["world"],
                            cells=["bsp", "onebit-adam", "onebit-adam:warmup=20"])
    cells = [presets.parse_cell(c) for c in cfg.cells]
    tuned = {(c.label, "world", None): forecast.tune_cell(c, "world", cfg.workload, cfg.workers, 0.12) for c in cells}
    out = forecast.predict_race(tuned, cells, cfg, {"steps_to_target": 150, "step_time_s": 0.12})["world"]["cells"]
    bsp, own = out["bsp"]["step_s"], forecast.predict_cell(cells[2], "world", cfg, 0.12)["step_s"]
    assert bsp > 2 * own
    steps = out["onebit-adam"]["steps"]
    assert out["onebit-adam"]["step_s"] == pytest.approx((100 * bsp + (steps - 100) * own) / steps)
    assert out["onebit-adam:warmup=20"]["step_s"] == pytest.approx((20 * bsp + (steps - 20) * own) / steps)
    assert forecast.mean_step(out["bsp"], cells[0], 50) == bsp


@pytest.mark.parametrize("kappa, freeze", [(16, 100000), (4, 100000), (3, 40), (1, 7)])
def test_zeroone_adams_variance_steps_counted_as_it_takes_them(kappa, freeze):
    """0/1 Adam's full-precision steps over the first S steps (`full_precision_steps`, which the forecast reads)
    are the steps its own policy takes as variance steps (Lu et al. 2022, arXiv 2202.06009, T_v)."""
    from thinwire.algorithms.zeroone_adam import ZeroOneAdam
    algo = ZeroOneAdam.__new__(ZeroOneAdam)
    algo.var_freeze_step, algo.var_update_scaler, algo.local_step_scaler, algo.local_step_clipper = freeze, kappa, 8, 4
    algo.var_interval, algo.var_counter, algo.local_interval, algo.local_counter, algo.steps = 1, 0, 1, 0, 0
    taken = []
    for _ in range(300):
        v = algo.variance_step()
        taken.append(v)
        algo._advance(v)
    params = {"var_update_scaler": kappa, "var_freeze_step": freeze}
    assert [ZeroOneAdam.full_precision_steps(params, n) for n in range(301)] == \
        [sum(taken[:n]) for n in range(301)]


def test_scalability_under_speeds_reads_the_median_reference_uncorrected():
    """Workers of different speeds: the calibration runs once read 2.6× slower before the reference than before a
    cell whose throughput was 4 % under the reference's; no load correction is made there, and the cell is read
    against the reference's median over its seeds."""
    runs = [{"seed": s, "throughput_samples_s": t, "step_time_s": 0.15, "calibration_step_s": c,
             "calibration_mean_step_s": c} for s, t, c in ((0, 158.0, 0.459), (1, 130.0, 0.275), (2, 184.0, 0.243))]
    row = {"status": "ok", "seed": 0, "network": "world, speeds one-half", "speeds": "one-half", "label": "diloco",
           "steps": 220, "throughput_samples_s": 152.0, "train_s": 40.0, "quiet_step_s": 0.13,
           "calibration_step_s": 0.18, "calibration_mean_step_s": 0.177,
           "nominal_bytes_per_worker_per_step": 1.0, "bytes_sent_per_worker_per_step": 0.03,
           "cell": {"algorithm": "diloco", "compressor": None, "memory": None, "params": {}, "optimizer": None}}
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=4, networks=["world"], cells=["diloco"])
    cmp._derive(row, {"runs": runs, "throughput_samples_s": 158.0}, cfg)
    assert "load_drift" not in row and row["scalability"] == pytest.approx(152.0 / 158.0)
    assert row["compute_basis"] == "the calibration run before it"
