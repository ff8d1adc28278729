"""DES-LOC (`desloc`): construction and the optimizers it refuses, a single-process replay of the paper's equations
(Iacob et al. 2025, arXiv 2505.22549, Alg. 1: local Adam, parameters and both moments averaged on periods of their
own) equal to the run to 1e-12 in float64 on 2 and 4 gloo workers, bitwise resume, the planner's bytes per step,
and the paths a user takes: `tw.Trainer`, `tw.attach`, the Lightning strategy, `thinwire train` and `compare`."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from thinwire import algorithms
from thinwire.errors import UserError
from thinwire.run import workloads

ADAMW = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


# -- construction (single process) ----------------------------------------------------------------------------
def test_defaults_are_the_papers_and_bad_parameters_fail():
    d = algorithms.get("desloc")
    assert (d.kx, d.ku, d.kv) == (256, 768, 1536)           # K_u = 3 K_x, K_v = 6 K_x
    a = algorithms.get("desloc", period="4", period_u="6", period_v="10")
    assert (a.kx, a.ku, a.kv) == (4, 6, 10) and algorithms.get("desloc", period=8).kv == 48
    for bad in ({"period": 0}, {"period_u": 0}, {"period_v": -2}, {"period": 2.5}, {"architecture": "ps"}):
        with pytest.raises(UserError):
            algorithms.get("desloc", **bad)


def test_an_optimizer_without_adams_moments_is_refused_in_one_line():
    d = algorithms.get("desloc")
    p = [torch.nn.Parameter(torch.zeros(3))]
    d.check_run(4, torch.optim.AdamW(p))
    d.check_run(4, torch.optim.Adam(p))
    for opt, match in ((torch.optim.SGD(p, lr=0.1, momentum=0.9), "got optimizer SGD; valid: .*AdamW"),
                       (torch.optim.AdamW(p, amsgrad=True), "amsgrad=False")):
        with pytest.raises(UserError, match=match) as e:
            d.check_run(4, opt)
        assert "\n" not in str(e.value)
    from thinwire.run.train import TrainConfig        # before any worker starts: the run's optimizer kind
    with pytest.raises(UserError, match="--optimizer adamw"):
        TrainConfig(workload="digits-mlp", algorithm="desloc", workers=2, progress=False).validate()
    TrainConfig(workload="digits-mlp", algorithm="desloc", workers=2, optimizer="adamw", progress=False).validate()


def test_the_planner_counts_n_over_each_period_and_tunes_k_x():
    from thinwire.net import parse_network
    from thinwire.plan.advise import tune
    from thinwire.plan.costmodel import Scenario, predict
    s = Scenario(params=1e6, compute_s=0.1, link=parse_network("world"), workers=4)
    bsp = predict(s, "bsp")
    for kx, ku, kv in ((256, None, None), (8, 8, 8), (4, 12, 48)):
        p = predict(s, "desloc", period=kx, period_u=ku, period_v=kv)
        ku, kv = ku or 3 * kx, kv or 6 * kx
        assert p.bytes_per_step == pytest.approx(bsp.bytes_per_step * (1 / kx + 1 / ku + 1 / kv))
        assert p.iteration_s == pytest.approx(0.1 + (bsp.iteration_s - 0.1) * (1 / kx + 1 / ku + 1 / kv))
    assert predict(s, "bsp").bytes_per_step / predict(s, "desloc").bytes_per_step == pytest.approx(1536 / 9)
    local_adam = predict(s, "desloc", period=256, period_u=256, period_v=256)
    assert local_adam.bytes_per_step / predict(s, "desloc").bytes_per_step == pytest.approx(2.0)
    far, _ = tune("desloc", s)
    near, _ = tune("desloc", Scenario(params=1e6, compute_s=0.1, link=parse_network("lan"), workers=4))
    assert near == {"period": 1} and far["period"] > 8     # the least stale K_x the link allows


# -- what runs in every worker -----------------------------------------------------------------------------------
def _model(kind: str) -> torch.nn.Module:
    if kind == "linreg":
        return workloads.get("linreg").model(0)
    torch.manual_seed(0)          # float64, 6 parameter tensors, on linreg's 16 inputs
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _setup(rank, world, params, model="linreg", **kw):
    from thinwire import Trainer
    wl = workloads.get("linreg")
    m = _model(model)
    opt = torch.optim.AdamW(m.parameters(), **ADAMW)
    loader = workloads.ShardLoader(*wl.shard(rank, world), 16, seed=0, rank=rank)
    return Trainer(m, opt, algorithm="desloc", **params, **kw), m, loader


def _steps(trainer, model, loader, n):
    wl = workloads.get("linreg")
    for _ in range(n):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        trainer.step()
        trainer.optimizer.zero_grad()


def _run(rank, world, params, steps, model="linreg", **kw):
    tr, m, loader = _setup(rank, world, params, model, **kw)
    _steps(tr, m, loader, steps)
    before = _flat(m)
    tr.close()
    return before, _flat(m), tr.metrics()


REPLAYS = {   # name -> (model, params, steps)
    "K_x=2 K_u=3 K_v=5": ("linreg", {"period": 2, "period_u": 3, "period_v": 5}, 13),
    "local Adam K=3": ("mlp", {"period": 3, "period_u": 3, "period_v": 3}, 10),
    "the paper's ratios K_x=2": ("mlp", {"period": 2}, 14),
    "buckets, fusion": ("mlp", {"period": 3, "period_u": 2, "period_v": 4, "bucket_mb": 0.0005,
                                "first_bucket_mb": 0.0005}, 11),
    "no overlap": ("mlp", {"period": 2, "period_u": 4, "period_v": 3, "schedule": "none"}, 9),
}


def _replays(rank, world):
    return {name: _run(rank, world, params, steps, model) for name, (model, params, steps) in REPLAYS.items()}


def replay(model, params, steps, n):
    """DES-LOC for n workers in one process, from the paper's equations: each worker's AdamW step written out
    (decoupled weight decay, bias-corrected moments), then u, v and x averaged when t ≡ 0 mod K_u, K_v, K_x;
    close() averages x once more if steps were taken since. Returns (the models before close, after close)."""
    kx = params["period"]
    ku, kv = params.get("period_u", 3 * kx), params.get("period_v", 6 * kx)
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    wl = workloads.get("linreg")
    loaders = [workloads.ShardLoader(*wl.shard(r, n), 16, seed=0, rank=r) for r in range(n)]
    models = [_model(model) for _ in range(n)]
    ps = [list(m.parameters()) for m in models]
    u = [[torch.zeros_like(p) for p in ps[r]] for r in range(n)]
    v = [[torch.zeros_like(p) for p in ps[r]] for r in range(n)]

    def average(tensors):            # tensors[r][k]: every worker's k-th tensor becomes the mean over workers
        for k in range(len(tensors[0])):
            mean = sum(tensors[r][k] for r in range(n)) / n
            for r in range(n):
                tensors[r][k].copy_(mean)

    for t in range(1, steps + 1):
        for r in range(n):
            xb, yb = loaders[r].next()
            grads = torch.autograd.grad(wl.loss(models[r](xb), yb), ps[r])
            with torch.no_grad():
                for p, g, m1, m2 in zip(ps[r], grads, u[r], v[r]):
                    p.mul_(1 - lr * wd)
                    m1.mul_(b1).add_((1 - b1) * g)
                    m2.mul_(b2).add_((1 - b2) * g * g)
                    p.sub_(lr * (m1 / (1 - b1 ** t)) / ((m2 / (1 - b2 ** t)).sqrt() + eps))
        with torch.no_grad():
            for due, state in ((t % ku == 0, u), (t % kv == 0, v), (t % kx == 0, [list(p) for p in ps])):
                if due:
                    average(state)
    before = [torch.cat([p.detach().reshape(-1) for p in ps[r]]) for r in range(n)]
    with torch.no_grad():
        if steps % kx:
            average([list(p) for p in ps])
    return before, [torch.cat([p.detach().reshape(-1) for p in ps[r]]) for r in range(n)]


def close(a, b, tol=1e-12):
    return torch.allclose(a, b, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("world", [2, 4])
def test_equals_a_replay_of_the_papers_equations(world, pool2, pool4):
    results = (pool2 if world == 2 else pool4).run(_replays)
    assert results[0]["local Adam K=3"][0].dtype == torch.float64
    for name, (model, params, steps) in REPLAYS.items():
        before, after = replay(model, params, steps, world)
        for rank, r in enumerate(results):
            got = r[name]
            assert close(got[0], before[rank]), (name, rank, float((got[0] - before[rank]).abs().max()))
            assert close(got[1], after[rank]), (name, rank)
        assert all(torch.equal(results[0][name][1], r[name][1]) for r in results[1:]), name  # one model at the end
        m = results[0][name][2]
        assert (m["syncs"], m["syncs_u"], m["syncs_v"]) == (steps // m["period"], steps // m["period_u"],
                                                             steps // m["period_v"]), name
    # between averages the workers' models differ (local steps on their own shards)
    k = REPLAYS["K_x=2 K_u=3 K_v=5"][2]
    assert k % 2 and not torch.equal(results[0]["K_x=2 K_u=3 K_v=5"][0], results[1]["K_x=2 K_u=3 K_v=5"][0])
    assert results[0]["buckets, fusion"][2]["schedule"]["buckets"] > 1


# -- checkpoints: a resumed run equals the uninterrupted one ----------------------------------------------------
RESUME = {"period": 2, "period_u": 3, "period_v": 4, "compressor": "topk", "ratio": 0.3, "memory": "residual"}


def _resume(rank, world, at, steps):
    whole = _run(rank, world, RESUME, steps, "mlp")
    tr, m, loader = _setup(rank, world, RESUME, "mlp")
    _steps(tr, m, loader, at)
    state, ls = copy.deepcopy(tr.state_dict()), loader.state_dict()
    tr.close()
    tr2, m2, loader2 = _setup(rank, world, RESUME, "mlp")
    tr2.load_state_dict(state)
    loader2.load_state_dict(ls)
    _steps(tr2, m2, loader2, steps - at)
    before = _flat(m2)
    tr2.close()
    wrong = None
    try:
        _setup(rank, world, {**RESUME, "period_v": 8}, "mlp")[0].load_state_dict(state)
    except UserError as e:
        wrong = str(e)
    return {"whole": whole[:2], "resumed": (before, _flat(m2)), "wrong": wrong}


def test_checkpoint_resume_is_bitwise(pool2):
    for r in pool2.run(_resume, 7, 13):     # step 7: between every period's averages, residuals held
        assert torch.equal(r["whole"][0], r["resumed"][0]) and torch.equal(r["whole"][1], r["resumed"][1])
        assert r["wrong"] and "periods" in r["wrong"]


# -- tw.attach and Lightning: the Trainer's trajectory, bitwise ----------------------------------------------------
def _attached(rank, world):
    import thinwire as tw
    params = {"period": 2, "period_u": 4, "period_v": 6, "compressor": "fp16"}
    ref = _run(rank, world, params, 9, "mlp")[1]
    wl = workloads.get("linreg")
    m = _model("mlp")
    opt = torch.optim.AdamW(m.parameters(), **ADAMW)
    loader = workloads.ShardLoader(*wl.shard(rank, world), 16, seed=0, rank=rank)
    with tw.attach(m, opt, algorithm="desloc", **params):
        for _ in range(9):
            xb, yb = loader.next()
            wl.loss(m(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    return torch.equal(ref, _flat(m))


def test_attach_equals_the_trainer(pool2):
    assert all(pool2.run(_attached))


def _lightning(rank, world):
    import lightning as L

    import thinwire as tw
    from thinwire.lightning import ThinwireStrategy

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
            g = torch.Generator().manual_seed(100 + rank)
            self.x = torch.randn(64, 16, generator=g)
            self.y = (self.x[:, :4] * 3).argmax(1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    os.environ["LOCAL_RANK"] = str(rank)
    try:
        params = {"period": 2, "period_u": 3, "period_v": 6}
        module = Net()
        L.Trainer(strategy=ThinwireStrategy(algorithm="desloc", **params), devices=world, accelerator="cpu",
                  max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0).fit(module)
        ref = Net()
        opt = ref.configure_optimizers()
        trainer = tw.Trainer(ref, opt, algorithm="desloc", **params)
        for _ in range(3):
            for i, batch in enumerate(ref.train_dataloader()):
                ref.training_step(batch, i).backward()
                trainer.step()
                opt.zero_grad()
        trainer.close()
        return torch.equal(_flat(module), _flat(ref))
    finally:
        os.environ.pop("LOCAL_RANK", None)


def test_lightning_strategy_equals_the_trainer(pool2):
    pytest.importorskip("lightning")
    assert all(pool2.run(_lightning))


# -- thinwire train and compare -------------------------------------------------------------------------------------
def test_train_and_compare_run_desloc_with_adamw(pool2, tmp_path):
    from thinwire.compare import matrix as cmp
    from thinwire.compare import presets
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", algorithm="desloc", workers=2, steps=12, optimizer="adamw",
                      params={"period": 2}, compressor="int8", progress=False)
    s = run_training(cfg.validate(), pool=pool2)
    m = s["algorithm_metrics"]
    assert (m["period"], m["period_u"], m["period_v"], m["syncs"], m["syncs_u"], m["syncs_v"]) == (2, 6, 12, 6, 2, 1)
    # compare: a workload trained with SGD runs desloc with AdamW, the planner picks K_x for the link
    cell, why = cmp.tune_cell(presets.parse_cell("desloc"), "world", "wide-mlp", 4, compute_s=0.05)
    assert cell.optimizer == "adamw" and why[0].startswith("optimizer=adamw: desloc runs on Adam's moments")
    assert "period" in cell.params and "planner: world" in why[1]
    res = cmp.compare(cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=["desloc"],
                                        budget_s=0.5), str(tmp_path), progress=False, pool=pool2)
    (row,) = res["cells"]
    assert row["status"] == "ok" and row["steps"] > 0, row.get("error")


def _every_compressor(rank, world, cells):
    from thinwire.bench import matrix
    from thinwire.run.train import train_worker
    out = []
    for cell in cells:
        rec = train_worker(rank, world, matrix.config(cell, "digits-mlp", world, steps=4, eval_every=10 ** 6))
        out.append(rec["steps"][-1]["loss"])
    return out


def test_every_compressor_of_the_matrix_trains_with_desloc(pool2):
    """The matrix's cells (AdamW, each compressor with its natural memory) with every state averaged within 4
    steps: x through the compressor and u every step, v every second step."""
    import math
    from thinwire.bench import matrix
    cells = [dict(c, params={"period": 1, "period_v": 2}) for c in matrix.cells(["desloc"], workers=2)]
    assert len(cells) > 20 and not any(c["refused"] for c in cells) and {c["optimizer"] for c in cells} == {"adamw"}
    for rank_out in pool2.run(_every_compressor, cells):
        assert all(math.isfinite(x) for x in rank_out), [(c["compressor"], x) for c, x in zip(cells, rank_out)]
