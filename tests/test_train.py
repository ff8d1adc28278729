"""`thinwire train` end to end: bsp reaches the target, bytes match the model size, wan costs what α-β says."""
from __future__ import annotations

import statistics

import pytest

from thinwire.net import parse_network, ring_allreduce
from thinwire.run.train import TrainConfig, run_training, train_worker
from thinwire.run.workloads import get


def test_bsp_reaches_target_and_counts_allreduce_bytes(pool4):
    cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, network="lan", epochs=5, progress=False)
    results = pool4.run(train_worker, cfg)
    from thinwire.run.train import summarize
    s, rows = summarize(cfg, results, wall_s=0.0)
    assert s["final_accuracy"] >= get("digits-mlp").target
    assert s["time_to_target_s"] is not None
    n_params = get("digits-mlp").num_params()
    per_step = ring_allreduce(parse_network("lan"), 4, 4 * n_params).sent
    assert s["bytes_sent_per_worker"] == pytest.approx(per_step * s["steps"])
    assert s["nominal_bytes_per_worker"] == pytest.approx(s["bytes_sent_per_worker"])
    assert len(rows) == s["steps"] and all(r["bytes_sent"] == pytest.approx(per_step) for r in rows)
    # every worker holds the same model under bsp: the same accuracy everywhere
    assert len({r["final"] for r in results}) == 1


def test_wan_step_time_rises_by_the_ring_allreduce_cost(pool4):
    steps = 12
    cfg = dict(workload="digits-mlp", algorithm="bsp", workers=4, steps=steps, progress=False)
    lan = pool4.run(train_worker, TrainConfig(network="lan", **cfg))
    wan = pool4.run(train_worker, TrainConfig(network="wan", **cfg))
    med = lambda res: statistics.median(max(r["steps"][i]["step_s"] for r in res) for i in range(1, steps))
    rise = med(wan) - med(lan)
    # gloo's ring: 2(n-1) steps, each starting with a round trip (Link.handshaking), + 2(n-1)/n N β
    predicted = ring_allreduce(parse_network("wan").handshaking(), 4, 4 * get("digits-mlp").num_params()).time
    assert rise == pytest.approx(predicted, rel=0.25), (rise, predicted)


def test_run_training_writes_outputs(tmp_path):
    from thinwire.run.launcher import Pool
    import json
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=20, progress=False, trace=True)
    with Pool(2) as pool:
        s = run_training(cfg, out=str(tmp_path), pool=pool)
    wl = get("linreg")
    assert s["metric"] == "loss" and s["final_loss"] < 0.2 * wl.evaluate(wl.model(0))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 20 and "loss" in json.loads(lines[0])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 20
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
