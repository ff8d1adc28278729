"""DTS (Zhu, Lu, Lin, Han 2019, "Distributed Training Across the World", §3): delayed, temporally sparse and
combined updates with error compensation, and `local`.

Exactness on `linreg` in float64 against single-process simulations written here: eq. 3 (delayed), eq. 4 /
model averaging (temporally sparse), the momentum compensation, and the replay property (after close() every
worker holds what synchronous momentum SGD reaches with the averaged gradients). End to end over 4 gloo workers.
"""
from __future__ import annotations

import copy

import pytest
import torch

from thinwire import algorithms
from thinwire.errors import UserError
from thinwire.run import workloads

N, STEPS = 4, 13
LR = 0.05


# -- what runs in every worker -------------------------------------------------------------------------
def _trainer(rank, world, algorithm, params, momentum, compressor=None, **kw):
    from thinwire import Trainer
    wl = workloads.get("linreg")
    model = wl.model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, **kw)
    x, y = wl.shard(rank, world)
    loader = workloads.ShardLoader(x, y, wl.batch_size, seed=0, rank=rank)
    return Trainer(model, opt, algorithm=algorithm, compressor=compressor, **params), model, loader


def _steps(trainer, model, loader, n):
    wl = workloads.get("linreg")
    for _ in range(n):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        trainer.step()
        trainer.optimizer.zero_grad()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _run(rank, world, algorithm, params, momentum, steps=STEPS, compressor=None):
    tr, model, loader = _trainer(rank, world, algorithm, params, momentum, compressor)
    _steps(tr, model, loader, steps)
    tr.close()
    return _flat(model), tr.metrics()


CASES = [  # (algorithm, params, momentum)
    ("bsp", {}, 0.0), ("bsp", {}, 0.9),
    ("dts", {"delay": 1, "period": 1}, 0.0), ("dts", {"delay": 1, "period": 1}, 0.9),
    ("delayed", {"delay": 2}, 0.0), ("delayed", {"delay": 3}, 0.0), ("delayed", {"delay": 5}, 0.0),
    ("delayed", {"delay": 3}, 0.9),
    ("tsparse", {"period": 3}, 0.0), ("tsparse", {"period": 4}, 0.9),
    ("dts", {"delay": 3, "period": 2}, 0.0), ("dts", {"delay": 2, "period": 3}, 0.9),
    ("local", {}, 0.0),
]


def _equivalences(rank, world):
    out = {f"{a}{sorted(p.items())}{m}": _run(rank, world, a, p, m) for a, p, m in CASES}
    if "localsgd" in algorithms.names():   # helper's local SGD, averaging every 3 steps (12 = 4 windows)
        period = next(k for k in ("period", "h", "k", "tau") if algorithms.registry.accepts("localsgd", k))
        out["localsgd"] = _run(rank, world, "localsgd", {period: 3}, 0.0, steps=12)
        out["tsparse12"] = _run(rank, world, "tsparse", {"period": 3}, 0.0, steps=12)
    return out


def _checkpoint(rank, world):
    """Interrupt after 7 steps (two averages in flight, a partial window), resume in a fresh trainer."""
    params = {"delay": 3, "period": 2}
    whole, _ = _run(rank, world, "dts", params, 0.9)
    tr, model, loader = _trainer(rank, world, "dts", params, 0.9)
    _steps(tr, model, loader, 7)
    in_flight = len(tr.algorithm._flight)
    state = copy.deepcopy(tr.state_dict())
    loader_state = loader.state_dict()
    _steps(tr, model, loader, 2)            # the interrupted run goes on a little: must not matter
    tr2, model2, loader2 = _trainer(rank, world, "dts", params, 0.9)
    tr2.load_state_dict(state)
    loader2.load_state_dict(loader_state)
    _steps(tr2, model2, loader2, STEPS - 7)
    tr2.close()
    tr.close()
    wrong = None
    try:
        tr3, _, _ = _trainer(rank, world, "dts", {"delay": 2, "period": 2}, 0.9)
        tr3.load_state_dict(state)
    except UserError as e:
        wrong = str(e)
    return {"whole": whole, "resumed": _flat(model2), "in_flight": in_flight, "wrong": wrong}


