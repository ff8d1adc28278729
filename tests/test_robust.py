"""Robust aggregation (thinwire/exchange/robust.py) and the emulated faulty replica (thinwire/exchange/faulty.py):
each rule against a hand computation, each faulty kind, each refusal in one line, and on real workers: every
faulty kind end to end, and DiLoCo with median / trimmed mean / centered clipping beating the plain mean against a
replica that sends −10× its pseudo-gradient."""
from __future__ import annotations

import math

import pytest
import torch

from thinwire.errors import UserError
from thinwire.exchange import faulty, robust
from thinwire.run.train import TrainConfig, run_training


def _rows(*rows):
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


# -- the rules, by hand (Yin et al. 2018, Definitions 1 and 2; Karimireddy et al. 2021, CC) ------------------------
def test_median_by_hand():
    r = robust.make("median")
    # odd: per coordinate the middle value (1,4,7 -> 4; 5,0,3 -> 3; 2,9,3 -> 3)
    assert r.reduce(_rows([1, 5, 2], [4, 0, 3 + 6], [7, 3, 3])).tolist() == [4, 3, 3]
    # even: the mean of the two middle values; the outlier moves nothing
    assert r.reduce(_rows([1, 0], [2, 0], [3, 0], [100, 0])).tolist() == [2.5, 0]
    assert r.reduce(_rows([1, 0], [2, 0], [3, 0], [1e9, 0])).tolist() == [2.5, 0]
    m = r.metrics()
    assert m["robust_exchanges"] == 3 and m["robust_rejected"] == 0 and m["robust_rule"] == "median"


def test_trimmed_mean_by_hand():
    xs = _rows(*[[v] for v in (0, 0, 1, 2, 4, 8, 16, 1000)])
    # β = 0.25 of 8: the 2 largest and 2 smallest removed -> mean(1, 2, 4, 8)
    assert robust.make("trimmed").reduce(xs).item() == pytest.approx(3.75)
    # β = 0.1 of 8: ⌈0.8⌉ = 1 from each end -> mean(0, 1, 2, 4, 8, 16)
    assert robust.make("trimmed", trim=0.1).reduce(xs).item() == pytest.approx(31 / 6)
    # CLI strings are numbers too; 3 ranks at β = 0.25 trim one from each end: the median
    assert robust.make("trimmed", trim="0.25").reduce(_rows([1.0], [2.0], [50.0])).item() == 2.0
    # left out: the 1000 always (rank 7), the kept middle never (ranks 2..5)
    r = robust.make("trimmed")
    r.reduce(xs)
    assert r.metrics()["robust_left_out"][2:] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def _cc_by_hand(xs, v, tau, iters):
    """Centered clipping in plain Python: v ← v + (1/n) Σ_i (x_i − v) min(1, τ/‖x_i − v‖)."""
    for _ in range(iters):
        step = [0.0] * len(v)
        for x in xs:
            d = [a - b for a, b in zip(x, v)]
            norm = math.sqrt(sum(e * e for e in d))
            s = min(1.0, tau / norm) if norm > 0 else 1.0
            step = [a + s * e / len(xs) for a, e in zip(step, d)]
        v = [a + b for a, b in zip(v, step)]
    return v


