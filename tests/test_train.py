"""`thinwire train` end to end: bsp reaches the target, bytes match the model size, wan costs what α-β says."""
from __future__ import annotations

import math
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
    from thinwire.launcher.pool import Pool
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


# -- the one loop: every stepper, the race's schedule and agreement, TensorBoard --------------------------------
def test_race_schedule_evaluates_every_two_percent_of_the_clock_and_lands_on_the_budget():
    """In one process (no agreement needed): with a constant step time τ the gap after an evaluation at clock t is
    max(1, ⌊0.02 t / τ⌋) steps, so a reading is at most 2 % (+ one step) late; the gap never runs past the step
    where the budget is spent, and the stop comes at the first evaluation whose clock reached the budget."""
    from thinwire.run.schedule import EVAL_PRECISION, Schedule
    wl = get("digits-mlp")
    tau, budget = 0.01, 30.0
    cfg = TrainConfig(workload="digits-mlp", budget_s=budget, stop_at_target=True, target=2.0)  # never reached
    s = Schedule(cfg, wl, total=None, workers=1)
    assert s.evaluated(0, 0.1, 0.0)[0] is None and s.next == 1
    step, evals = 0, []
    while True:
        step = s.next
        stop, agreed = s.evaluated(step, 0.1, step * tau)
        evals.append((step, agreed["agreed_t"]))
        if stop:
            break
    assert stop == "budget" and evals[-2][1] < budget <= evals[-1][1] <= budget + tau + 1e-9
    evals = [(0, 0.0)] + evals
    for (sp, tp), (s0, t0), (s1, _) in zip(evals, evals[1:-2], evals[2:-1]):
        step_time = (t0 - tp) / (s0 - sp)   # the mean step time since the previous evaluation, as the loop sees it
        assert s1 - s0 == max(1, math.floor(EVAL_PRECISION * t0 / step_time)) or s1 * tau >= budget - 1e-9
        assert (s1 - s0) * tau <= max(tau, EVAL_PRECISION * t0) * (1 + 1e-9)   # the reading's error bound
    assert len(evals) < 500   # not every step: 3000 steps in all
    # an evaluation that costs 10 steps' time comes at most every 40 steps: a quarter of the training time at most
    from thinwire.run.schedule import EVAL_OVERHEAD
    s = Schedule(cfg, wl, total=None, workers=1)
    s.evaluated(0, 0.1, 0.0, eval_s=10 * tau)
    s.evaluated(1, 0.1, tau, eval_s=10 * tau)
    assert s.next - 1 == math.ceil(10 / EVAL_OVERHEAD - 1e-9)
    # a metric on its way to the target: evaluations close in on the crossing (few of them), read within 2 %
    s = Schedule(TrainConfig(workload="digits-mlp", stop_at_target=True, target=0.9), wl, total=None, workers=1)
    s.evaluated(0, 0.0, 0.0, eval_s=10 * tau)
    seen = []
    while True:
        step = s.next
        seen.append(step)
        if s.evaluated(step, 0.001 * step, step * tau, eval_s=10 * tau)[0] == "target":
            break
    assert 900 <= step <= 900 * (1 + EVAL_PRECISION) + 1 and len(seen) < 60
    # a metric that drops in a jump (a local-update method's models land at an average) from a plateau 17/18 of the
    # way to the target, an evaluation costing 300 steps: past 9/10 of the way evaluations come every 5 % at most
    from thinwire.run.schedule import RESOLUTION
    s = Schedule(TrainConfig(workload="digits-mlp", stop_at_target=True, target=0.9), wl, total=None, workers=1)
    s.evaluated(0, 0.0, 0.0, eval_s=300 * tau)
    while True:
        step = s.next
        value = 0.95 if step >= 1000 else min(0.85, 0.004 * step)
        if s.evaluated(step, value, step * tau, eval_s=300 * tau)[0] == "target":   # (before: read at step 1452)
            break
    assert 1000 <= step <= 1000 * (1 + RESOLUTION) + 1, step
    # the target stops it at the first evaluation that reaches it; step 0 never does
    s = Schedule(TrainConfig(workload="digits-mlp", stop_at_target=True, target=0.5), wl, total=100, workers=1)
    assert s.evaluated(0, 0.9, 0.0)[0] is None
    assert s.evaluated(1, 0.4, 0.01)[0] is None and s.evaluated(2, 0.6, 0.02)[0] == "target"
    # without a race: every eval_every steps and the last, no agreement
    s = Schedule(TrainConfig(workload="digits-mlp", eval_every=5), wl, total=12, workers=1)
    assert [k for k in range(1, 13) if s.due(k)] == [5, 10, 12]


