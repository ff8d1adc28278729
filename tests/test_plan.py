"""The planner: the cost model's limits and equivalences, the simulator against the cost model, the CLIs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from thinwire.cli import main
from thinwire.net import parse_network, ring_allreduce
from thinwire.plan.costmodel import Scenario, predict
from thinwire.plan.simulate import WORLD_LATENCY, SimConfig, simulate

WAN = parse_network("wan")


def scenario(**kw):
    base = dict(params=1e6, compute_s=0.1, link=WAN, workers=4)
    base.update(kw)
    return Scenario(**base)


def test_bsp_is_compute_plus_ring_allreduce():
    s = scenario()
    assert predict(s, "bsp").iteration_s == pytest.approx(0.1 + ring_allreduce(WAN, 4, 4e6).time)
    assert predict(s, "bsp").bytes_per_step == pytest.approx(ring_allreduce(WAN, 4, 4e6).sent)
    # WFBP hides up to the backward share of compute
    assert predict(s, "bsp", overlap=True).iteration_s == pytest.approx(
        0.1 + ring_allreduce(WAN, 4, 4e6).time - 0.1 * 2 / 3)


def test_limits_reduce_to_bsp():
    s = scenario()
    bsp = predict(s, "bsp").iteration_s
    assert predict(s, "dts", delay=1, period=1).iteration_s == pytest.approx(bsp)
    assert predict(s, "localsgd", period=1).iteration_s == pytest.approx(bsp)
    # CD-SGD (Yu et al. 2021, arXiv 2106.10796) eq. 4: with communication dominating, OD-SGD costs max(τ, φ)
    phi = ring_allreduce(WAN, 4, 4e6).time
    assert predict(s, "odsgd").iteration_s == pytest.approx(max(0.1, phi))


def test_latency_hidden_by_delay_and_amortised_by_period():
    s = scenario(link=parse_network("custom:bandwidth=10gbit,latency=250ms"))
    bsp = predict(s, "bsp")
    dts = predict(s, "dts", delay=20, period=20)
    assert bsp.scalability < 0.1 and dts.scalability > 0.9
    assert predict(s, "tsparse", period=4).iteration_s < bsp.iteration_s


def test_compressed_payload_shrinks_bytes():
    s = scenario()
    full = predict(s, "bsp").bytes_per_step
    assert predict(s, "bsp", "fp16").bytes_per_step == pytest.approx(full / 2, rel=0.01)
    # qsgd's 6-bit codes are summed as 8-bit levels (+ one fp32 norm per 512) at 4 workers: what the exchange sends
    assert predict(s, "bsp", "qsgd", levels=16).bytes_per_step == pytest.approx(full * (8 + 32 / 512) / 32, rel=1e-5)
    # at 32 workers the levels need int16, which gloo sums as int32: no saving left over fp32
    s32 = scenario()
    s32.workers = 32
    assert predict(s32, "bsp", "qsgd", levels=16).bytes_per_step >= predict(s32, "bsp").bytes_per_step


def test_the_planner_predicts_every_registered_algorithm_at_its_defaults():
    """Every algorithm declares its cost family (`Algorithm.cost`): one the planner cannot predict fails here."""
    from thinwire import algorithms
    for name in algorithms.names():
        for compressor in ("none", "fp16"):
            pred = predict(scenario(), name, compressor)
            assert pred.name == name and 0.1 <= pred.iteration_s < float("inf") and pred.collective, name


def test_simulator_agrees_with_cost_model_at_four_workers():
    for alg, kw in [("bsp", {}), ("localsgd", {"period": 4}), ("dts", {"delay": 4, "period": 4})]:
        sim = simulate(SimConfig(workers=4, params=1e6, compute_s=0.1, compute_cv=0.0, bandwidth=100e6,
                                 latency=0.05, algorithm=alg, collective="ring", steps=400, **kw))
        pred = predict(scenario(), alg, **kw)
        assert sim.iteration_s == pytest.approx(pred.iteration_s, rel=0.05), alg


def test_simulator_reproduces_seed_004_and_table_iii_shapes():
    sc = lambda alg, lat, **kw: simulate(SimConfig(workers=4, params=1e6, compute_s=0.1, bandwidth=10e9,
                                                   latency=lat, algorithm=alg, steps=200, **kw)).scalability
    # bsp collapses with latency; DTS holds
    assert sc("bsp", 0.25) < 0.2 * sc("bsp", 0.0)
    assert sc("dts", 0.25, delay=20, period=20) >= 0.7
    # Table III: the ring's latency term grows as 2(n-1)α, recursive doubling's as α log n
    it = lambda n, coll: simulate(SimConfig(workers=n, params=1e3, compute_s=0.0, compute_cv=0.0, latency=0.01,
                                            bandwidth=None, algorithm="bsp", collective=coll, steps=5)).iteration_s
    assert it(16, "ring") == pytest.approx(2 * 15 * 0.01) and it(64, "ring") == pytest.approx(2 * 63 * 0.01)
    assert it(64, "recursive_doubling") == pytest.approx(6 * 0.01)


def test_thousands_of_workers_across_regions():
    r = simulate(SimConfig(workers=4096, params=25e6, compute_s=0.3, bandwidth=10e9, regions=WORLD_LATENCY,
                           straggler_prob=0.01, algorithm="dts", delay=20, period=4, steps=20))
    assert 0 < r.scalability <= 1 and np.isfinite(r.iteration_s)
    asp = simulate(SimConfig(workers=64, params=1e6, compute_s=0.1, bandwidth=1e9, algorithm="asp", steps=10))
    ssp = simulate(SimConfig(workers=64, params=1e6, compute_s=0.1, bandwidth=1e9, algorithm="ssp", staleness=0,
                             steps=10))
    assert asp.total_s <= ssp.total_s * 1.0001


def test_every_collective_is_priced_across_regions():
    """Every --collective the simulator accepts runs with --regions world (torus and recursive_halving raised
    KeyError there)."""
    from thinwire.plan.costmodel import COLLECTIVES
    times = {c: simulate(SimConfig(workers=16, params=1e6, compute_s=0.1, bandwidth=1e9, regions=WORLD_LATENCY,
                                   collective=c, steps=5)).iteration_s for c in COLLECTIVES}
    assert all(np.isfinite(t) and t > 0.1 for t in times.values()), times


def test_advise_cli_ranks_configurations(capsys):
    assert main(["advise", "--params", "25e6", "--compute-ms", "300", "--network", "wan", "--workers", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    its = [r["iteration_s"] for r in out["ranking"]]
    assert its == sorted(its) and len(its) >= 8
    names = {r["algorithm"] for r in out["ranking"]}
    assert {"bsp", "dts", "localsgd", "cdsgd"} <= names
    assert main(["advise", "--model", "wide-mlp", "--bandwidth", "200mbit", "--latency", "25ms"]) == 0
    assert "configuration" in capsys.readouterr().out


def test_simulate_cli_writes_plots(tmp_path, capsys):
    assert main(["simulate", "--workers", "4,64", "--latency", "0,100", "--algorithms", "bsp,dts:delay=4:period=4",
                 "--steps", "5", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "scalability_vs_latency.png").exists() and (tmp_path / "scalability_vs_workers.png").exists()
    assert main(["simulate", "--algorithms", "warp"]) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_tune_keeps_dts_and_delayed_within_the_staleness_bound():
    """The planner's DTS / delayed-update pick never leaves (t − 1)·p ≤ staleness_bound(momentum) (docs/dts.md:
    with momentum 0.9, t = p = 4 did not learn); with plain SGD the bound is wider; a given parameter stays."""
    from thinwire.plan.advise import staleness_bound, tune
    stale = lambda p: (p.get("delay", 1) - 1) * p.get("period", 1)
    assert (staleness_bound(0.9), staleness_bound(0.0)) == (3, 20) and staleness_bound(0.9, "bsp") is None
    for latency in ("0ms", "50ms", "250ms", "1000ms"):
        s = Scenario(params=1e6, compute_s=0.05, link=parse_network(f"custom:bandwidth=1gbit,latency={latency}"),
                     workers=4, handshake=True)
        for alg in ("dts", "delayed"):
            pick, why = tune(alg, s, momentum=0.9)
            assert stale(pick) <= 3 and "(t-1)p <= 3, the accuracy bound" in why, (latency, alg, pick)
            plain, _ = tune(alg, s, momentum=0.0)
            assert stale(plain) <= 20
    s = Scenario(params=1e6, compute_s=0.05, link=parse_network("custom:bandwidth=1gbit,latency=1000ms"), workers=4,
                 handshake=True)
    assert tune("dts", s, {"delay": 2}, momentum=0.9)[0] == {"period": 2}       # (2 − 1)·p ≤ 3
    assert tune("dts", s, {"delay": 2}, momentum=0.0)[0]["period"] > 3           # the bound binds: plain SGD goes staler
    pick, _ = tune("dts", s, {"period": 8}, momentum=0.9)
    assert pick == {"delay": 1}                              # (t − 1)·8 ≤ 3 leaves t = 1


def test_tune_keeps_cdsgd_corrections_frequent_under_momentum():
    """Under momentum CD-SGD's 2-bit quantizer winds up between corrections: the planner keeps k ≤ 2 (docs/cdsgd.md;
    on stdlib-lm k = 5 diverged); with plain SGD (the paper's setting) the network decides."""
    from thinwire.plan.advise import staleness_bound, tune
    s = Scenario(params=1e6, compute_s=0.2, link=parse_network("world"), workers=4, handshake=True)
    assert staleness_bound(0.9, "cdsgd") == 2
    pick, why = tune("cdsgd", s, momentum=0.9)
    assert pick["k"] <= 2 and "k <= 2, the accuracy bound at momentum 0.9" in why
    assert tune("cdsgd", s, momentum=0.0)[0]["k"] > 2


# -- DiLoCo planned so that its sync is hidden (thinwire.plan.diloco) ------------------------------------------
def test_diloco_planner_hides_the_sync_by_the_tau_rule():
    """τ = ⌈one fragment's sync / step⌉ (below H/F and at most half of it), else eager updates; the smallest H that
    reaches 95 % scalability; gloo's ring where the link is near, a point-to-point all-reduce where latency dominates,
    fewer bits where bytes dominate, one replica per island on a two-tier network."""
    import math

    from thinwire.net import parse_network
    from thinwire.plan.costmodel import Scenario
    from thinwire.plan.diloco import candidates, fragment_sync, plan_diloco, predict_diloco

    def scenario(net, compute=0.17):
        return Scenario(params=1.07e6, compute_s=compute, link=parse_network(net), workers=4, handshake=True)

    for net in ("cluster", "wan", "world", "home", "custom:bandwidth=10gbit,latency=150ms"):
        s = scenario(net)
        p = plan_diloco(s)
        delta, cost = fragment_sync(s, p.compressor, p.allreduce, p.fragments)
        assert p.sync_s == pytest.approx(delta + cost.time)
        k = p.period // p.fragments
        if p.eager:       # no τ below H/F hides it: the whole period does
            assert p.fragments == 1 and p.sync_s <= p.period * s.compute_s
            assert math.ceil(p.sync_s / s.compute_s) > k // 2
        else:             # the τ rule: the least overlap whose inner steps cover the sync
            assert p.overlap == math.ceil(p.sync_s / s.compute_s - 1e-9) and p.overlap <= k // 2
            assert (p.overlap - 1) * s.compute_s < p.sync_s <= p.overlap * s.compute_s
            assert p.params().get("alpha") == (0.5 if p.overlap else None)     # mixed at the merge, as the paper
        assert p.scalability >= 0.95 and p.iteration_s == pytest.approx(
            predict_diloco(s, p.compressor, p.allreduce, p.fragments, p.period, p.overlap, p.eager)[0])
        smaller = [c for c in candidates(s) if c.period < p.period and c.scalability >= 0.95 and c.eager == p.eager]
        assert not smaller, (net, smaller[0].describe())     # nothing with a smaller H reaches the target
    # latency dominates a fast, far link: recursive doubling (2 rounds of one latency), not gloo's 6 round trips
    far = plan_diloco(scenario("custom:bandwidth=10gbit,latency=150ms"))
    assert far.allreduce == "recursive_doubling" and far.compressor == "none"
    # bytes dominate a thin, near link: fewer bits (with error feedback)
    thin = plan_diloco(scenario("custom:bandwidth=20mbit,latency=1ms"))
    assert thin.compressor in ("int8", "fp4") and thin.memory == "residual" and thin.bits < 32
    assert plan_diloco(scenario("cluster")).compressor == "none"
    # too slow a step to hide anything in a short H: the planner says how much is left exposed (no target reached)
    tight = plan_diloco(scenario("custom:bandwidth=1mbit,latency=500ms", compute=0.01))
    assert tight.scalability < 0.95 and tight.params()["period"] == tight.period
    # what the cell gives is kept
    given = plan_diloco(scenario("world"), given={"period": 64, "compressor": "int8", "memory": "residual"})
    assert given.period == 64 and given.compressor == "int8"
    # a two-tier network: one replica per island, the outer sync among 2 islands over the thin link only
    isl = parse_network("islands:2x2,inside=dc,across=world")
    h = plan_diloco(scenario("islands:2x2,inside=dc,across=world"), isl)
    assert h.replicas == "island" and h.params()["replicas"] == "island" and h.allreduce == "gloo"
    flat = plan_diloco(scenario("islands:2x2,inside=dc,across=world"), isl, given={"replicas": "worker"})
    assert flat.replicas == "worker" and "replicas" not in flat.params()
