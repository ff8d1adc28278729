"""Emulated worker speeds (`thinwire.speeds`) and the race of workers at their own pace (`thinwire.run.schedule`):
profiles parsed and refused, the wait a slow worker takes, and races whose workers take different numbers of steps."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from thinwire import speeds
from thinwire.errors import UserError


def test_profiles_name_each_workers_speed():
    assert speeds.parse(None) is None and speeds.parse("equal") is None and speeds.parse(" ") is None
    assert speeds.parse("1,1,1,0.5").factors(4) == [1, 1, 1, 0.5]
    assert speeds.parse("one-half").factors(4) == [1, 1, 1, 0.5]
    assert speeds.parse("two-speeds").factors(4) == pytest.approx([1 / 3, 1 / 3, 1, 1])
    assert speeds.parse("2:1").factors(2) == [1, 0.5]
    change = speeds.parse("equal@30>one-half")
    assert change.factors(2, at_s=29.9) == [1, 1] and change.factors(2, at_s=30) == [1, 0.5]
    # stragglers: q = pL/(1 + pL) of the steps at the factor; times per step add up
    q = 0.2 / 1.2
    assert speeds.parse("stragglers").mean_factors(2) == pytest.approx([1 / ((1 - q) + q / 0.25)] * 2)
    assert speeds.parse("stragglers:p=0,factor=0.5,steps=3").mean_factors(3) == [1, 1, 1]


@pytest.mark.parametrize("spec, needle", [
    ("1,1,1,2", "every factor must be in (0, 1]"),
    ("1,0", "every factor must be in (0, 1]"),
    ("1,x", "is not a number"),
    ("1,nan", "must be finite"),
    ("fast", "unknown --speeds profile 'fast'"),
    ("0:1", "both speeds of A:B must be positive"),
    ("stragglers:p=2", "p must be in [0, 1]"),
    ("stragglers:factor=0", "factor must be in (0, 1]"),
    ("stragglers:steps=1.5", "steps must be a whole number"),
    ("stragglers:q=1", "stragglers take p=, factor=, steps="),
    ("one-half>equal", "write SPEC@SECONDS>SPEC"),
    ("equal@30>one-half@20>equal", "change times must increase"),
    ("1,0.5", "gives 2 factors for 4 workers"),
])
def test_a_bad_profile_is_refused_in_one_line_before_any_worker_starts(spec, needle, capsys):
    from thinwire.cli import main
    assert main(["train", "--workload", "linreg", "--workers", "4", "--steps", "5", "--speeds", spec]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


class _Sleep(torch.autograd.Function):
    """A layer whose forward and backward take a fixed time: compute that load on the machine cannot stretch."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(0.01)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.01)
        return g


def test_a_worker_at_half_speed_takes_twice_the_training_time_per_step():
    """The wait before each backward is (1/s − 1) × (this forward + the last backward): at s = 0.5, a step's
    training time (forward, wait, backward) is twice its compute (±5 %), and the wait lies before the backward."""
    model = torch.nn.Linear(4, 1)
    slow = speeds.Slowdown(speeds.parse("1,0.5"), rank=1, workers=2).install(model)
    order, steps = [], []
    model.weight.register_hook(lambda g: order.append(("grad", slow.waited_s)))
    x = torch.randn(8, 4)
    for i in range(21):
        t0, w0 = time.perf_counter(), slow.waited_s
        _Sleep.apply(model(x)).sum().backward()
        steps.append((time.perf_counter() - t0, slow.waited_s - w0))
    total = sum(t for t, _ in steps[1:])      # the first step has no last backward
    waited = sum(w for _, w in steps[1:])
    assert 1.9 <= total / (total - waited) <= 2.1, (total, waited)
    assert order[-1][1] > 0 and slow.steps == 21
    fast = speeds.Slowdown(speeds.parse("1,0.5"), rank=0, workers=2).install(model)
    _Sleep.apply(model(x)).sum().backward()
    assert fast.waited_s == 0.0
    slow.remove(), fast.remove()


def _race(rank, world, **kw):
    from thinwire.run.train import TrainConfig, train_worker
    return train_worker(rank, world, TrainConfig(**kw).validate())