def _jitter(rank, world):
    """Same run on a jittery link: later averages may come later, never reordered: same numbers. Then
    "none" and the first other compressor the exchange takes (helper B is extending it to all)."""
    from thinwire.compress import compressors
    out = {"jitter": _run(rank, world, "dts", {"delay": 3, "period": 2}, 0.9)[0], "ran": []}
    for c in ["none"] + [c for c in ("topk", "fp16", "qsgd", "randomk", "signsgd") if c in compressors.names()]:
        try:
            out[c] = _run(rank, world, "dts", {"delay": 2, "period": 2}, 0.9, compressor=c)
        except UserError:
            continue
        out["ran"].append(c)
        if len(out["ran"]) == 2:
            break
    errors = {}
    for name, kw in [("adam", None), ("nesterov", {"nesterov": True}), ("dampening", {"dampening": 0.5})]:
        try:
            if kw is None:
                from thinwire import Trainer
                m = torch.nn.Linear(2, 1)
                Trainer(m, torch.optim.Adam(m.parameters()), algorithm="dts")
            else:
                _trainer(rank, world, "dts", {}, 0.9, **kw)
        except UserError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def _lr_factor(step):
    """A warm-up then a decay, per optimizer step (the shape of the DTS paper's warm-up + cosine schedule)."""
    return (step + 1) / 4 if step < 3 else 0.7 ** (step - 3)


SCHEDULED = [("dts", {"delay": 2, "period": 3}, 0.9), ("dts", {"delay": 2, "period": 2}, 0.0),
             ("delayed", {"delay": 3}, 0.9), ("tsparse", {"period": 4}, 0.9)]


def _scheduled(rank, world):
    """Runs with a LambdaLR schedule stepped after every trainer step: the rate changes inside windows."""
    out = {}
    for a, params, m in SCHEDULED:
        tr, model, loader = _trainer(rank, world, a, params, m)
        sched = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, _lr_factor)
        wl = workloads.get("linreg")
        for _ in range(STEPS):
            xb, yb = loader.next()
            wl.loss(model(xb), yb).backward()
            tr.step()
            tr.optimizer.zero_grad()
            sched.step()
        tr.close()
        out[f"{a}{sorted(params.items())}{m}"] = _flat(model)
    return out


# -- single-process references ------------------------------------------------------------------------
def _grad(w, xb, yb):
    w = w.clone().requires_grad_(True)
    loss = torch.nn.functional.mse_loss((xb @ w.view(-1, 1)).reshape(-1), yb)
    loss.backward()
    return w.grad.detach()


def _loaders(world):
    wl = workloads.get("linreg")
    return [workloads.ShardLoader(*wl.shard(r, world), wl.batch_size, seed=0, rank=r) for r in range(world)]


def _w0():
    return _flat(workloads.get("linreg").model(0))


