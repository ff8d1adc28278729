"""The gossip family on the one path: the neighbour exchange (every compressor, one wire format, across real
workers), per-bucket exchanges during backward, AD-PSGD in the background, the spectral gaps of the matrices
SGP and AD-PSGD really mix with, and local SGD on gossip."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from test_localsgd_gossip import _train

from thinwire import algorithms, compressors, memories
from thinwire.comm.topology import Topology, mixing_gap
from thinwire.errors import UserError

# (compressor, params, memory): dense, quantized with local randomness, shared-seed sparse, sparse with error
# feedback, variable-size sparse (sizes first), sign (majority), the identity with a memory (the wire path)
COMPRESSORS = [("none", {}, "none"), ("fp16", {}, "none"), ("int8", {}, "none"), ("qsgd", {}, "none"),
               ("randomk", {"ratio": 0.25}, "none"), ("topk", {"ratio": 0.1}, "residual"),
               ("threshold", {"threshold": 0.5}, "none"), ("signsgd", {}, "none"), ("none", {}, "residual")]


def _neighbors_worker(rank, n):
    """Every rank sends to its ring neighbours (rank ± 1) and receives from them, per compressor, 3 rounds;
    rank 3 sends a longer tensor under another key. Returns what each rank sent (decompressed) and received."""
    from thinwire.comm import Transport
    from thinwire.compress import compressors, memories
    from thinwire.exchange import wire
    from thinwire.exchange.gossip import NeighborExchange
    tp = Transport()
    peers = [(rank + 1) % n, (rank - 1) % n]
    out = {}
    for name, params, mem in COMPRESSORS:
        ex = NeighborExchange(tp, compressors.get(name, **params), memories.get(mem))
        rounds = []
        for step in range(3):
            x = torch.randn(40, 5, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)
            sent_before = tp.meter.bytes_sent
            fut = ex.start(x, key="w", dsts=peers, srcs=peers)
            got = fut.wait()
            tp.barrier()
            rounds.append({"x": x, "got": got, "sent": tp.meter.bytes_sent - sent_before})
        out[(name, mem)] = {"rounds": rounds, "state": ex.state_dict()}
    # the payload bytes of fp16 (fixed size: no size message) as the wire format packs them
    out["fp16 packed"] = wire.packed_size(compressors.get("fp16").compress(torch.zeros(40, 5)).tensors)
    try:
        NeighborExchange(tp, "powersgd", "powersgd")
        out["powersgd"] = ""
    except UserError as e:
        out["powersgd"] = str(e)
    # a neighbour that is late: the future is returned at once, not completed until the neighbour sends
    ex = NeighborExchange(tp, "fp16", "none")
    if rank == 1:
        time.sleep(0.5)
    fut = ex.start(torch.ones(10) * rank, key="late", dsts=[1 - rank] if rank < 2 else [],
                   srcs=[1 - rank] if rank < 2 else [])
    out["late"] = (fut.is_completed(), fut.wait())
    return out


def test_neighbor_exchange_with_compressors(pool4):
    res = pool4.run(_neighbors_worker)
    n = len(res)
    for (name, mem), _ in [((c, m), None) for c, _, m in COMPRESSORS]:
        for r in range(n):
            for step, rd in enumerate(res[r][(name, mem)]["rounds"]):
                got = rd["got"]
                assert set(got) == {r, (r + 1) % n, (r - 1) % n}, name
                for j in ((r + 1) % n, (r - 1) % n):
                    sender = res[j][(name, mem)]["rounds"][step]
                    # what a neighbour receives is exactly what the sender says it sent (its decompressed q)
                    assert torch.equal(got[j], sender["got"][j]), (name, mem, r, j, step)
                    assert got[j].shape == sender["x"].shape and got[j].dtype == torch.float32
                if name == "none" and mem == "none":
                    assert torch.equal(got[r], rd["x"]) and rd["sent"] == 2 * rd["x"].numel() * 4
                if name != "none":       # compressed: something was lost, and fewer bytes went out
                    assert not torch.equal(got[r], rd["x"]), name
                if name == "fp16":       # one payload per neighbour in the one wire format, no size message
                    assert rd["sent"] == 2 * res[0]["fp16 packed"]
                if name == "signsgd":    # signs times one scale ‖x‖₁/d
                    assert got[r].abs().unique().numel() == 1
        if mem == "residual":            # error feedback: the residual holds exactly what was not sent yet
            for r in range(n):
                rounds = res[r][(name, mem)]["rounds"]
                held = res[r][(name, mem)]["state"]["memory"]["residuals"]["w"]
                total_in = sum(rd["x"].reshape(-1) for rd in rounds)
                total_sent = sum(rd["got"][r].reshape(-1) for rd in rounds)
                assert torch.allclose(total_in - total_sent, held.reshape(-1), atol=1e-5), name
    # threshold: each rank sends a different number of elements (sizes went first)
    assert len({int((res[r][("threshold", "none")]["rounds"][0]["got"][r] != 0).sum()) for r in range(n)}) > 1
    for r in range(n):
        assert "powersgd" in res[r]["powersgd"] and "use a payload compressor" in res[r]["powersgd"]
    assert res[0]["late"][0] is False                       # returned before rank 1 had sent anything
    assert torch.equal(res[0]["late"][1][1], torch.ones(10))


# -- bucket exchanges begin during backward (the trace shows it) -----------------------------------------------
@pytest.mark.parametrize("algorithm,params", [("dpsgd", {"topology": "ring"}), ("choco", {"gamma": 0.5}),
                                              ("sgp", {}), ("adpsgd", {}),
                                              ("localsgd", {"architecture": "gossip", "period": 2})])
def test_gossip_exchanges_buckets_during_backward(algorithm, params, pool2, tmp_path):
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", algorithm=algorithm, workers=2, network="custom:latency=2ms",
                      steps=6, trace=True, progress=False,
                      compressor="topk" if algorithm == "choco" else None,
                      params={"schedule": "wfbp", "serial": False, "pipeline": False, **params})
    if pool2.pool is None or pool2.pool.closed:
        pool2.run(_noop)
    summary = run_training(cfg, out=str(tmp_path / algorithm), pool=pool2.pool)
    with open(summary["trace"]) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
    bw = [e for e in spans if e["cat"] == "backward"]
    comm = [e for e in spans if e["cat"] == "communicate" and e["name"] in ("send", "recv")]
    assert bw and comm, algorithm
    assert any(b["ts"] <= c["ts"] < b["ts"] + b["dur"] for b in bw for c in comm), algorithm


def _noop(rank, world_size):
    return rank


# -- AD-PSGD: the averaging completes in the background -------------------------------------------------------
def _adpsgd_waits(rank, n, staleness):
    """linreg on a link with 20 ms latency (a step computes in far less): per-step exposed waits."""
    from thinwire import Trainer
    from thinwire.run import workloads
    wl = workloads.get("linreg")
    model = wl.model(0)
    x, y = wl.shard(rank, n)
    loader = workloads.ShardLoader(x, y, 16, seed=0, rank=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, opt, algorithm="adpsgd", network="custom:latency=20ms",
                      **({} if staleness is None else {"staleness": staleness}))
    waits = []
    for _ in range(8):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        waits.append(trainer.step()["wait_s"])
        opt.zero_grad()
    trainer.close()
    return waits, trainer.metrics()


def test_adpsgd_does_not_wait_for_its_partner_every_step(pool2):
    for staleness, period in [(None, 2), (4, 4)]:          # the default, and a longer one
        for waits, m in pool2.run(_adpsgd_waits, staleness):
            # steps between pairings wait for nobody; a pairing step waits at most for the averaging begun
            # `staleness` steps earlier (before: every step waited for the exchange begun the step before)
            assert all(w == 0.0 for t, w in enumerate(waits) if t % period), waits
            assert m["staleness"] == period and m["pairings"] == 8 // period
            assert m["consensus_distance"] > 0


def test_adpsgd_is_deterministic_and_resumable(pool4, tmp_path):
    from thinwire.run.train import TrainConfig, train_worker
    base = dict(workload="linreg", algorithm="adpsgd", workers=4, steps=10, progress=False,
                network="custom:latency=1ms,jitter=1ms", params={"staleness": 3})
    ck = str(tmp_path / "ck")
    a = pool4.run(train_worker, TrainConfig(checkpoint_every=4, checkpoint_dir=ck, **base), network=base["network"])
    b = pool4.run(train_worker, TrainConfig(**base), network=base["network"])
    cfg = TrainConfig(resume=ck, **base)
    cfg.validate()
    c = pool4.run(train_worker, cfg, network=base["network"])
    assert [r["model_sha256"] for r in a] == [r["model_sha256"] for r in b] == [r["model_sha256"] for r in c]


def test_adpsgd_rules():
    with pytest.raises(UserError, match="staleness must be"):
        algorithms.get("adpsgd", staleness=0)


# -- the spectral gap of the matrices SGP and AD-PSGD mix with -----------------------------------------------------
def _push(n, pushes):
    """Column-stochastic P from {j: out-peer of j}: j keeps half its mass and pushes half."""
    P = np.zeros((n, n))
    for j, o in pushes.items():
        P[j, j] += 0.5
        P[o, j] += 0.5
    return P


def _pairs(n, pairs):
    W = np.eye(n)
    for a, b in pairs:
        W[a, a] = W[b, b] = W[a, b] = W[b, a] = 0.5
    return W


def _gap(mats):
    prod = np.eye(mats[0].shape[0])
    for M in mats:
        prod = M @ prod
    lam = sorted(np.abs(np.linalg.eigvals(prod)), reverse=True)
    return 1 - (lam[1] if lam[1] > 1e-9 else 0.0) ** (1 / len(mats))


def test_push_and_pairwise_gaps_are_those_of_their_matrices():
    for n in (4, 8, 16):
        t = Topology("ring", n)
        # SGP on a ring pushes to i+1, then i-1, alternately
        P = [_push(n, {j: (j + 1) % n for j in range(n)}), _push(n, {j: (j - 1) % n for j in range(n)})]
        assert t.push_gap() == pytest.approx(_gap(P), abs=1e-9)
        assert np.allclose(t.push_matrix(0), P[0]) and np.allclose(t.push_matrix(1), P[1])
        # AD-PSGD on a ring: edges (2k, 2k+1), then (2k+1, 2k+2)
        M = [_pairs(n, [(a, a + 1) for a in range(0, n, 2)]), _pairs(n, [(a, (a + 1) % n) for a in range(1, n, 2)])]
        assert t.pairwise_gap() == pytest.approx(_gap(M), abs=1e-9)
        assert t.push_gap() < t.spectral_gap()                # one peer per step mixes slower than W
    assert Topology("ring", 4).push_gap() == pytest.approx(1 - 0.5 ** 0.5)
    assert Topology("ring", 4).pairwise_gap() == pytest.approx(1.0)   # two matchings reach the exact average
    assert Topology("ring", 8).pairwise_gap() == pytest.approx(1 - 0.5 ** 0.5)
    for n in (4, 8):   # random matchings: pushes and pairs are the matching's W; the gap of E[W], as before
        t = Topology("random", n, seed=2)
        assert t.push_gap() == t.pairwise_gap() == t.spectral_gap() == pytest.approx(n / (2 * (n - 1)))
    for n in (4, 9):
        t = Topology("torus" if n == 9 else "exponential", n)
        assert t.push_gap() == pytest.approx(mixing_gap([t.push_matrix(s) for s in range(len(t.neighbors(0)))]))
        assert np.allclose(t.push_matrix(3).sum(0), 1)        # column-stochastic
    with pytest.raises(UserError, match="random' or 'ring"):
        Topology("exponential", 4).pairwise_gap()


def _gaps(rank, n):
    return {"sgp": _train(rank, n, "sgp", steps=4, topology="ring")[2]["spectral_gap"],
            "adpsgd": _train(rank, n, "adpsgd", steps=4, topology="ring")[2]["spectral_gap"],
            "dpsgd": _train(rank, n, "dpsgd", steps=4, topology="ring")[2]["spectral_gap"]}


def test_sgp_and_adpsgd_report_the_gap_of_their_mixing(pool4):
    for g in pool4.run(_gaps):
        assert g["dpsgd"] == pytest.approx(2 / 3)                  # symmetric W (1/3 to each ring neighbour)
        assert g["sgp"] == pytest.approx(1 - 0.5 ** 0.5)           # push-sum to i+1, i-1 in turn
        assert g["adpsgd"] == pytest.approx(1.0)                   # matchings (0,1)(2,3) then (1,2)(3,0)


# -- local SGD on gossip ------------------------------------------------------------------------------------------
def _localsgd(rank, n):
    return {"allreduce H=4": _train(rank, n, "localsgd", period=4, steps=10),
            "gossip H=4": _train(rank, n, "localsgd", architecture="gossip", period=4, steps=10),
            "gossip ring H=1": _train(rank, n, "localsgd", architecture="gossip", period=1, topology="ring"),
            "dpsgd ring": _train(rank, n, "dpsgd", topology="ring"),
            "gossip ring H=3": _train(rank, n, "localsgd", architecture="gossip", period=3, topology="ring",
                                      steps=10, consensus_every=3)}


def test_localsgd_on_gossip(pool4):
    from thinwire.algorithms.dpsgd import LocalSGDOnGossip
    assert algorithms.architectures("localsgd") == ("allreduce", "gossip", "ps")
    assert type(algorithms.get("localsgd", architecture="gossip")) is LocalSGDOnGossip
    with pytest.raises(UserError, match="average_momentum is for architecture=allreduce"):
        algorithms.get("localsgd", architecture="gossip", average_momentum=True)
    results = pool4.run(_localsgd)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12)  # noqa: E731
    for r in results:
        # complete graph (the default): exact model averaging every H steps = local SGD on all-reduce
        assert close(r["gossip H=4"][0], r["allreduce H=4"][0]) and close(r["gossip H=4"][1], r["allreduce H=4"][1])
        assert r["gossip H=4"][2]["syncs"] == 2 and r["gossip H=4"][2]["topology"] == "complete"
        # H = 1 runs D-PSGD's steps
        assert torch.equal(r["gossip ring H=1"][0], r["dpsgd ring"][0])
        m = r["gossip ring H=3"][2]
        assert m["syncs"] == 3 and m["period"] == 3 and [s for s, _ in m["consensus_history"]] == [3, 6, 9, 10]
    befores = [r["gossip ring H=3"][0] for r in results]
    afters = [r["gossip ring H=3"][1] for r in results]
    assert not close(befores[0], befores[1])                  # a ring mixes, it does not average exactly
    assert all(torch.equal(afters[0], a) for a in afters[1:])  # close() averages


def test_choco_scales_an_unbiased_compressor_to_a_contraction(pool4):
    """Issue 17 (the matrix): CHOCO with qsgd or random-k (unbiased, variance ω > 1) ran to NaN by step ~70: the
    paper's Assumption 1 wants a contraction, so an unbiased Q is rescaled by 1/(1 + ω); a contractive one is not;
    a compressor with momentum of its own (signum) applies none to model differences."""
    from thinwire.run.train import TrainConfig, run_training
    choco = algorithms.get("choco")
    qsgd = compressors.get("qsgd")
    assert 0 < choco.check_components(qsgd, memories.get("none")) < 0.5          # 1/(1 + ω), ω ≈ 1.5
    choco = algorithms.get("choco")
    assert choco.check_components(compressors.get("topk"), memories.get("none")) == 1.0
    assert 0.05 < choco.gamma < 0.15          # "auto": min(0.5, δ), top-k 1 % has δ ≈ 0.08
    for comp in ("qsgd", "signum"):
        cfg = TrainConfig(workload="digits-mlp", algorithm="choco", compressor=comp, workers=4, epochs=12,
                          progress=False)
        s = run_training(cfg, pool=pool4)
        assert s["final_accuracy"] >= 0.9, (comp, s["final_accuracy"])