def _stopping(rank, world_size, cfg):
    """train_worker, recording the steps it reported to the launcher's watchdog."""
    from thinwire.run import loop
    seen, orig = [], loop.report_progress
    loop.report_progress = lambda step=None: (seen.append(step), orig(step))
    try:
        out = train_worker(rank, world_size, cfg)
    finally:
        loop.report_progress = orig
    out["reported"] = seen
    return out


def test_the_stop_is_decided_alike_on_every_rank_from_the_mean_metric(pool2):
    """Local SGD with a long period: the ranks' models (and metrics) differ, yet both stop at the same evaluation,
    the first whose mean over the ranks reached the target; summarize reads the time to target there."""
    from thinwire.run.train import summarize
    cfg = TrainConfig(workload="digits-mlp", algorithm="localsgd", workers=2, epochs=4, target=0.85,
                      stop_at_target=True, params={"period": 50}, progress=False).validate()
    out = pool2.run(_stopping, cfg)
    assert [o["stopped"] for o in out] == ["target", "target"]
    assert len(out[0]["steps"]) == len(out[1]["steps"]) < cfg.total_steps(get("digits-mlp"))
    assert [e["agreed"] for e in out[0]["evals"]] == [e["agreed"] for e in out[1]["evals"]]
    assert any(a["value"] != b["value"] for a, b in zip(out[0]["evals"], out[1]["evals"]))  # the ranks do differ
    agreed = [e["agreed"] for e in out[0]["evals"][1:]]
    assert agreed[-1] >= 0.85 > max(agreed[:-1])
    for e in out[0]["evals"]:
        assert e["agreed"] == pytest.approx(statistics.fmean([e["value"], next(
            x for x in out[1]["evals"] if x["step"] == e["step"])["value"]]))
    s, _ = summarize(cfg, out, 0.0)
    assert s["stop_reason"] == "target" and s["time_to_target_s"] == out[0]["evals"][-1]["agreed_t"]
    assert out[0]["reported"] == list(range(1, len(out[0]["steps"]) + 1))


def test_peers_run_the_same_loop(pool2):
    """PyTorch's DDP peers (and torchft's DiLoCo where installed) run the one loop: same records, progress reports,
    the race's stop, and the same trajectory as thinwire's bsp for plain DDP."""
    from thinwire.compare.peers import find, resolve
    from thinwire.run.train import summarize
    base = dict(workload="digits-mlp", workers=2, steps=60, target=0.8, stop_at_target=True, progress=False,
                eval_every=1)  # every step: the stop is at the first step on target, whatever the timing
    got = {}
    names = ["bsp", "ddp", "ddp-hierarchical"] + ([] if find("torchft-diloco").missing() else ["torchft-diloco"])
    for name in names:
        params = {"period": 4, "local_period": 2, "group": 1, "warmup": 2} if name == "ddp-hierarchical" else \
            {"period": 4} if name == "torchft-diloco" else {}
        cfg = resolve(TrainConfig(algorithm=name, params=params, **base)).validate()
        out = pool2.run(_stopping, cfg)
        got[name] = (summarize(cfg, out, 0.0)[0], out)
        assert [o["stopped"] for o in out] == ["target"] * 2, name
        assert out[0]["reported"] == list(range(1, len(out[0]["steps"]) + 1)), name
    s_bsp, s_ddp = got["bsp"][0], got["ddp"][0]
    assert s_ddp["steps_to_target"] == s_bsp["steps_to_target"]
    assert s_ddp["bytes_sent_per_worker"] == pytest.approx(s_bsp["bytes_sent_per_worker"])
    nominal = s_bsp["nominal_bytes_per_worker_per_step"]
    s = got["ddp-hierarchical"][0]
    assert s["bytes_sent_per_worker_per_step"] < nominal
    assert "HierarchicalModelAverager" in s["algorithm_metrics"]["peer"]
    if "torchft-diloco" in got:
        s = got["torchft-diloco"][0]
        syncs = s["steps"] // 4
        # one bucket of the whole model every 4 steps, counted as the ring all-reduce the Transport counts
        assert s["bytes_sent_per_worker"] == pytest.approx(syncs * nominal)
        assert s["algorithm_metrics"]["syncs"] == syncs