def simulate(world, steps, mu, t, p, lr=LR):
    """DTS per step and per worker: local step (eq. 2); at s = (k+t-1)p the average of each step i of
    window k replaces the local gradient (eqs. 3-4), propagated through momentum:
    b += μ^{s-i} e_i, w -= Σ_{r=i}^{s} γ_r μ^{r-i} e_i, e_i = ḡ_i - g_{i,j} (γ_r: the rate step r used; `lr`
    is one rate or one per step). close(): all remaining windows at the last step. Returns the final models
    and the per-step averaged gradients."""
    lrs = lr if isinstance(lr, list) else [lr] * steps
    loaders = _loaders(world)
    w = [_w0() for _ in range(world)]
    b = [torch.zeros_like(w[0]) for _ in range(world)]
    grads = []

    def compensate(k, s):
        for i in range((k - 1) * p + 1, min(k * p, steps) + 1):
            gbar = sum(grads[i - 1]) / world
            for j in range(world):
                e = gbar - grads[i - 1][j]
                b[j] += mu ** (s - i) * e
                w[j] -= sum(lrs[r - 1] * mu ** (r - i) for r in range(i, s + 1)) * e

    applied = 0
    for s in range(1, steps + 1):
        batches = [ld.next() for ld in loaders]
        gs = [_grad(w[j], *batches[j]) for j in range(world)]
        grads.append(gs)
        for j in range(world):
            b[j] = mu * b[j] + gs[j]
            w[j] = w[j] - lrs[s - 1] * b[j]
        if s % p == 0 and s // p >= t:
            applied += 1
            compensate(applied, s)
    for k in range(applied + 1, -(-steps // p) + 1):
        compensate(k, steps)
    return w, [sum(g) / world for g in grads]


def replay(gbars, mu, lr=LR):
    """Synchronous momentum SGD fed with the given averaged gradients (one rate, or one per step)."""
    lrs = lr if isinstance(lr, list) else [lr] * len(gbars)
    w, b = _w0(), torch.zeros_like(_w0())
    for g, rate in zip(gbars, lrs):
        b = mu * b + g
        w = w - rate * b
    return w


def model_averaging(world, steps, p, lr=LR):
    """Local SGD: vanilla SGD steps alone, models averaged every p steps and at the end."""
    loaders = _loaders(world)
    w = [_w0() for _ in range(world)]
    for s in range(1, steps + 1):
        batches = [ld.next() for ld in loaders]
        w = [w[j] - lr * _grad(w[j], *batches[j]) for j in range(world)]
        if s % p == 0 or s == steps:
            avg = sum(w) / world
            w = [avg.clone() for _ in range(world)]
    return w


# -- tests -----------------------------------------------------------------------------------------------
def close(a, b, tol=1e-11):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def test_construction_errors():
    for bad in ({"delay": 0}, {"period": 0}, {"delay": 1.5}, {"period": "x"}):
        with pytest.raises(UserError, match=">= 1|integer"):
            algorithms.get("dts", **bad)
    assert algorithms.get("dts", delay="3", period="2").period == 2
    assert algorithms.get("delayed", delay=5).period == 1
    assert algorithms.get("tsparse", period=5).delay == 1
    assert not algorithms.registry.lookup("local").compression


def test_equivalences_exact(pool4):
    res = pool4.run(_equivalences)
    get = lambda a, p, m: [r[f"{a}{sorted(p.items())}{m}"] for r in res]
    # every worker identical after close() (except `local`, which never communicates)
    for a, p, m in CASES:
        runs = get(a, p, m)
        same = all(close(runs[0][0], r[0], 1e-13) for r in runs)
        assert same == (a != "local"), (a, p, m)
    # t = p = 1 is bsp, vanilla and momentum
    for m in (0.0, 0.9):
        assert close(get("dts", {"delay": 1, "period": 1}, m)[0][0], get("bsp", {}, m)[0][0])
    # delayed update for several t against eq. 3 simulated step by step; with momentum too
    for t, m in ((2, 0.0), (3, 0.0), (5, 0.0), (3, 0.9)):
        sim, gbars = simulate(N, STEPS, m, t, 1)
        runs = get("delayed", {"delay": t}, m)
        for j in range(N):
            assert close(runs[j][0], sim[j]), (t, m, j)
        assert close(sim[0], replay(gbars, m))        # compensation = synchronous SGD on the averages
        assert runs[0][1]["max_in_flight"] == t - 1 and runs[0][1]["averages_applied"] == STEPS
    # temporally sparse with vanilla SGD = local SGD with model averaging every p steps (eq. 4)
    avg = model_averaging(N, STEPS, 3)
    for j, r in enumerate(get("tsparse", {"period": 3}, 0.0)):
        assert close(r[0], avg[j])
    # momentum tsparse and the combination, against the simulation and the replay
    for a, p, m, (t, per) in (("tsparse", {"period": 4}, 0.9, (1, 4)), ("dts", {"delay": 3, "period": 2}, 0.0, (3, 2)),
                               ("dts", {"delay": 2, "period": 3}, 0.9, (2, 3))):
        sim, gbars = simulate(N, STEPS, m, t, per)
        runs = get(a, p, m)
        assert all(close(runs[j][0], sim[j]) for j in range(N)), (a, p, m)
        assert close(runs[0][0], replay(gbars, m)), (a, p, m)
        assert runs[0][1]["max_in_flight"] == t - 1
        assert runs[0][1]["averages_launched"] == -(-STEPS // per)
    # delayed and sparse differ from bsp (the tests above are not vacuous)
    assert not close(get("delayed", {"delay": 3}, 0.0)[0][0], get("bsp", {}, 0.0)[0][0], 1e-6)
    # `local`: each worker is plain SGD on its own shard
    loaders = _loaders(N)
    for j, r in enumerate(get("local", {}, 0.0)):
        w = _w0()
        for _ in range(STEPS):
            w = w - LR * _grad(w, *loaders[j].next())
        assert close(r[0], w)
        assert r[1]["bytes_sent"] == 0
    if "localsgd" in res[0]:
        for r in res:
            assert close(r["localsgd"][0], r["tsparse12"][0])


def test_checkpoint_resume_with_averages_in_flight(pool4):
    for r in pool4.run(_checkpoint):
        assert r["in_flight"] == 2
        assert torch.equal(r["whole"], r["resumed"])
        assert r["wrong"] and "delay=3" in r["wrong"]


def test_jitter_compressors_and_errors(pool4):
    lan = pool4.run(_run, "dts", {"delay": 3, "period": 2}, 0.9)
    res = pool4.run(_jitter, network="custom:bandwidth=1gbit,latency=3ms,jitter=3ms")
    assert res[0]["ran"][0] == "none"
    for r, ref in zip(res, lan):
        assert torch.equal(r["jitter"], ref[0])
        for c in r["ran"]:
            w, m = r[c]
            assert torch.isfinite(w).all() and m["averages_applied"] == m["averages_launched"] == 7
            assert close(w, res[0][c][0], 1e-9), c   # same model on every worker after close()
        assert set(r["errors"]) == {"adam", "nesterov", "dampening"}
    assert res[0]["none"][1]["bytes_sent"] > 0


@pytest.mark.slow
def test_cli_train_dts(tmp_path):
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "linreg", "--algorithm", "dts",
                          "--delay", "3", "--period", "2", "--compressor", "none", "--workers", "2",
                          "--steps", "20", "--json", "--network", "custom:latency=5ms"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout[out.stdout.index("{"):])
    assert s["algorithm_metrics"]["averages_applied"] == 10 and s["final_loss"] < 1.0


def test_learning_rate_schedule_exact(pool4):
    """With a schedule the compensation must use the rate each step of the window used, not the rate at the
    time of the compensation: otherwise workers keep Σ (γ_i - γ_s) g_{i,j} of their own and never agree."""
    res = pool4.run(_scheduled)
    lrs = [LR * _lr_factor(s) for s in range(STEPS)]
    for a, params, m in SCHEDULED:
        runs = [r[f"{a}{sorted(params.items())}{m}"] for r in res]
        assert all(close(runs[0], r, 1e-13) for r in runs), (a, params, m)   # same model everywhere
        t, p = params.get("delay", 1), params.get("period", 1)
        sim, gbars = simulate(N, STEPS, m, t, p, lr=lrs)
        assert all(close(runs[j], sim[j]) for j in range(N)), (a, params, m)
        assert close(sim[0], replay(gbars, m, lrs)), (a, params, m)


WD = 0.05
DECAYED = [("dts", {"delay": 2, "period": 3}, 0.9), ("delayed", {"delay": 3}, 0.9), ("tsparse", {"period": 4}, 0.9),
           ("dts", {"delay": 3, "period": 2}, 0.0), ("delayed", {"delay": 2}, 0.0)]


def _decayed(rank, world):
    """Runs with weight decay (folded into the compensation), and a float32 model without it (bitwise equal
    models after close())."""
    out = {}
    for a, params, m in DECAYED:
        tr, model, loader = _trainer(rank, world, a, params, m, weight_decay=WD)
        _steps(tr, model, loader, STEPS)
        tr.close()
        out[f"{a}{sorted(params.items())}{m}"] = _flat(model)
    wl = workloads.get("digits-mlp")
    for a, params in (("dts", {"delay": 2, "period": 2}), ("delayed", {"delay": 3}), ("tsparse", {"period": 3})):
        from thinwire import Trainer
        model = wl.model(0)
        opt = torch.optim.SGD(model.parameters(), lr=wl.lr, momentum=0.9)
        tr = Trainer(model, opt, algorithm=a, **params)
        loader = workloads.ShardLoader(*wl.shard(rank, world), wl.batch_size, seed=0, rank=rank)
        for _ in range(9):
            xb, yb = loader.next()
            wl.loss(model(xb), yb).backward()
            tr.step()
            opt.zero_grad()
        tr.close()
        out[f"fp32 {a}"] = (_flat(model), torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                                                      for p in model.parameters()]))
    return out