def test_workers_at_their_own_pace_meet_on_the_clock(pool2, tmp_path):
    """`local` in a race: no worker waits for the other's evaluations. The worker at half speed takes fewer steps
    in the same training time, is the only one that waited, and the race's curve is the mean of every worker's
    latest evaluation in the order of their clocks, up to the budget."""
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", workers=2, algorithm="local", speeds="1,0.5", budget_s=1.5,
                      target=1.0, progress=False)
    s = run_training(cfg, str(tmp_path), pool=pool2)
    fast, slow = s["steps_per_worker"]
    assert s["stop_reason"] == "budget" and slow < 0.8 * fast, s["steps_per_worker"]
    assert s["slowed_s"] > 0 and s["speeds"] == "1,0.5"
    assert s["time_to_target_s"] is None and s["train_s"] >= 1.5


def test_race_curve_and_crossing_follow_the_clocks():
    from thinwire.run.schedule import race_crossing, race_curve
    a = [{"t": 0.0, "value": 0.1, "step": 0}, {"t": 1.0, "value": 0.6, "step": 10}, {"t": 3.0, "value": 0.9, "step": 30}]
    b = [{"t": 0.1, "value": 0.1, "step": 0}, {"t": 2.0, "value": 0.8, "step": 10}]
    curve = race_curve([a, b])
    assert [(p["t"], p["value"], p["step"]) for p in curve] == [
        (0.1, 0.1, 0), (1.0, pytest.approx(0.35), 5), (2.0, pytest.approx(0.7), 10), (3.0, pytest.approx(0.85), 20)]
    hit, resolution = race_crossing(curve, lambda v: v >= 0.7)
    assert hit["t"] == 2.0 and resolution == 1.0
    assert race_crossing(curve, lambda v: v >= 0.95) == (None, None)


def test_compare_races_each_speeds_profile_against_its_own_reference(pool2, tmp_path):
    from thinwire.compare import matrix as cmp
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan"], cells=["bsp"], budget_s=0.6,
                            target=1.0, speeds=[None, "1,0.5"])
    res = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    assert set(res["baselines"]) == {"equal", "1,0.5"} and res["baseline"] is res["baselines"]["equal"]
    assert res["baselines"]["1,0.5"]["runs"][0]["config"]["speeds"] == "1,0.5"
    by = {r["network"]: r for r in res["cells"]}
    assert set(by) == {"lan", "lan, speeds 1,0.5"} and by["lan, speeds 1,0.5"]["link"] == "lan"
    assert by["lan, speeds 1,0.5"]["config"]["speeds"] == "1,0.5" and by["lan, speeds 1,0.5"]["slowed_s"] > 0
    assert by["lan"]["slowed_s"] == 0 and all(r["status"] == "ok" for r in res["cells"])
    report = open(tmp_path / "report.md").read()
    assert "## `lan` (loopback, no emulation), worker speeds `1,0.5`" in report
    assert "reference (`local`, the same workers, data and process layout, worker speeds `1,0.5`)" in report


def test_compare_refuses_a_bad_speeds_profile_in_one_line(capsys):
    from thinwire.cli import main
    assert main(["compare", "--algorithms", "bsp", "--workers", "2", "--speeds", "equal;1,2"]) == 2
    err = capsys.readouterr().err
    assert "every factor must be in (0, 1]" in err and len(err.strip().splitlines()) == 1, err


def test_dynamic_rounds_outside_a_race_end_together(pool2, tmp_path):
    """`--steps N` under dynamic local updates at fixed speeds 1 : 0.5 (H_i = 4, 2): the first worker to reach N
    asks to stop, its flag travels in the next merge's gather and is read at the one after, and every worker ends
    at that merge — the fast one past N, the slow one short of it — instead of waiting for a merge that never
    comes."""
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="linreg", workers=2, algorithm="diloco", params={"period": 4, "rates": "1,0.5"},
                      steps=20, progress=False)
    s = run_training(cfg, str(tmp_path), pool=pool2)
    assert s["steps_per_worker"] == [28, 14] and s["stop_reason"] == "steps"
    assert s["algorithm_metrics"]["round_periods"] == [[4, 2]] * 7


def test_measured_dynamic_rounds_plan_the_first_round_early(pool2, tmp_path):
    """`dynamic=true` with measured speeds, one worker at a quarter speed, across real workers: the first round is
    re-planned from the speeds read from step H/4 on (without it, it would run at equal H, the fast worker waiting
    out 3/4 of it), and no worker's H_i ends before its first sync could start after that read. What H_i come to
    depends on the clock: the suite's load once read 26 of 32 where 9 was planned on a quiet machine, and once
    made the fast worker's first steps (a millisecond each) the slower ones ([27, 32]); the plan from given speeds
    is checked on its own below."""
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", workers=2, algorithm="diloco", params={"period": 32, "dynamic": True},
                      speeds="1,0.25", steps=64, progress=False)
    s = run_training(cfg, str(tmp_path), pool=pool2)
    first = s["algorithm_metrics"]["round_periods"][0]
    assert max(first) == 32 and 2 * 4 < min(first) < 32, first     # probe at step 4, read from 8 on: re-planned, > 8