def test_peer_configurations_are_checked_before_launch():
    from thinwire.compare.peers import resolve
    from thinwire.errors import UserError
    base = dict(workload="digits-mlp", workers=2, steps=4, progress=False)
    peer = lambda **kw: resolve(TrainConfig(**kw, **base))
    with pytest.raises(UserError, match="takes period, warmup, not rank"):
        peer(algorithm="ddp-postlocalsgd", params={"rank": 2}).validate()
    with pytest.raises(UserError, match="checkpoints are written by thinwire"):
        peer(algorithm="ddp-fp16", checkpoint_every=2, checkpoint_dir="/tmp").validate()
    # plain DDP checkpoints (model and optimizer): torchrun's stop-the-world restart, `thinwire bench churn`
    peer(algorithm="ddp", checkpoint_every=2, checkpoint_dir="/tmp").validate()
    with pytest.raises(UserError, match="takes no thinwire --compressor"):
        peer(algorithm="ddp", compressor="topk").validate()
    with pytest.raises(UserError, match="group .3. must divide"):
        peer(algorithm="ddp-hierarchical", params={"group": 3}).validate()


def test_a_race_refuses_on_failure_continue():
    """The race's stop is agreed over every worker rank: surviving a lost worker is for fixed-length runs."""
    from thinwire.errors import UserError
    base = dict(workload="digits-mlp", workers=2, steps=4, progress=False, on_failure="continue")
    for race in ({"budget_s": 10.0}, {"stop_at_target": True}):
        with pytest.raises(UserError, match="--on-failure continue trains a fixed number of steps"):
            TrainConfig(algorithm="bsp", **race, **base).validate()
    from thinwire.compare.peers import resolve
    with pytest.raises(UserError, match="is a peer: --on-failure stop only"):
        resolve(TrainConfig(algorithm="ddp", **base)).validate()


def test_torchft_missing_is_one_line_naming_the_extra(monkeypatch):
    from thinwire.errors import UserError
    from thinwire.compare import presets
    from thinwire.compare.peers import registry, resolve
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"thinwire\[peers\]"):
        resolve(TrainConfig(workload="digits-mlp", algorithm="torchft-diloco", workers=2, steps=4)).validate()
    cells, notes = presets.resolve(["bsp", "torchft-diloco"], strict=False)
    assert [c.label for c in cells] == ["bsp"] and any("thinwire[peers]" in n for n in notes)


def test_tensorboard_scalars(pool2, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = str(tmp_path / "tb")
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=12, eval_every=4, progress=False,
                      network="custom:latency=1ms", tensorboard=board)
    s = run_training(cfg, pool=pool2)
    acc = EventAccumulator(board)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "comm/bytes_sent", "comm/exposed_s", "comm/emulated_s", "eval/loss"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 4, 8, 12]
    assert acc.Scalars("eval/loss")[-1].value == pytest.approx(s["final_loss"], rel=1e-6)  # bsp: ranks agree
    assert all(e.value > 0 for e in acc.Scalars("comm/bytes_sent"))