def simulate_decay(world, steps, mu, t, p, lam, lr=LR):
    """As `simulate`, with weight decay λ (PyTorch: b ← μ b + g + λ w, w ← w − γ b): the difference e_i makes
    at step i, (Δw, Δb) = (−γ_i e_i, e_i), is carried step by step, Δb' = μ Δb + λ Δw, Δw' = Δw − γ Δb'."""
    loaders = _loaders(world)
    w = [_w0() for _ in range(world)]
    b = [torch.zeros_like(w[0]) for _ in range(world)]
    grads = []

    def compensate(k, s):
        for i in range((k - 1) * p + 1, min(k * p, steps) + 1):
            gbar = sum(grads[i - 1]) / world
            for j in range(world):
                e = gbar - grads[i - 1][j]
                dw, db = -lr * e, e
                for _ in range(i + 1, s + 1):
                    db = mu * db + lam * dw
                    dw = dw - lr * db
                w[j] += dw
                b[j] += db

    applied = 0
    for s in range(1, steps + 1):
        batches = [ld.next() for ld in loaders]
        gs = [_grad(w[j], *batches[j]) for j in range(world)]
        grads.append(gs)
        for j in range(world):
            b[j] = mu * b[j] + gs[j] + lam * w[j]
            w[j] = w[j] - lr * b[j]
        if s % p == 0 and s // p >= t:
            applied += 1
            compensate(applied, s)
    for k in range(applied + 1, -(-steps // p) + 1):
        compensate(k, steps)
    return w, [sum(g) / world for g in grads]


def replay_decay(gbars, mu, lam, lr=LR):
    w, b = _w0(), torch.zeros_like(_w0())
    for g in gbars:
        b = mu * b + g + lam * w
        w = w - lr * b
    return w


def test_weight_decay_folded_into_the_compensation(pool4):
    """Weight decay couples the weights into the momentum buffer: the compensation carries a window's difference
    with the 2×2 step matrices [[1 − γλ, −γμ], [λ, μ]] (docs/dts.md), so every worker ends with the model
    synchronous momentum SGD with weight decay reaches on the averaged gradients (before: the workers ended
    apart, up to 6.6e-2 on digits-mlp). And close() leaves bitwise-identical float32 models and buffers."""
    res = pool4.run(_decayed)
    for a, params, m in DECAYED:
        runs = [r[f"{a}{sorted(params.items())}{m}"] for r in res]
        t, p = params.get("delay", 1), params.get("period", 1)
        sim, gbars = simulate_decay(N, STEPS, m, t, p, WD)
        assert all(close(runs[j], sim[j], 1e-10) for j in range(N)), (a, params, m)
        assert close(sim[0], replay_decay(gbars, m, WD), 1e-10), (a, params, m)
        assert not close(replay_decay(gbars, m, WD), replay_decay(gbars, m, 0.0), 1e-6)   # λ mattered
    for a in ("dts", "delayed", "tsparse"):
        w0, b0 = res[0][f"fp32 {a}"]
        assert w0.dtype == torch.float32
        for r in res[1:]:
            assert torch.equal(r[f"fp32 {a}"][0], w0) and torch.equal(r[f"fp32 {a}"][1], b0), a


def test_accuracy_benchmark_table():
    """`thinwire bench dts-accuracy`'s table: Δ vs bsp per momentum, in percentage points."""
    from thinwire.bench.dts_accuracy import markdown
    row = lambda a, m, acc: {"workload": "digits-cnn", "momentum": m, "algorithm": a, "accuracy": acc,
                             "min": acc - 0.01, "max": acc + 0.01}
    table = markdown({"workers": 4, "steps": 80, "seeds": [0, 1],
                      "rows": [row("bsp", 0.9, 0.96), row("dts(delay=2,period=20)", 0.9, 0.90), row("bsp", 0.0, 0.7)]})
    assert "| dts(delay=2,period=20) | 0.9000 [0.890, 0.910] | -6.0 |  |  |" in table
    assert "| bsp | 0.9600 [0.950, 0.970] | +0.0 | 0.7000 [0.690, 0.710] | +0.0 |" in table