class _Pair:
    """Rank `rank` of two workers whose peer reports `peer` steps per second: an all-gather answered at once."""
    world_size, device = 2, torch.device("cpu")

    def __init__(self, rank: int, peer: float):
        self.rank, self.peer = rank, peer

    def all_gather(self, mine, sizes, async_op):
        other = torch.cat([torch.tensor([self.peer, 0.0], dtype=torch.float64), mine[2:]])   # (reads when I do)
        got = [mine.clone(), other] if self.rank == 0 else [other, mine.clone()]
        return type("Done", (), {"wait": lambda self: got, "is_completed": lambda self: True})()


@pytest.mark.parametrize("rank, step_s, peer, periods", [
    (0, 0.01, 25.0, [32, 9]),       # the fast worker (100 steps/s), its peer at a quarter speed
    (1, 0.04, 100.0, [32, 9]),      # the slow one: the same plan
    (0, 0.01, 50.0, [32, 16]),      # a peer at half speed: H/2, past the read at step 8
])
def test_the_first_round_is_planned_from_the_speeds_read_at_a_quarter_of_it(monkeypatch, rank, step_s, peer,
                                                                              periods):
    """Dynamic local updates (Liu et al. 2024, arXiv 2401.09135, §4.2: H_i = H v_i / max_j v_j) at H = 32: every
    worker sends its steps per second at step H/8 = 4 and reads the others' at step 8, where the first round is
    re-planned; an H_i of at most 8 is raised past the read (its first sync, τ_i = 0 steps before its merge, must
    start after it). On a clock that steps `step_s` per step, so the speeds are exact."""
    from thinwire.algorithms import diloco_dynamic
    now = [0.0]
    monkeypatch.setattr(diloco_dynamic, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    rounds = diloco_dynamic.DynamicRounds(_Pair(rank, peer), period=32, fragments=1, overlap=0)
    assert rounds.probe == 4 and rounds.periods == [32, 32]
    for step in range(1, 9):
        now[0] += step_s
        rounds.stepped(step)
        assert rounds.periods == ([32, 32] if step < 8 else periods), step
    assert rounds.speeds == ([1 / step_s, peer] if rank == 0 else [peer, 1 / step_s])


class _Slow:
    """Rank 0 of two on a link whose small all-gather takes 50 ms ((n − 1) α); its peer, at 25 steps per second,
    reads the first round's speeds by step `peer_reads`; the gather arrives when `arrived` is set."""
    rank, world_size, device = 0, 2, torch.device("cpu")
    collective_link = SimpleNamespace(alpha=0.05)
    arrived, peer_reads = False, 10

    def all_gather(self, mine, sizes, async_op):
        got = [mine.clone(), torch.tensor([25.0, 0.0, self.peer_reads], dtype=torch.float64)]
        return SimpleNamespace(wait=lambda: got, is_completed=lambda: self.arrived)


@pytest.mark.parametrize("arrives, read", [(11, 11), (None, 13)])
def test_the_first_round_is_read_where_the_gather_arrived(monkeypatch, arrives, read):
    """A worker at 100 steps per second sends its speed at step H/8 = 4 with the step by which it reads the others':
    2p = 8 plus the gather's 50 ms in its own steps, 13. It reads them at the first step from 8 on where they
    arrived (11), at the latest at 13; its slow peer's H_j (8 at a quarter speed) is raised past the step the peer
    declared it reads them by (10), so no first sync was missed."""
    from thinwire.algorithms import diloco_dynamic
    now = [0.0]
    monkeypatch.setattr(diloco_dynamic, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    link = _Slow()
    rounds = diloco_dynamic.DynamicRounds(link, period=32, fragments=1, overlap=0)
    for step in range(1, 15):
        now[0] += 0.01
        link.arrived = arrives is not None and step >= arrives
        rounds.stepped(step)
        assert rounds.periods == ([32, 32] if step < read else [32, 11]), step


def _merges(floats: bool, arrives_after: list[int]) -> list[int]:
    """The steps at which worker 0 of two equal ones merges at H = 8, F = 2, τ = 2 (fragment syncs start at
    steps 2, 6, 10, 14 and are planned to merge at 4, 8, 12, 16), sync s arriving `arrives_after[s]` steps after
    its start."""
    from thinwire.algorithms.diloco_dynamic import DynamicRounds
    rounds = DynamicRounds(_Pair(0, 1.0), period=8, fragments=2, overlap=2, rates=[1.0, 1.0])
    rounds.floats = floats
    starts, merged = [], []
    for step in range(1, 17):
        f = rounds.starting(step)
        if f is not None:
            rounds.started(f, step)
            starts.append(step)
        s = len(merged)       # the oldest sync not merged yet
        arrived = s < len(starts) and step >= starts[s] + arrives_after[s]
        if rounds.merge_now(step, arrived) is not None:
            merged.append(step)
        rounds.stepped(step)
    assert starts == [2, 6, 10, 14] and rounds.history == [[8, 8]] * 2
    return merged


def test_a_measured_round_merges_where_its_average_arrived_and_waits_only_where_it_must():
    """With measured speeds and an overlap, a merge is taken on the first step from its planned one where its
    average has arrived (sync 1: planned at 8, arrived at 9), at the latest on the step before the next sync starts
    (sync 2: arrives at 16, forced at 13: the sync of step 14 starts from the merged θ); one that arrived early
    merges as planned (sync 0). With fixed rates (or τ = 0) every merge is at its planned step."""
    arrives_after = [1, 3, 6, 2]
    assert _merges(True, arrives_after) == [4, 9, 13, 16]
    assert _merges(False, arrives_after) == [4, 8, 12, 16]


def _floating(rank, world):
    from test_diloco import _flat, _setup

    from thinwire.run import workloads
    tr, m, loader = _setup(rank, world, "diloco", {"period": 8, "overlap": 3, "alpha": 0.5, "dynamic": True},
                           model="mlp", inner="adamw")
    wl, step = workloads.get("linreg"), 0
    while not tr.finished:
        step += 1
        xb, yb = loader.next()
        wl.loss(m(xb), yb).backward()
        time.sleep(0.004 * (2 if rank == world - 1 else 1))    # the last worker at half speed
        tr.step()
        tr.optimizer.zero_grad()
        if step == 32:
            tr.request_stop()
    tr.close()
    return _flat(m), tr.metrics(), step


def test_merges_taken_late_leave_every_worker_with_the_same_model(pool4):
    """Measured dynamic local updates with τ = 3 across four real workers on `wan` (50 ms one way: an average
    arrives later than τ steps of 4 ms), the last worker at half speed: merges are taken late, after their
    planned step, on the fast workers, yet every worker merges the same averages in the same order, and after
    `close()` every worker holds the same model."""
    res = pool4.run(_floating, network="wan", timeout=120)
    flats, metrics, steps = zip(*res)
    assert all(torch.equal(f, flats[0]) for f in flats[1:])
    assert len({mt["syncs"] for mt in metrics}) == 1 and metrics[0]["late_merges"] > 0
    assert steps[-1] < min(steps[:-1])      # the slow worker took fewer steps


def test_dynamic_rounds_checkpoint_at_a_round_end_and_resume_bitwise(pool2, tmp_path):
    """`--checkpoint-every 8` under dynamic local updates at fixed speeds 1 : 0.5 (H_i = 4, 2): each checkpoint is
    cut at the end of a round, named by the fastest worker's steps (8, 16), each worker at its own step (16 and 8
    at the last one); a run resumed from it ends with the uninterrupted run's model, steps and rounds. In a race,
    where the workers meet on the clock, checkpoints stay refused in one line."""
    import json
    from thinwire.run import checkpoint
    from thinwire.run.train import TrainConfig, run_training
    ck = str(tmp_path / "ck")
    base = dict(workload="linreg", workers=2, algorithm="diloco", params={"period": 4, "rates": "1,0.5"},
                steps=20, progress=False)
    whole = run_training(TrainConfig(**base, checkpoint_every=8, checkpoint_dir=ck), str(tmp_path / "a"), pool=pool2)
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        assert json.load(f)["step"] == 16
    assert [checkpoint.load(ck, r)["own_step"] for r in (0, 1)] == [16, 8]
    resumed = run_training(TrainConfig(**base, resume=ck), str(tmp_path / "b"), pool=pool2)
    assert resumed["model_sha256"] == whole["model_sha256"]
    assert resumed["steps_per_worker"] == whole["steps_per_worker"] == [28, 14]
    assert resumed["algorithm_metrics"]["round_periods"] == whole["algorithm_metrics"]["round_periods"]
    with pytest.raises(UserError, match="in a race"):
        TrainConfig(**{**base, "steps": None}, budget_s=5, checkpoint_every=8, checkpoint_dir=ck).validate()