def test_tensorboard_without_the_extra_is_one_line(monkeypatch):
    import importlib.util

    from thinwire.errors import UserError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(UserError, match=r"thinwire\[tensorboard\]"):
        TrainConfig(workload="linreg", tensorboard="/tmp/tb").validate()


def test_a_drain_after_the_race_stopped_is_on_the_clock_but_not_in_the_throughput():
    """A sync in flight when a race stops is waited out on the training clock (`train_s`), kept apart as `drain_s`;
    the throughput a scalability reading compares and the exposed time within steps leave it out."""
    from thinwire.run.train import summarize
    cfg = TrainConfig(workload="digits-mlp", workers=2, steps=4, batch_size=8)

    def worker(rank, waits, drain):
        steps = [{"step": i + 1, "loss": 1.0, "t": 2.0 * (i + 1), "step_s": 2.0, "bytes_sent": 0.0,
                  "emulated_s": 0.0, "wait_s": w} for i, w in enumerate(waits)]
        return {"role": "worker", "rank": rank, "steps": steps, "evals": [{"step": 4, "t": 8.0, "value": 0.5}],
                "meter": {"total": {"bytes_sent": 0.0, "emulated_s": 0.0, "wait_s": sum(waits) + drain}},
                "train_s": 8.0 + drain, "drain_s": drain, "num_params": 10, "model_sha256": "x", "metrics": {},
                "stopped": "target", "final": 0.5}

    summary, _ = summarize(cfg, [worker(0, [0.0, 0.5, 0.0, 0.1], 2.0), worker(1, [0.0, 0.3, 0.0, 0.1], 1.0)], 0.0)
    assert summary["train_s"] == 10.0 and summary["drain_s"] == pytest.approx(1.5)
    assert summary["throughput_samples_s"] == pytest.approx(4 * 8 * 2 / 8.5)
    assert summary["exposed_in_steps_s"] == pytest.approx(0.5)          # the workers' mean, step by step
    assert summary["exposed_comm_s"] == pytest.approx(0.5 + 1.5)        # everything waited, the drain included


def test_the_nominal_bytes_after_a_loss_count_the_steps_before_it():
    """After a lost worker (--on-failure continue) the uncompressed fp32 reference is the ring all-reduce among the
    workers of each step: two before the loss, the survivor alone after it (the summary said 0.000 MB: it took
    the survivors' count for every step)."""
    from thinwire.run.train import summarize
    cfg = TrainConfig(workload="digits-mlp", workers=2, steps=4, on_failure="continue")
    steps = [{"step": i + 1, "loss": 1.0, "t": i + 1.0, "step_s": 1.0, "bytes_sent": 0.0, "emulated_s": 0.0,
              "wait_s": 0.0} for i in range(4)]
    survivor = {"role": "worker", "rank": 0, "steps": steps, "evals": [{"step": 4, "t": 4.0, "value": 0.5}],
                "meter": {"total": {"bytes_sent": 0.0, "emulated_s": 0.0, "wait_s": 0.0}}, "train_s": 4.0,
                "num_params": 1000, "model_sha256": "x", "final": 0.5, "stopped": "steps",
                "metrics": {"failures": [{"lost": [1], "step": 2, "members": [0], "kept": False}],
                            "participants": [[1, 2, 2], [3, 4, 1]]}}
    s, _ = summarize(cfg, [survivor, None], 0.0)
    two = ring_allreduce(parse_network("lan"), 2, 4000).sent
    assert s["nominal_bytes_per_worker"] == pytest.approx(2 * two) and two > 0
    assert s["nominal_bytes_per_worker_per_step"] == pytest.approx(2 * two / 4)
    from thinwire.cli.train import format_summary
    assert f"uncompressed fp32 would be {2 * two / 1e6:.3f} MB" in format_summary(s)
    assert "ranks per sync    2 in steps 1-2, 1 in steps 3-4" in format_summary(s)
