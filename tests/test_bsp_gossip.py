"""`bsp` on architecture="gossip" (D-PSGD, Tang et al. 2020, arXiv 2003.06307, Table II/IV Gossip/BSP): rules, parameter routing, and on
linreg (float64) across 4 real workers: the complete graph equals bsp on all-reduce, a ring does not."""
from __future__ import annotations

import pytest
import torch
from test_localsgd_gossip import _train

from thinwire import algorithms
from thinwire.errors import UserError
from thinwire.run.train import TrainConfig
from thinwire.trainer import build_components


def test_rules_and_parameter_routing():
    from thinwire.algorithms.bsp import BSP
    from thinwire.algorithms.dpsgd import BSPOnGossip
    from thinwire.algorithms.ps_sync import PSBSP
    assert algorithms.architectures("bsp") == ("allreduce", "ps", "gossip")
    assert algorithms.registry.accepts("bsp", "topology") and algorithms.registry.accepts("dpsgd", "topology")
    alg, comp, mem, *_ = build_components("bsp", architecture="gossip", topology="ring", consensus_every="3")
    assert type(alg) is BSPOnGossip and alg.topology_name == "ring" and alg.consensus_every == 3
    assert algorithms.get("bsp", architecture="gossip").topology_name == "complete"  # = all-reduce
    assert type(algorithms.get("bsp")) is BSP and type(algorithms.get("bsp", architecture="ps")) is PSBSP
    assert build_components("dpsgd", topology="torus")[0].topology_name == "torus"   # others unchanged
    with pytest.raises(UserError, match="unknown parameter 'topology'.*valid"):
        build_components("dts", topology="ring")
    with pytest.raises(UserError, match="topology is for architecture=gossip"):   # localsgd has a gossip form
        build_components("localsgd", topology="ring")
    with pytest.raises(UserError, match="architecture=gossip"):
        algorithms.get("bsp", topology="ring")                   # all-reduce has no topology
    with pytest.raises(UserError, match="architecture=gossip"):
        algorithms.get("bsp", architecture="ps", servers=1, consensus_every=2)
    with pytest.raises(UserError, match="bsp on gossip.*valid: ring"):
        algorithms.get("bsp", architecture="gossip", topology="star")
    with pytest.raises(UserError, match="architecture=ps"):
        algorithms.get("bsp", architecture="gossip", servers=1)
    with pytest.raises(UserError, match="valid: allreduce, ps, gossip"):
        algorithms.get("bsp", architecture="mesh")
    with pytest.raises(UserError, match="--servers is for the parameter-server"):
        TrainConfig(algorithm="bsp", workers=4, servers=1, params={"architecture": "gossip"}).validate()
    TrainConfig(algorithm="bsp", workers=4, steps=2, params={"architecture": "gossip", "topology": "ring"}).validate()


def _runs(rank, n):
    from thinwire import Trainer
    out = {"allreduce": _train(rank, n, "bsp"),
           "gossip": _train(rank, n, "bsp", architecture="gossip"),
           "gossip ring": _train(rank, n, "bsp", architecture="gossip", topology="ring", consensus_every=4),
           "dpsgd ring": _train(rank, n, "dpsgd", topology="ring", consensus_every=4)}
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:  # compressed gossip is choco's job: a compressor on bsp-on-gossip is refused at construction
        Trainer(model, opt, algorithm="bsp", architecture="gossip", compressor="topk")
        out["compressor rejected"] = ""
    except UserError as e:
        out["compressor rejected"] = str(e)
    return out


def test_bsp_on_gossip_on_linreg(pool4):
    results = pool4.run(_runs)
    ref = results[0]["allreduce"][1]
    assert ref.dtype == torch.float64 and ref.numel() == 16
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12)  # noqa: E731
    for r in results:
        assert "choco" in r["compressor rejected"]
        before, after, m = r["gossip"]
        # complete graph (the default): every step equals the all-reduce step, so nothing to average at close
        assert close(before, ref) and close(after, ref)
        assert m["topology"] == "complete" and m["spectral_gap"] == pytest.approx(1.0)
        assert m["consensus_distance"] < 1e-20
        # the ring runs D-PSGD's code: the same models as dpsgd, step by step
        assert torch.equal(r["gossip ring"][0], r["dpsgd ring"][0])
        assert torch.equal(r["gossip ring"][1], r["dpsgd ring"][1])
        assert not close(r["gossip ring"][1], ref)
    befores = [r["gossip ring"][0] for r in results]
    afters = [r["gossip ring"][1] for r in results]
    assert not close(befores[0], befores[1])                     # the workers' models differ before close
    assert all(torch.equal(afters[0], a) for a in afters[1:])    # close() leaves every worker with x̄
    assert close(afters[0], torch.stack(befores).mean(0))
    m = results[0]["gossip ring"][2]
    assert m["topology"] == "ring" and m["spectral_gap"] == pytest.approx(2 / 3)
    want = float(torch.stack([(b - afters[0]).pow(2).sum() for b in befores]).mean())
    assert m["consensus_distance"] == pytest.approx(want, rel=1e-6) and want > 0
    assert [s for s, _ in m["consensus_history"]] == [4, 8, 12, 12]


@pytest.mark.slow
def test_bsp_on_gossip_ring_trains_digits_mlp(pool4):
    from thinwire.run.train import run_training
    cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, network="lan", epochs=8,
                      params={"architecture": "gossip", "topology": "ring"}, progress=False)
    s = run_training(cfg, pool=pool4)
    assert s["final_accuracy"] >= 0.95, s["final_accuracy"]
    assert s["algorithm_metrics"]["consensus_distance"] > 0
