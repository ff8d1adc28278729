"""`async-diloco` (thinwire/algorithms/diloco_async.py): asynchronous DiLoCo on the parameter server with Delayed
Nesterov (Liu et al. 2024, arXiv 2401.09135) and the quorum rule (Decoupled DiLoCo, arXiv 2604.21428), each
checked against a float64 replay of the server's record; one worker at N = 1 against plain DiLoCo; bitwise
resume; workers that stop at different steps; a lost worker; the quorum without a slow worker."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import thinwire as tw
from thinwire import Trainer
from thinwire.algorithms.diloco_async import pack_aux, speed_of, steps_of
from thinwire.comm import Transport
from thinwire.comm.ps import shard_bounds
from thinwire.errors import UserError
from thinwire.net import parse_network
from thinwire.plan.costmodel import Scenario, predict
from thinwire.run import checkpoint, workloads
from thinwire.run.train import TrainConfig, train_worker

LR, BETA = 0.7, 0.9


def _train(rank, world, workers, steps, algorithm="async-diloco", transport=None, slow=None, lag=0.04, kill=None,
           **params):
    """linreg (float64) with AdamW inner steps; `steps` an int or one per worker. A server records every update
    it applies (wrapping `PSServer.update`), a worker every pushed Δ (wrapping its exchange's `start`)."""
    wl = workloads.get("linreg")
    model = wl.model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if world - workers:
        params["servers"] = world - workers
    tr = Trainer(model, opt, algorithm=algorithm, transport=transport, **params)
    alg = tr.algorithm
    if getattr(alg, "role", "worker") == "server":
        records, apply = [], alg.server.update

        def update(b, param, g, info):
            records.append({"b": b, "workers": info["workers"], "taus": info["taus"], "weights": info["weights"],
                            "parts": None if info["parts"] is None else [p.clone() for p in info["parts"]],
                            "g": g.clone()})
            apply(b, param, g, info)
        alg.server.update = update
        initial = [p.detach().clone() for p in alg.server.params]
        alg.serve()
        return {"role": "server", "records": records, "initial": initial, "keys": alg.server.keys,
                "final": [p.detach().clone() for p in alg.server.params], "metrics": tr.metrics(),
                "delay": alg.n_delay}
    pushed = []
    if algorithm == "async-diloco":
        start = alg.exchange.start

        def recording(tensor, key=None, shapes=None, inplace=False, aux=0):
            pushed.append((key, tensor.clone(), aux))
            return start(tensor, key, shapes, inplace, aux)
        alg.exchange.start = recording
    x, y = wl.shard(rank, workers)
    loader = workloads.ShardLoader(x, y, wl.batch_size, seed=0, rank=rank)
    for step in range(1, (steps if isinstance(steps, int) else steps[rank]) + 1):
        if kill == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)        # lost mid-run, without a word
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        if slow is not None:
            time.sleep(lag if rank == slow else 0.01)    # one worker slower than the others (4×, by default)
        tr.step()
        opt.zero_grad()
    tr.close()
    return {"role": "worker", "pushed": pushed, "metrics": tr.metrics(),
            "flat": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def _check_replay(res, workers, lr=LR, beta=BETA):
    """Every server's final slices equal a float64 replay of Delayed Nesterov over its record, each merged
    contribution is the Δ its worker pushed (compressor none: decoded exactly), every push was applied."""
    servers = res[workers:]
    for k, srv in enumerate(servers):
        n = srv["delay"]
        for b, key in enumerate(srv["keys"]):
            mine = {w: [d for kk, d, _ in res[w]["pushed"] if kk == key] for w in range(workers)}
            weights = {w: [steps_of(a) for kk, _, a in res[w]["pushed"] if kk == key] for w in range(workers)}
            taken = dict.fromkeys(range(workers), 0)
            theta, m, buf = srv["initial"][b].clone(), None, []
            for rec in (r for r in srv["records"] if r["b"] == b):
                parts = rec["parts"] or [rec["g"]]
                for w, s, part in zip(rec["workers"], rec["weights"], parts):
                    lo, hi = shard_bounds(mine[w][taken[w]].numel(), len(servers))[k]
                    assert torch.equal(part, mine[w][taken[w]][lo:hi]) and s == weights[w][taken[w]]
                    taken[w] += 1
                # the quorum's merge, Σ s_i Δ_i / Σ s_i
                g = sum(s * p for s, p in zip(rec["weights"], parts)) / sum(rec["weights"])
                assert (g - rec["g"]).abs().max() <= 1e-12
                buf.append((g, float(sum(rec["weights"]))))
                if len(buf) < n:                        # Delayed Nesterov (Liu et al. 2024): a plain step
                    theta = theta - lr * g / n
                    continue
                avg = sum(s * gg for gg, s in buf) / sum(s for _, s in buf)
                m = avg if m is None else beta * m + avg
                theta = theta - lr * (avg - sum(gg for gg, _ in buf[:-1]) / n + beta * m)
                buf = []
            assert (theta - srv["final"][b]).abs().max() <= 1e-12
            assert taken == {w: len(mine[w]) for w in range(workers)}     # nothing dropped, nothing left out
    return servers


def _replays(rank, world):
    out = {"async": _train(rank, world, 2, 13, period=3, overlap=1)}          # 2 workers, 2 servers, N = 2
    dist.barrier()
    out["four"] = _train(rank, world, 3, [9, 11, 13], period=2, delay=3)  # 3 workers, 1 server: steps differ
    dist.barrier()
    out["quorum"] = _train(rank, world, 3, 10, period=2, quorum=2, slow=2, delay=2)   # rounds without the slow one
    dist.barrier()
    out["dynamic"] = _train(rank, world, 3, 16, period=4, dynamic=True, slow=2)       # its period follows its speed
    dist.barrier()
    out["bounded"] = _train(rank, world, 3, 12, period=2, max_staleness=0)
    dist.barrier()
    out["grace"] = _train(rank, world, 3, 6, period=2, quorum=3, grace=0.02, slow=2, lag=0.25)  # the window
    return out


@pytest.fixture(scope="module")
def replays(pool4):
    return pool4.run(_replays, network="lan", timeout=120)


def test_delayed_nesterov_replays_the_servers_record(replays):
    servers = _check_replay([r["async"] for r in replays], 2)
    assert servers[0]["delay"] == 2 and sum(len(s["records"]) for s in servers) == 2 * 2 * 5   # 13 steps: 4 + 1
    stale = [t for s in servers for r in s["records"] for t in r["taus"]]
    assert max(stale) >= 1                       # the other worker's update landed in between
    # 13 steps at H = 3 push 4 full rounds and a last partial one of 1 step, weighted 3 : 1
    assert {steps_of(a) for _, _, a in replays[0]["async"]["pushed"]} == {3, 1}


def test_workers_that_stop_at_different_steps_end_and_replay(replays):
    res = [r["four"] for r in replays]
    (server,) = _check_replay(res, 3)
    assert [r["metrics"]["steps"] for r in res[:3]] == [9, 11, 13]
    for r in res[:3]:                 # every worker ends with the servers' final model (close() waits for it)
        assert torch.equal(r["flat"], server["final"][0])
    assert res[3]["metrics"]["ps_gradients"] == sum(r["metrics"]["pushes"] for r in res[:3]) == 5 + 6 + 7


def test_the_quorum_releases_rounds_without_the_slow_worker_and_merges_its_late_push(replays):
    res = [r["quorum"] for r in replays]
    (server,) = _check_replay(res, 3)
    rounds = server["records"]
    assert all(len(r["workers"]) <= 2 for r in rounds)                 # K = 2 of 3
    assert [0, 1] in [r["workers"] for r in rounds]                     # released without the slow worker
    # its push, which missed a round, merged into a later one with a fast worker's (τ >= 1: a round went by)
    assert any(len(r["workers"]) == 2 and 2 in r["workers"] and r["taus"][r["workers"].index(2)] >= 1
               for r in rounds)
    assert server["metrics"]["ps_gradients"] == 3 * 5 and "dropped" not in server["metrics"]
    # a quorum of all three with a 20 ms grace window: the first round goes without the slow worker (its first
    # push comes half a second after the others'), released by the window
    res = [r["grace"] for r in replays]
    (server,) = _check_replay(res, 3)
    assert 2 not in server["records"][0]["workers"] and server["metrics"]["ps_gradients"] == 3 * 3


def _against_diloco(rank, world):
    out = {}
    group = dist.new_group([0])
    if rank == 0:
        out["diloco"] = _train(0, 1, 1, 14, algorithm="diloco", transport=Transport(group=group), period=4,
                               outer_lr=0.7, outer_momentum=0.9)["flat"]     # async-diloco's outer settings
    dist.barrier()
    out["async"] = _train(rank, world, 1, 14, period=4)         # N = 1: one worker
    return out


def test_one_worker_at_n_1_is_plain_diloco_bitwise(pool2):
    res = pool2.run(_against_diloco, network="lan")
    assert res[1]["async"]["delay"] == 1
    assert torch.equal(res[0]["async"]["flat"], res[0]["diloco"])   # 3 periods and a last partial one (2 steps)


PS = dict(workload="linreg", workers=3, servers=1, steps=10, progress=False, algorithm="async-diloco")


def _run(pool, **kw):
    return pool.run(train_worker, TrainConfig(**kw).validate(), timeout=120)


@pytest.mark.parametrize("params, extra", [
    ({"period": 3, "quorum": 3, "overlap": 1}, {"compressor": "fp4", "memory": "residual"}),
    ({"period": 2, "quorum": 3, "delay": 2, "downlink_compressor": "topk"}, {}),
], ids=["quorum-overlap-fp4", "quorum-delay-topk-downlink"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(pool4, tmp_path, params, extra):
    """Every worker in every round (quorum = 3 of 3): the arrival order is fixed, so the run is reproducible and
    a resumed one equals it bitwise (the servers' momentum and buffer, the workers' anchors, an answer in flight
    under overlap, error feedback both ways)."""
    base = dict(PS, params=params, **extra)
    ck = str(tmp_path / "ck")
    sha = lambda res: [r["model_sha256"] for r in res if r["role"] == "worker"]
    plain = _run(pool4, **base)
    whole = _run(pool4, checkpoint_every=6, checkpoint_dir=ck, **base)
    assert sha(whole) == sha(plain)
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        assert json.load(f)["step"] == 6
    resumed = _run(pool4, resume=ck, **base)
    assert sha(resumed) == sha(whole)
    server = lambda res: next(r for r in res if r["role"] == "server")["metrics"]
    assert server(resumed)["ps_updates"] == server(whole)["ps_updates"]


def _lose_one(rank, world):
    return _train(rank, world, 3, 24, period=3, quorum=3, kill=(2, 8), on_failure="continue")


@pytest.mark.processes
def test_a_lost_worker_is_survived():
    """A worker SIGKILLed mid-run: the server stops waiting for it (a quorum of all three shrinks to the two left),
    the survivors finish every step and the server ends."""
    out = tw.launch(_lose_one, 4, on_failure="continue", network="lan", timeout=180)
    assert out[2] is None
    for r in (out[0], out[1]):
        assert r["metrics"]["steps"] == 24 and torch.equal(r["flat"], out[3]["final"][0])
    server = out[3]
    assert server["metrics"]["ps_gradients"] == out[0]["metrics"]["pushes"] + out[1]["metrics"]["pushes"] + \
        sum(2 in rec["workers"] for rec in server["records"])
    assert all(2 not in rec["workers"] for rec in server["records"][-3:])


def test_parameters_are_checked_and_declared():
    from thinwire import algorithms
    with pytest.raises(UserError, match="overlap"):
        algorithms.get("async-diloco", period=2, overlap=2)
    with pytest.raises(UserError, match="grace"):
        algorithms.get("async-diloco", grace=1.0)
    with pytest.raises(UserError, match="parameter server only|architecture"):
        algorithms.get("async-diloco", architecture="allreduce")
    with pytest.raises(UserError, match="quorum=5 exceeds"):
        TrainConfig(**dict(PS, params={"quorum": 5})).validate()
    cls = algorithms.registry.lookup("async-diloco")
    assert cls.pace == "free" and cls.survives_failures and cls.cost.family == "async"
    assert pack_aux(7, 12.3456) and steps_of(pack_aux(7, 12.3456)) == 7 and speed_of(pack_aux(7, 12.3456)) == 12346
    row = next(r for r in algorithms.registry.describe() if r["name"] == "async-diloco")
    assert {"period", "delay", "max_staleness", "quorum", "grace", "dynamic", "overlap"} <= set(row["parameters"])
    # the planner: per worker τ + its push and pull every H steps, bounded by the servers' link; overlap hides it
    s = Scenario(params=1e6, compute_s=0.1, link=parse_network("wan"), workers=4, servers=4)
    own = 2 * s.link.alpha + 2 * s.nbytes * s.link.beta      # one worker's push and pull of the model
    assert predict(s, "async-diloco", period=10).iteration_s == pytest.approx(0.1 + own / 10)
    s.servers = 1                                             # one server's link carries all four
    assert predict(s, "async-diloco", period=10).iteration_s == pytest.approx(4 * 2 * s.nbytes * s.link.beta / 10)
    s.servers = 4
    assert predict(s, "async-diloco", period=10, overlap=1).iteration_s < predict(s, "async-diloco",
                                                                                  period=10).iteration_s
    assert predict(s, "async-diloco", period=50).collective == "ps"


def test_dynamic_local_updates_shorten_the_slow_workers_period(replays):
    """Liu et al. 2024 §4.2: H_i = max(1, round(H v_i / max_j v_j)); the slow worker (4× slower) pushes after fewer
    inner steps, weighted by them in Delayed Nesterov's average (the replay checks the weights)."""
    res = [r["dynamic"] for r in replays]
    _check_replay(res, 3)
    full = lambda w: [steps_of(a) for _, _, a in res[w]["pushed"][:-1]]     # (the last one: close()'s rest)
    assert max(full(0)) == 4 and min(full(2)) < 4 and res[2]["metrics"]["period_now"] < 4
    assert sum(full(2)) / len(full(2)) < sum(full(0)) / len(full(0))
    assert all(speed_of(a) > 0 for _, _, a in res[2]["pushed"][1:])


def test_a_push_older_than_max_staleness_is_dropped_and_counted(replays):
    res = [r["bounded"] for r in replays]
    server = res[3]
    assert all(t == 0 for rec in server["records"] for t in rec["taus"])
    pushes = sum(r["metrics"]["pushes"] for r in res[:3])
    assert server["metrics"]["ps_gradients"] + server["metrics"]["dropped"] == pushes == 3 * 6
    assert sum(r["metrics"].get("dropped", 0) for r in res[:3]) == server["metrics"]["dropped"]