def test_centered_clipping_by_hand():
    xs = [[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [30.0, 40.0]]
    r = robust.make("clip", clip=1.0)
    # the first exchange of a key starts from the coordinate-wise median (1, 1)
    got = r.reduce(_rows(*xs), key="k")
    want = _cc_by_hand(xs, [1.0, 1.0], 1.0, robust.CLIP_ITERS)
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert r.metrics()["robust_clipped"] == 4          # every distance above τ = 1 at the last iteration
    # the next exchange of the same key starts from the previous aggregate
    xs2 = [[1.0, 1.0], [1.5, 1.0], [1.0, 1.5], [-300.0, 0.0]]
    got2 = r.reduce(_rows(*xs2), key="k")
    assert got2.tolist() == pytest.approx(_cc_by_hand(xs2, want, 1.0, robust.CLIP_ITERS), abs=1e-5)
    # adaptive τ (2 × the median distance): the far replica is clipped, the aggregate stays near the honest ones
    a = robust.make("clip").reduce(_rows(*xs), key="j")
    assert a.norm() < 3 and robust.make("clip").metrics()["robust_rule"].startswith("clip")


def test_a_non_finite_contribution_is_rejected_whole():
    for rule in ("median", "trimmed", "clip"):
        r = robust.make(rule)
        out = r.reduce(_rows([1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [float("nan"), 5.0]), key=0)
        assert torch.isfinite(out).all() and r.metrics()["robust_rejected"] == 1, rule
    assert robust.make("mean") is None


# -- the faulty kinds ----------------------------------------------------------------------------------------
def test_faulty_kinds():
    x = torch.tensor([3.0, -4.0])
    assert faulty.Faulty("1:scale").corrupt(x, "k", 0, rank=0) is x                  # another rank: honest
    assert faulty.Faulty("1:scale").corrupt(x, "k", 0, rank=1).tolist() == [-30.0, 40.0]
    assert torch.isnan(faulty.Faulty("0:nan").corrupt(x, "k", 0, rank=0)).all()
    noise = faulty.Faulty("0:noise")
    a, b = noise.corrupt(x, "k", 0, 0), noise.corrupt(x, "k", 1, 0)
    assert a.norm().item() == pytest.approx(5.0) and not torch.equal(a, b)          # random, of the update's norm
    stale = faulty.Faulty("0:stale")
    assert stale.corrupt(x, "k", 0, 0).tolist() == [3.0, -4.0]                      # no older one yet
    assert stale.corrupt(x * 2, "k", 1, 0).tolist() == [3.0, -4.0]                  # the previous exchange's
    assert stale.corrupt(x * 3, "k", 2, 0).tolist() == [6.0, -8.0]


# -- refusals: one line, before any worker starts -------------------------------------------------------------
BAD = [
    (["--aggregate", "mode"], "unknown aggregate 'mode'; valid: mean, median, trimmed, clip"),
    (["--aggregate", "trimmed", "--trim", "0.5"], "trim must be a number in (0, 0.5), got"),
    (["--aggregate", "trimmed", "--trim", "nan"], "trim must be a number in (0, 0.5)"),
    (["--aggregate", "clip", "--clip", "-1"], "clip must be a number > 0, got"),
    (["--aggregate", "median", "--trim", "0.2"], "trim is the trimmed mean's fraction"),
    (["--clip", "1"], "clip is centered clipping's radius"),
    (["--aggregate", "median", "--collective", "allreduce"], "aggregate=median gathers every rank's contribution"),
    (["--aggregate", "median", "--compressor", "powersgd"], "cannot run with compressor 'powersgd'"),
    (["--aggregate", "median", "--compressor", "topk", "--sparse-collective", "gtopk"], "collective 'gtopk'"),
    (["--faulty", "3"], "--faulty takes RANK:KIND (e.g. 3:scale), got '3'"),
    (["--faulty", "x:scale"], "--faulty takes RANK:KIND"),
    (["--faulty=-1:scale"], "--faulty takes RANK:KIND"),
    (["--faulty", "4:scale"], "--faulty rank 4 is not a worker: valid ranks 0..3"),
    (["--faulty", "1:flip"], "unknown --faulty kind 'flip'; valid: scale, noise, stale, nan"),
    (["--algorithm", "dpsgd", "--aggregate", "median"], "aggregate act on an all-reduce exchange's contributions"),
    (["--algorithm", "bsp", "--architecture", "ps", "--faulty", "0:nan"], "faulty act on an all-reduce exchange"),
    (["--algorithm", "ddp", "--faulty", "0:nan"], "--faulty is emulated in thinwire's exchange; 'ddp'"),
]


@pytest.mark.parametrize("extra, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_refused_in_one_line(extra, needle, capsys):
    from unittest import mock

    from thinwire.cli import main

    def tripwire(*a, **k):
        raise AssertionError("started despite bad input")
    with mock.patch("thinwire.run.train.launch", tripwire):
        assert main(["train", "--workers", "4", "--steps", "2"] + extra) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# -- the planner charges the gather ----------------------------------------------------------------------------
def test_the_planner_charges_a_gathered_exchange():
    from thinwire.net import Link
    from thinwire.plan.costmodel import Scenario, predict
    s = Scenario(params=1e6, compute_s=0.1, link=Link(bandwidth=1e9, latency=1e-3), workers=8)
    mean = predict(s, "diloco", period=10)
    med = predict(s, "diloco", period=10, aggregate="median")
    assert med.collective == "allgather" and mean.collective != "allgather"
    # a ring all-reduce sends 2(n−1)/n of the tensor per rank, the gather n − 1 tensors
    assert med.bytes_per_sync == pytest.approx(mean.bytes_per_sync * (8 - 1) / (2 * (8 - 1) / 8))
    q = predict(s, "bsp", "int8", aggregate="trimmed")
    assert q.collective == "allgather" and q.bytes_per_step == pytest.approx(7 * 1e6 * 8.0 / 8, rel=0.01)


# -- on real workers -------------------------------------------------------------------------------------------
def _run(pool, algorithm="diloco", steps=40, **params):
    faulty_spec = params.pop("faulty", None)
    cfg = TrainConfig(workload="linreg", algorithm=algorithm, workers=4, network="lan", steps=steps, seed=0,
                      progress=False, faulty=faulty_spec, params=params)
    return run_training(cfg, pool=pool)


@pytest.mark.parametrize("kind", faulty.KINDS)
def test_each_faulty_kind_end_to_end(pool4, kind):
    s = _run(pool4, "diloco", period=5, aggregate="trimmed", faulty=f"3:{kind}")
    m = s["algorithm_metrics"]
    assert m["robust_rule"] == "trimmed(β=0.25)" and m["robust_exchanges"] > 0
    assert math.isfinite(s["final_loss"])
    if kind == "nan":               # rejected whole at every exchange
        assert m["robust_rejected"] == m["robust_exchanges"]
    elif kind in ("scale", "noise"):  # the faulty rank's values sit outside the kept middle far more than others'
        assert m["robust_left_out"][3] > max(m["robust_left_out"][:3]), m["robust_left_out"]
    assert s["final_loss"] < 1.0, (kind, s["final_loss"])


def test_bsp_and_localsgd_gather_and_reduce_robustly(pool4):
    for algorithm, params in (("bsp", {}), ("localsgd", {"period": 4})):
        s = _run(pool4, algorithm, aggregate="median", faulty="3:scale", **params)
        m = s["algorithm_metrics"]
        assert m["robust_left_out"][3] > 0.9 and s["final_loss"] < 1.0, (algorithm, m, s["final_loss"])


def test_robust_diloco_beats_the_mean_against_a_scaled_replica(pool4):
    honest = _run(pool4, "diloco", steps=60, period=5)["final_loss"]
    mean = _run(pool4, "diloco", steps=60, period=5, faulty="3:scale")["final_loss"]
    assert not (mean < 1e3), mean        # one replica at −10× its pseudo-gradient sends the mean away
    for rule, extra in (("median", {}), ("trimmed", {}), ("clip", {})):
        got = _run(pool4, "diloco", steps=60, period=5, aggregate=rule, faulty="3:scale", **extra)["final_loss"]
        assert got < max(10 * honest, 0.5), (rule, got, honest)


def test_torchft_diloco_faces_the_same_faulty_replica(pool4):
    """`compare --faulty` races torchft's DiLoCo against the same replica: its all-reduced contributions (the
    pseudo-gradients) corrupted on the faulty rank, as thinwire's exchange corrupts them; its plain mean follows."""
    from thinwire.compare.peers import find, resolve
    if find("torchft-diloco").missing() is not None:
        pytest.skip("torchft is not installed (extra thinwire[peers])")

    def run(faulty_spec):
        cfg = resolve(TrainConfig(workload="linreg", algorithm="torchft-diloco", workers=4, network="lan", steps=40,
                                  seed=0, progress=False, faulty=faulty_spec, params={"period": 5}))
        return run_training(cfg, pool=pool4)["final_loss"]
    honest = run(None)
    assert honest < 1.0 and not (run("3:scale") < 1e3), honest


def test_compare_takes_faulty_and_refuses_a_peer_that_cannot_face_it(capsys):
    from thinwire.cli import main
    from thinwire.cli.compare import config_from_args, register
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["compare", "--workload", "linreg", "--algorithms", "diloco:aggregate=median;diloco",
                              "--faulty", "3:scale"])
    assert config_from_args(args).faulty == "3:scale"
    assert main(["compare", "--workload", "linreg", "--algorithms", "diloco;ddp", "--faulty", "3:scale"]) == 2
    err = capsys.readouterr().err
    assert "cell 'ddp': --faulty is emulated in thinwire's exchange; 'ddp'" in err and len(err.strip().splitlines()) == 1
