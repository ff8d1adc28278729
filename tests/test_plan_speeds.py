"""The planner with workers of different speeds: equal speeds predict exactly as without them, a synchronous
algorithm steps at its slowest worker's pace, dynamic and asynchronous DiLoCo at the sum of the speeds, the
DiLoCo plan picks its variant, and `thinwire advise --speeds`."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from thinwire import speeds
from thinwire.cli import main
from thinwire.net import parse_network
from thinwire.plan.advise import CANDIDATES, advise
from thinwire.plan.costmodel import Scenario, predict, scenario_speeds
from thinwire.plan.diloco import candidates, plan_diloco

SYNC = [("bsp", {}), ("localsgd", {"period": 8}), ("diloco", {"period": 32}), ("ssp", {}), ("dts", {})]


def scenario(network="lan", **kw):
    return Scenario(**{**dict(params=2e6, compute_s=0.1, link=parse_network(network), workers=4, handshake=True),
                       **kw})


@pytest.mark.parametrize("network", ["lan", "wan", "world", "home"])
def test_equal_speeds_predict_exactly_as_without_them(network):
    plain, equal = scenario(network), scenario(network, speeds=(1.0, 1.0, 1.0, 1.0))
    for _, alg, comp, params, _ in CANDIDATES:
        p = dict(params)
        overlap = p.pop("overlap", False)
        assert predict(equal, alg, comp, overlap=overlap, **p) == predict(plain, alg, comp, overlap=overlap, **p)
    assert [a.row() for a in advise(equal)] == [a.row() for a in advise(plain)]
    assert plan_diloco(equal) == plan_diloco(plain)
    assert plan_diloco(equal).variant == "sync" and plan_diloco(equal).algorithm == "diloco"


@pytest.mark.parametrize("algorithm,params", SYNC)
def test_one_worker_at_half_speed_slows_a_synchronous_algorithm_to_its_pace(algorithm, params):
    s = scenario("wan", speeds=(1.0, 1.0, 1.0, 0.5))
    got = predict(s, algorithm, **params)
    slow = predict(s.at_speed(0.5), algorithm, **params)       # every worker at the slow one's pace
    assert got.iteration_s == slow.iteration_s
    assert got.compute_s == pytest.approx(0.1 * 4 / 3.5)       # the reference: each worker at its own speed


def test_half_speed_bsp_keeps_two_of_three_and_a_half_on_a_free_link():
    s = scenario("lan", params=1e3, speeds=(1.0, 1.0, 1.0, 0.5))
    assert predict(s, "bsp").scalability == pytest.approx(2.0 / 3.5, rel=0.01)
    assert predict(s, "local").scalability == pytest.approx(1.0)


@pytest.mark.parametrize("network,h", [("lan", 32), ("world", 256)])   # (world: H where the servers' link is
def test_dynamic_and_asynchronous_diloco_run_at_the_sum_of_the_speeds(network, h):   # not the bound)
    equal, slow = scenario(network), scenario(network, speeds=(1.0, 1.0, 1.0, 0.5))
    for algorithm, params, rel in [("diloco", {"period": h, "dynamic": True}, 1e-12),
                                   ("async-diloco", {"period": h}, 0.05),
                                   ("async-diloco", {"period": h, "quorum": 3}, 0.05)]:
        at_eq, at_slow = predict(equal, algorithm, **params), predict(slow, algorithm, **params)
        # throughput: the sum of the speeds over n of the equal workers' (a mean step n / Σ s_i longer)
        assert at_slow.iteration_s == pytest.approx(at_eq.iteration_s * 4 / 3.5, rel=rel), algorithm
        assert at_slow.scalability == pytest.approx(at_eq.scalability, rel=rel), algorithm
    sync = predict(slow, "diloco", period=h)
    assert sync.scalability < 0.6 < predict(slow, "diloco", period=h, dynamic=True).scalability


def test_the_diloco_plan_picks_the_least_stale_variant_that_keeps_the_speeds():
    s = scenario("world", params=3e6, compute_s=0.12, speeds=(1.0, 1.0, 1.0, 0.5))
    plan = plan_diloco(s)
    assert plan.variant == "dynamic" and plan.params()["dynamic"] is True and plan.scalability >= 0.95
    assert plan.algorithm == "diloco"
    # dynamic cannot run with fragments: given F = 2 the plan goes to the servers (no fragments there) or stays
    # synchronous, and a given `dynamic` is kept
    assert plan_diloco(s, given={"dynamic": True}).variant == "dynamic"
    assert plan_diloco(s, given={"eager": True}).variant == "sync"
    servers = plan_diloco(s, given={"compressor": "none", "memory": None, "allreduce": "gloo"})
    assert servers.variant in ("dynamic", "quorum", "async")
    asynchronous = replace(plan, variant="async")
    assert asynchronous.algorithm == "async-diloco" and "dynamic" not in asynchronous.params()


def test_stragglers_slow_a_lockstep_step_more_than_their_mean():
    got = scenario_speeds(speeds.parse("stragglers"), 4)
    q = 0.02 * 10 / (1 + 0.02 * 10)
    assert got["speeds"] == pytest.approx([1 / ((1 - q) + q / 0.25)] * 4)
    assert got["lockstep_speed"] == pytest.approx(1 / ((1 - q) ** 4 + (1 - (1 - q) ** 4) / 0.25))
    s = scenario("lan", params=1e3, **got)
    assert predict(s, "bsp").scalability < predict(s, "asp").scalability
    assert scenario_speeds(None, 4) == {}


def test_advise_takes_speeds(capsys):
    args = ["advise", "--params", "3e6", "--compute-ms", "120", "--network", "world", "--workers", "4"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--speeds", "1,1,1,0.5"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["scenario"]["speeds_spec"] == "1,1,1,0.5" and slow["scenario"]["speeds"] == [1, 1, 1, 0.5]
    assert "speeds" not in plain["scenario"]
    rows = {r["config"]: r for r in slow["ranking"]}
    assert rows["bsp"]["iteration_s"] > {r["config"]: r for r in plain["ranking"]}["bsp"]["iteration_s"]
    assert "diloco H=50 dynamic" in rows and "async-diloco H=50" in rows
    assert slow["diloco_plan"]["algorithm"] == "diloco" and slow["diloco_plan"]["params"].get("dynamic")
    assert main(args + ["--speeds", "one-half"]) == 0
    assert "DiLoCo at these speeds: diloco, dynamic local updates" in capsys.readouterr().out


@pytest.mark.parametrize("spec,needle", [("1,1,0.5", "gives 3 factors for 4 workers"),
                                         ("bogus", "unknown --speeds profile"),
                                         ("1,1,1,2", "every factor must be in (0, 1]")])
def test_advise_refuses_a_bad_speed_spec_in_one_line(spec, needle, capsys):
    assert main(["advise", "--params", "1e6", "--workers", "4", "--speeds", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_a_diloco_cell_is_planned_for_the_speeds():
    from types import SimpleNamespace

    from thinwire.compare import forecast
    from thinwire.compare.presets import parse_cell
    cell = parse_cell("diloco")
    equal, _ = forecast.tune_cell(cell, "world", "wide-mlp", 4, compute_s=0.05)
    slow, why = forecast.tune_cell(cell, "world", "wide-mlp", 4, compute_s=0.05, speeds="1,1,1,0.5")
    assert "dynamic" not in equal.params and cell.params == {}
    assert slow.algorithm == "diloco" and slow.params["dynamic"] is True and "dynamic local updates" in why[0]
    cfg = SimpleNamespace(workload="wide-mlp", workers=4)
    ran = forecast.predict_cell(slow, "world", cfg, 0.05, "1,1,1,0.5")
    sync = forecast.predict_cell(equal, "world", cfg, 0.05, "1,1,1,0.5")   # synchronous DiLoCo waits for the slow one
    assert ran["step_s"] < sync["step_s"]


def test_straggler_episodes_cost_a_round_less_the_longer_it_is():
    s = scenario("lan", **scenario_speeds(speeds.parse("stragglers"), 4))
    f = [s.round_factor(h) for h in (1, 8, 32, 100, 256)]
    assert f == sorted(f, reverse=True) and f[-1] > 1
    # one step: about the lockstep step (1 − (1 − q)^n of the steps wait out an episode), within the Poisson count
    assert f[0] == pytest.approx(s.speeds[0] / s.lockstep_speed, rel=0.05)
    # a Monte Carlo of the episodes (p = 0.02, 10 steps at 0.25, 4 workers) gave 1.42 at H = 32 and 1.24 at 100
    assert f[2] == pytest.approx(1.42, abs=0.05) and f[3] == pytest.approx(1.24, abs=0.05)
    assert s.round_factor(32, waits_for=2) < f[2] and scenario("lan").round_factor(32) == 1.0
    # under episodes alone the servers' variants are not weighed (asynchronous DiLoCo kept the speeds but lost the
    # LM race to synchronous and dynamic DiLoCo, which a long round lets absorb the episodes)
    episodes = scenario_speeds(speeds.parse("stragglers"), 4)
    plan = plan_diloco(scenario("world", params=1.3e6, compute_s=0.05, **episodes))
    assert plan.algorithm == "diloco" and plan.variant in ("sync", "dynamic")
    unequal = scenario_speeds(speeds.parse("1,1,1,0.5"), 4)        # a lasting difference: every variant weighed
    assert {p.variant for p in candidates(scenario("world", params=1.3e6, compute_s=0.05, **unequal))} >= \
        {"sync", "dynamic", "async"}
