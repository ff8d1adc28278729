"""The parameter server (thinwire.comm.ps) and the algorithms on it: bsp (architecture ps), ssp, asp, backup."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thinwire import Trainer
from thinwire.comm import Transport
from thinwire.comm.ps import PSLayout, shard_bounds
from thinwire.errors import UserError
from thinwire.run import workloads
from thinwire.run.train import TrainConfig, run_training

STEPS = 12


def _train(rank, n, algorithm, transport=None, steps=STEPS, momentum=0.9, **params):
    """Train linreg (float64) on `n` workers; server ranks serve. Returns (role, flat params, trainer)."""
    wl = workloads.get("linreg")
    model = wl.model(0)
    opt = torch.optim.SGD(model.parameters(), lr=wl.lr, momentum=momentum)
    tr = Trainer(model, opt, algorithm=algorithm, transport=transport, **params)
    role = getattr(tr.algorithm, "role", "worker")
    if role == "server":
        tr.algorithm.serve()
    else:
        x, y = wl.shard(rank, n)
        loader = workloads.ShardLoader(x, y, wl.batch_size, seed=0, rank=rank)
        for _ in range(steps):
            xb, yb = loader.next()
            wl.loss(model(xb), yb).backward()
            tr.step()
            opt.zero_grad()
        tr.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return role, flat, tr


def _equivalences(rank, world_size):
    """3 workers + 1 server (K=1), and all-reduce among the 3 workers, on the same data."""
    out = {}
    n = world_size - 1
    group = dist.new_group(list(range(n)))
    if rank < n:
        _, ref, _ = _train(rank, n, "bsp", transport=Transport(group=group))
        out["allreduce"] = ref
    dist.barrier()
    role, ps, tr = _train(rank, n, "bsp", architecture="ps", servers=1)
    out["role"], out["bsp_ps"] = role, ps
    meter = tr.transport.meter.totals()
    out["sent"], out["recv"] = meter["bytes_sent"], meter["bytes_recv"]
    out["metrics"] = tr.metrics()
    _, out["ssp0"], _ = _train(rank, n, "ssp", staleness=0)
    _, out["ssp3"], tr = _train(rank, n, "ssp", staleness=3, momentum=0.0)
    out["ssp3_metrics"] = tr.metrics()
    _, out["ssp"], tr = _train(rank, n, "ssp")         # its defaults: s = 1, momentum 0.9
    out["ssp_metrics"] = tr.metrics()
    _, out["ssp_behind"], _ = _train(rank, n, "ssp", lookahead=False)
    _, out["backup"], tr = _train(rank, n, "backup", backups=1, momentum=0.0)
    out["backup_metrics"] = tr.metrics()
    _, out["topk"], tr = _train(rank, n, "bsp", architecture="ps", compressor="topk", ratio=0.25,
                                downlink_compressor="topk")
    out["topk_sent"] = tr.transport.meter.totals()["bytes_sent"]
    _, out["qsgd_down"], _ = _train(rank, n, "bsp", architecture="ps", downlink_compressor="qsgd")
    return out


def _two_servers(rank, world_size):
    """2 workers + 2 servers (K=2) against all-reduce among the 2 workers."""
    out = {}
    group = dist.new_group([0, 1])
    if rank < 2:
        out["allreduce"] = _train(rank, 2, "bsp", transport=Transport(group=group))[1]
    dist.barrier()
    role, out["bsp_ps"], tr = _train(rank, 2, "bsp", architecture="ps", servers=2)
    out["role"] = role
    out["metrics"] = tr.metrics()
    out["asp"] = _train(rank, 2, "asp", servers=2, steps=6)[1]
    return out


def _test_loss(flat):
    """linreg test MSE of the flat parameters (None: the initial model)."""
    wl = workloads.get("linreg")
    model = wl.model(0)
    if flat is not None:
        with torch.no_grad():
            model.weight.copy_(flat.view_as(model.weight))
    return wl.evaluate(model)


@pytest.fixture(scope="module")
def k1(pool4):
    return pool4.run(_equivalences, network="lan")


def test_shard_bounds_cover_every_parameter_once():
    for numel in (1, 2, 7, 16, 1000):
        for k in (1, 2, 3):
            if k > numel:
                continue
            b = shard_bounds(numel, k)
            covered = [i for lo, hi in b for i in range(lo, hi)]
            assert covered == list(range(numel))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1
    lay = PSLayout(16, 4, servers=2)
    assert (lay.workers, lay.server_rank(0), lay.server_rank(1)) == (2, 2, 3)
    assert [lay.is_server(r) for r in range(4)] == [False, False, True, True]


def test_bsp_on_ps_equals_bsp_on_allreduce(k1):
    workers = k1[:3]
    assert [r["role"] for r in k1] == ["worker"] * 3 + ["server"]
    for r in workers:
        assert torch.allclose(r["bsp_ps"], workers[0]["allreduce"], rtol=0, atol=1e-12)
        assert torch.equal(r["bsp_ps"], workers[0]["bsp_ps"])
    assert not torch.equal(workers[0]["bsp_ps"], torch.zeros(16))


def test_ssp_with_zero_staleness_equals_bsp_on_ps(k1):
    for r in k1[:3]:
        assert torch.equal(r["ssp0"], r["bsp_ps"])


def test_ssp_at_its_defaults_keeps_one_clock_in_flight(k1):
    # s = 1 (docs/ps.md: with momentum a gradient d steps stale trains only at an effective rate below ~1/d;
    # Ho et al. 2013, Theorem 1: the regret bound grows with √(s + 1)) and the look-ahead (DANA, Hakimi et al.
    # 2019): digits-mlp on 4 workers ended at 0.886 with s = 2, 0.931 with s = 1, 0.950 with the look-ahead too
    from thinwire import algorithms
    ssp = algorithms.get("ssp")
    assert ssp.staleness == 1 and ssp.lookahead is True
    for r in k1[:3]:      # the look-ahead moves the model the gradients are computed on (s = 0: not at all, above)
        assert not torch.equal(r["ssp"], r["ssp_behind"])
        assert _test_loss(r["ssp_behind"]) < 0.5 * _test_loss(None)
    server = k1[3]["ssp_metrics"]
    assert sum(server["staleness_hist"].values()) == 3 * STEPS and server["staleness_max"] <= 1
    assert _test_loss(k1[0]["ssp"]) < 0.5 * _test_loss(None)


def test_ssp_and_backup_run_and_record(k1):
    w = k1[0]
    # s = 3 lets workers run ahead on stale models; plain SGD still trains (12 steps: 23 -> ~2 for bsp)
    assert _test_loss(w["ssp3"]) < 0.5 * _test_loss(None)
    assert _test_loss(w["backup"]) < 0.5 * _test_loss(None)
    server = k1[3]["ssp3_metrics"]
    assert sum(server["staleness_hist"].values()) == 3 * STEPS
    assert server["staleness_max"] <= 3
    bk = k1[3]["backup_metrics"]
    assert bk["dropped"] + bk["ps_gradients"] == 3 * STEPS    # every gradient applied or dropped
    assert bk["ps_gradients"] <= 2 * bk["ps_updates"]          # a round takes the first 2 of 3


def test_server_bytes_show_the_incast(k1):
    workers, server = k1[:3], k1[3]
    pushed = sum(r["sent"] for r in workers)
    assert server["recv"] == pytest.approx(pushed)           # everything the workers sent arrived at the server
    assert server["sent"] == pytest.approx(sum(r["recv"] for r in workers))
    assert server["recv"] >= 3 * 16 * 8 * STEPS              # n gradients of N float64 per step
    assert server["metrics"]["ps_updates"] == STEPS


def test_compressed_uplink_and_downlink(k1):
    w = k1[0]
    assert torch.isfinite(w["topk"]).all()
    assert w["topk_sent"] < w["sent"]            # top 25 % (values + indices) is smaller than dense float64
    assert not torch.equal(w["topk"], w["bsp_ps"])


def test_unbiased_downlink_is_scaled_to_a_contraction(k1):
    """qsgd's E‖Q(v) − v‖² ≈ 1.5‖v‖²: unscaled, the server's residual grew without bound (issue 17: loss 1.6 →
    1.5e6); scaled by 1/(1 + ω) the residual r ← r − s·Q(r) shrinks, and bsp with a qsgd downlink descends."""
    from thinwire.compress import compressors
    from thinwire.compress.base import contraction
    from thinwire.exchange.ps import downlink_scale
    q = compressors.get("qsgd")
    omega = contraction(q)
    assert omega > 1.0 and downlink_scale(q) == pytest.approx(1.0 / (1.0 + omega))
    r = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    start = r.norm()
    for t in range(40):
        r = r - downlink_scale(q) * q.decompress(q.compress(r, key="d", step=t)).reshape(-1)
    assert r.norm() < 0.1 * start
    assert _test_loss(k1[0]["qsgd_down"]) < 0.9 * _test_loss(None)     # descends (23.3 -> 19.6 in 12 steps)


def test_two_servers_shard_the_model(pool4):
    res = pool4.run(_two_servers, network="lan")
    assert [r["role"] for r in res] == ["worker", "worker", "server", "server"]
    sizes = [r["metrics"]["ps_shard_size"] for r in res[2:]]
    assert sizes == [8, 8]
    for r in res[:2]:
        assert torch.allclose(r["bsp_ps"], res[0]["allreduce"], rtol=0, atol=1e-12)
        assert torch.isfinite(r["asp"]).all()


@pytest.mark.slow
def test_asp_converges_on_digits_and_reports_staleness(pool4):
    # the defaults (the workload's momentum 0.9; no --servers): the staleness-aware rate and the server's momentum
    # net of asynchrony's implicit one train it (0.96 measured; at 0.9 without them it ended at 0.16, issue 17)
    cfg = TrainConfig(workload="digits-mlp", algorithm="asp", workers=3, network="lan", progress=False)
    s = run_training(cfg, pool=pool4)
    assert s["servers"] == 1 and s["workers"] == 3
    # asynchronous: how stale each gradient is depends on the scheduling of the processes, so the accuracy varies
    # with the machine's load (0.96 idle, 0.87 with the suite running twice over); broken, it ended at 0.16
    assert s["final_accuracy"] >= 0.8
    m = s["algorithm_metrics"]
    assert sum(m["staleness_hist"].values()) == s["steps"]
    assert m["staleness_mean"] > 0           # other workers' updates land between a pull and the next push
    server = s["server_metrics"]
    assert server["ps_gradients"] == server["ps_updates"] == 3 * s["steps"]   # one update per gradient
    assert sum(server["staleness_hist"].values()) == 3 * s["steps"]
    assert s["bytes_sent_per_server"] > s["bytes_sent_per_worker"]


def test_invalid_combinations_are_rejected():
    from thinwire import algorithms
    with pytest.raises(UserError, match="parameter server only.*bsp or localsgd"):
        algorithms.get("ssp", architecture="allreduce")
    with pytest.raises(UserError, match="parameter server only.*all-reduce"):
        algorithms.get("asp", architecture="allreduce")
    with pytest.raises(UserError, match="parameter server only.*gossip use"):
        algorithms.get("ssp", architecture="gossip")
    with pytest.raises(UserError, match="servers >= 1"):
        algorithms.get("asp", servers=0)
    with pytest.raises(UserError, match="staleness"):
        algorithms.get("ssp", staleness=-1)
    with pytest.raises(UserError, match="architecture=ps"):
        algorithms.get("bsp", servers=1)
    with pytest.raises(UserError, match="valid"):
        algorithms.get("asp", downlink_compressor="nope")
    with pytest.raises(UserError, match="no worker"):
        PSLayout(16, 2, servers=2)
    with pytest.raises(UserError, match="--servers"):
        TrainConfig(algorithm="ssp", workers=3, servers=0).validate()
    with pytest.raises(UserError, match="--servers"):
        TrainConfig(algorithm="bsp", workers=3, servers=0, params={"architecture": "ps"}).validate()
    with pytest.raises(UserError, match="architecture"):
        TrainConfig(algorithm="bsp", workers=3, servers=1).validate()
    with pytest.raises(UserError, match="parameter server only.*for all-reduce use"):
        TrainConfig(algorithm="asp", workers=3, servers=1, params={"architecture": "allreduce"}).validate()
    with pytest.raises(UserError, match="no gradient to wait for"):
        from thinwire.algorithms.backup import Backup
        b = Backup(backups=3)
        b.world_size, b.servers = 4, 1
        b.setup()
