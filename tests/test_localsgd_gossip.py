"""Local SGD and the gossip family: topologies, rules, exact equivalences on linreg (float64), training digits-mlp."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from thinwire import algorithms
from thinwire.comm.topology import NAMES, Topology
from thinwire.compress import Compressor, Payload
from thinwire.errors import UserError


# -- topologies (single process) -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 2, 4, 6, 8, 9])
def test_mixing_matrices_are_doubly_stochastic(name, n):
    if name == "torus" and n in (2,):
        with pytest.raises(UserError, match="valid"):
            Topology(name, n)
        return
    t = Topology(name, n, seed=3)
    for step in range(3):
        W = t.matrix(step)
        assert np.allclose(W, W.T) and (W >= 0).all()
        assert np.allclose(W.sum(0), 1) and np.allclose(W.sum(1), 1)
        for i in range(n):  # W_ij > 0 exactly on the edges of that step
            nz = {j for j in range(n) if W[i, j] > 0 and j != i}
            assert nz == set(t.neighbors(i, step))
    assert 0 <= t.spectral_gap() <= 1 + 1e-12
    if n > 1 and name != "random":
        assert t.spectral_gap() > 0  # connected


def test_documented_spectral_gaps():
    assert Topology("ring", 4).spectral_gap() == pytest.approx(2 / 3)
    assert Topology("ring", 8).spectral_gap() == pytest.approx(1 - (1 + 2 * np.cos(2 * np.pi / 8)) / 3)
    assert Topology("ring", 16).spectral_gap() == pytest.approx(0.0513, abs=1e-3)
    assert Topology("torus", 4).spectral_gap() == pytest.approx(2 / 3)
    assert Topology("torus", 16).spectral_gap() == pytest.approx(0.4)
    assert Topology("exponential", 4).spectral_gap() == pytest.approx(1.0)
    assert Topology("exponential", 8).spectral_gap() == pytest.approx(2 / 3)
    for n in (4, 8, 16):
        assert Topology("random", n).spectral_gap() == pytest.approx(n / (2 * (n - 1)))
        assert Topology("complete", n).spectral_gap() == pytest.approx(1.0)
    # the random matching is the same on every rank (seeded) and changes with the step
    a, b = Topology("random", 8, seed=1), Topology("random", 8, seed=1)
    assert a.matching(5) == b.matching(5) and a.matching(5) != a.matching(6)
    with pytest.raises(UserError, match="valid"):
        Topology("torus", 7)


def test_invalid_parameters_fail_at_construction():
    for name, params in [("localsgd", {"period": 0}), ("postlocalsgd", {"switch": -1}),
                         ("dpsgd", {"topology": "star"}), ("dpsgd", {"variant": "xyz"}),
                         ("adpsgd", {"topology": "complete"}), ("choco", {"gamma": 0.0}),
                         ("choco", {"topology": "random"}), ("sgp", {"consensus_every": -1}),
                         ("localsgd", {"architecture": "gossip", "topology": "star"}),
                         ("localsgd", {"architecture": "gossip", "period": 0}), ("dpsgd", {"architecture": "ps"})]:
        with pytest.raises(UserError, match="valid|must"):
            algorithms.get(name, **params)


# -- a biased compressor for CHOCO (top-k), local to the tests --------------------------------------------------
class TopK(Compressor):
    name = "test-topk"
    unbiased, linear, aggregation = False, False, "allgather"

    def __init__(self, ratio=0.1):
        self.ratio = ratio

    def compress(self, tensor, key=None, step=0, agreed=None):
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.ratio))
        idx = flat.abs().topk(k).indices
        return Payload([flat[idx].clone(), idx.to(torch.int32)], (tensor.shape, tensor.dtype, flat.numel()))

    def decompress(self, payload):
        values, idx = payload.tensors
        shape, dtype, numel = payload.ctx
        out = torch.zeros(numel, dtype=dtype)
        out[idx.long()] = values
        return out.view(shape)


# -- equivalences on linreg, float64 ----------------------------------------------------------------------------
def _train(rank, n, algorithm, steps=12, **params):
    from thinwire import Trainer
    from thinwire.run import workloads
    wl = workloads.get("linreg")
    model = wl.model(0)
    x, y = wl.shard(rank, n)
    loader = workloads.ShardLoader(x, y, 16, seed=0, rank=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, opt, algorithm=algorithm, **params)
    for _ in range(steps):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        trainer.step()
        opt.zero_grad()
    before_close = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    trainer.close()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return before_close, after, trainer.metrics()


def _equivalences(rank, n):
    from thinwire import Trainer
    out = {"bsp": _train(rank, n, "bsp"),
           "localsgd H=1": _train(rank, n, "localsgd", period=1),
           "postlocalsgd": _train(rank, n, "postlocalsgd", switch=5, period=1),
           "dpsgd complete": _train(rank, n, "dpsgd", topology="complete"),
           "dpsgd ring": _train(rank, n, "dpsgd", topology="ring"),
           "choco none ring": _train(rank, n, "choco", topology="ring", gamma=1.0),
           "localsgd H=4": _train(rank, n, "localsgd", period=4, steps=10),
           "adpsgd": _train(rank, n, "adpsgd"),
           "sgp": _train(rank, n, "sgp"),
           "choco topk": _train(rank, n, "choco", compressor=TopK(0.25), gamma=0.4),
           "dpsgd lian": _train(rank, n, "dpsgd", topology="torus", variant="lian", consensus_every=4)}
    # construction-time rules that need the world size
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        Trainer(model, opt, algorithm="choco", memory=_Residual())
        out["choco+memory rejected"] = False
    except UserError as e:
        out["choco+memory rejected"] = "valid" in str(e)
    return out


class _Residual:
    name = "residual"


def test_equivalences_on_linreg(pool4):
    results = pool4.run(_equivalences)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12)  # noqa: E731
    bsp = results[0]["bsp"][1]
    assert bsp.dtype == torch.float64
    for r in results:
        assert r["choco+memory rejected"]
        for name in ["bsp", "localsgd H=1", "dpsgd complete"]:
            before, after, _ = r[name]
            assert close(before, bsp) and close(after, bsp), name
        # post-local SGD with H = 1 is bsp too (both phases)
        assert close(r["postlocalsgd"][1], bsp)
        # CHOCO without compression and γ = 1 is D-PSGD (atc), step by step (before the final average)
        assert close(r["choco none ring"][0], r["dpsgd ring"][0])
        # local SGD with H = 4 after 10 steps: 2 averages and 2 local steps; close() averages once more
        assert r["localsgd H=4"][2]["syncs"] == 3
    # the gossip methods leave each worker with its own model until close(), then everyone with the average
    for name in ["dpsgd ring", "adpsgd", "sgp", "choco topk", "dpsgd lian"]:
        befores = [r[name][0] for r in results]
        afters = [r[name][1] for r in results]
        assert not all(close(befores[0], b) for b in befores[1:]), name
        assert all(torch.equal(afters[0], a) for a in afters[1:]), name
        m = results[0][name][2]
        assert m["consensus_distance"] > 0 and "spectral_gap" in m
        if name in ("adpsgd", "sgp"):  # close() first completes the last pairing / averages Σx/Σw
            continue
        assert close(afters[0], torch.stack(befores).mean(0)), name
        assert m["consensus_distance"] == pytest.approx(
            float(torch.stack([(b - torch.stack(befores).mean(0)).pow(2).sum() for b in befores]).mean()), rel=1e-6)
    assert len(results[0]["dpsgd lian"][2]["consensus_history"]) == 12 // 4 + 1


def _bad_topology(rank, n):
    from thinwire import Trainer
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        Trainer(model, opt, algorithm="dpsgd", topology="torus")
    except UserError as e:
        return str(e)
    return None


def test_torus_needs_a_grid_world(pool2):
    for msg in pool2.run(_bad_topology):
        assert msg and "torus" in msg and "valid" in msg


# -- training digits-mlp to its target ------------------------------------------------------------------------
CASES = [("localsgd", {"period": 4}, None), ("dpsgd", {"topology": "ring"}, None), ("adpsgd", {}, None),
         ("sgp", {}, None), ("choco", {"gamma": 0.5}, None), ("postlocalsgd", {"switch": 20, "period": 8}, None)]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,params,compressor", CASES)
def test_trains_digits_mlp(algorithm, params, compressor, pool4):
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", algorithm=algorithm, workers=4, network="lan", epochs=8,
                      compressor=compressor, params=dict(params), progress=False)
    s = run_training(cfg, pool=pool4)
    print(algorithm, params, "steps to target", s["steps_to_target"], "of", s["steps"],
          "final", s["final_accuracy"], s["algorithm_metrics"].get("consensus_distance"))
    assert s["final_accuracy"] >= 0.95, s["final_accuracy"]
