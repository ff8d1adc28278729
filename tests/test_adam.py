"""1-bit Adam (`onebit-adam`) and 0/1 Adam (`zeroone-adam`) on the user's own Adam/AdamW: refusals at construction,
each equal to a single-process replay of its paper's equations (float64, 2 and 4 gloo workers), the compressed
all-reduce with two-sided error feedback metered byte for byte, bitwise resume, `tw.attach`, and the planner."""
from __future__ import annotations

import copy

import pytest
import torch

from thinwire.compress import compressors, memories
from thinwire.errors import UserError
from thinwire.exchange.twosided import segments
from thinwire.run import workloads

LR, WD, BETAS = 0.01, 0.1, (0.9, 0.95)
ALONE = 64      # (the exchange's default, 2^15, would leave this model in one piece; tests set it lower)


# -- what runs in every worker -----------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)        # float64, 6 parameter tensors, on linreg's 16 inputs
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def _adam(model, kind="adamw"):
    if kind == "adam":          # Adam's coupled weight decay: g + λx feeds the moments
        return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _setup(rank, world, algorithm, params, compressor=None, memory=None, kind="adamw"):
    from thinwire import Trainer
    from thinwire.exchange import twosided
    twosided.ALONE = ALONE
    wl = workloads.get("linreg")
    model = _model()
    opt = _adam(model, kind)
    loader = workloads.ShardLoader(*wl.shard(rank, world), 16, seed=0, rank=rank)
    return Trainer(model, opt, algorithm=algorithm, compressor=compressor, memory=memory, **params), model, loader


def _steps(trainer, model, loader, n):
    wl = workloads.get("linreg")
    sent = []
    for _ in range(n):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        sent.append(trainer.step()["bytes_sent"])
        trainer.optimizer.zero_grad()
    return sent


def _run(rank, world, algorithm, params, steps, **kw):
    tr, model, loader = _setup(rank, world, algorithm, params, **kw)
    sent = _steps(tr, model, loader, steps)
    before = _flat(model.parameters())
    tr.close()
    return {"before": before, "after": _flat(model.parameters()), "sent": sent, "metrics": tr.metrics()}


ONEBIT = {"warmup": 4, "schedule": "none"}
ZEROONE = {"var_freeze_step": 7, "var_update_scaler": 2, "local_step_scaler": 3, "local_step_clipper": 4,
           "schedule": "none"}
CASES = {   # name -> (algorithm, params, compressor, memory, optimizer, steps)
    "onebit-adam": ("onebit-adam", ONEBIT, None, None, "adamw", 12),
    "onebit-adam buckets adam": ("onebit-adam", {"warmup": 3, "schedule": "wfbp"}, None, None, "adam", 10),
    "onebit-adam topk": ("onebit-adam", ONEBIT, "topk", "residual", "adamw", 10),
    "onebit-adam signsgd no memory": ("onebit-adam", ONEBIT, "signsgd", "none", "adamw", 10),
    "zeroone-adam": ("zeroone-adam", ZEROONE, None, None, "adamw", 21),
    "zeroone-adam adam": ("zeroone-adam", ZEROONE, None, None, "adam", 19),
}


def _cases(rank, world):
    return {name: _run(rank, world, alg, params, steps, compressor=comp, memory=mem, kind=kind)
            for name, (alg, params, comp, mem, kind, steps) in CASES.items()}


# -- the single-process replays of the papers' equations ----------------------------------------------------------
class Replay:
    """n workers of linreg batches in one process, each with its model and Adam state, and the compressed
    all-reduce with worker and chunk-owner error feedback (Tang et al. 2021, §4.1) written out."""

    def __init__(self, n, kind, compressor, memory, layout):
        wl = workloads.get("linreg")
        self.n, self.kind, self.layout = n, kind, layout
        self.models = [_model() for _ in range(n)]
        self.opts = [_adam(m, kind) for m in self.models]
        self.ps = [list(m.parameters()) for m in self.models]
        self.loaders = [workloads.ShardLoader(*wl.shard(r, n), 16, seed=0, rank=r) for r in range(n)]
        self.comp = compressors.get(compressor or "onebit")
        self.ef = (memory or "residual") != "none"
        self.worker_err = [{} for _ in range(n)]      # bucket -> δ_w of the flat bucket
        self.server_err = [{} for _ in range(n)]      # bucket -> δ_s of this rank's chunk
        self.m = [[torch.zeros_like(p) for p in self.ps[0]] for _ in range(n)]
        self.v = [torch.zeros_like(p) for p in self.ps[0]]
        self.t = 0

    def grads(self):
        wl = workloads.get("linreg")
        out = []
        for r in range(self.n):
            xb, yb = self.loaders[r].next()
            for p in self.ps[r]:
                p.grad = None
            wl.loss(self.models[r](xb), yb).backward()
            out.append([p.grad.detach().clone() for p in self.ps[r]])
        return out

    def coupled(self, r, g):
        """g + λx under Adam's coupled weight decay (worker r's x), else g."""
        return [gi + WD * p.detach() for gi, p in zip(g, self.ps[r])] if self.kind == "adam" else g

    def two_sided(self, flats, b, sizes):
        """The mean over workers of `flats` (one flat bucket b each, of parameters of `sizes` elements) through the
        compressed all-reduce: every parameter's chunk j (its owner rank j's) compressed on its own."""
        n, C = self.n, self.comp
        decode = lambda x: C.decompress(C.compress(x)).reshape(-1)      # noqa: E731
        sent = []                                   # [worker][parameter][owner]
        for r in range(n):
            c = flats[r] + self.worker_err[r].get(b, torch.zeros_like(flats[r]))
            sent.append([[decode(ch) for ch in part.tensor_split(n)] for part in c.split(sizes)])
            if self.ef:
                self.worker_err[r][b] = c - torch.cat([x for row in sent[r] for x in row])
        replies = []                                # [owner][parameter]
        for j in range(n):
            a = torch.cat([sum(sent[r][k][j] for r in range(n)) for k in range(len(sizes))]) / n
            s = a + self.server_err[j].get(b, torch.zeros_like(a))
            replies.append([decode(part) for part in s.split([row[j].numel() for row in sent[0]])])
            if self.ef:
                self.server_err[j][b] = s - torch.cat(replies[j])
        return torch.cat([replies[j][k] for k in range(len(sizes)) for j in range(n)])

    def exchange(self, per_worker):
        """Per-parameter tensors of every worker → their per-parameter means, bucket by bucket."""
        out = [None] * len(per_worker[0])
        for b, members in enumerate(self.layout):
            flats = [torch.cat([per_worker[r][i].reshape(-1) for i in members]) for r in range(self.n)]
            mean = self.two_sided(flats, b, segments([self.ps[0][i].numel() for i in members], ALONE))
            at = 0
            for i in members:
                k = self.ps[0][i].numel()
                out[i] = mean[at:at + k].view_as(self.ps[0][i])
                at += k
        return out

    def adam_step(self, r, m, k, t):
        """x ← (1 − γλ)x − γ/(1 − β1^t) m / (√v/√(1 − β2^k) + ε) (AdamW; Adam: no shrink)."""
        with torch.no_grad():
            for p, mi, vi in zip(self.ps[r], m, self.v):
                if self.kind == "adamw":
                    p.mul_(1 - LR * WD)
                denom = (vi.sqrt() / (1 - BETAS[1] ** k) ** 0.5).add_(1e-8)
                p.addcdiv_(mi, denom, value=-LR / (1 - BETAS[0] ** t))

    def flat(self, r):
        return _flat(self.ps[r])


def replay_onebit(n, params, steps, compressor=None, memory=None, kind="adamw", layout=None):
    """1-bit Adam (Tang et al. 2021, Alg. 1): `warmup` steps of Adam on the mean gradient, then v frozen and the
    local momenta m_i = β1 m + (1 − β1) g_i averaged through the compressed all-reduce, m ← their mean."""
    R = Replay(n, kind, compressor, memory, layout)
    b1 = BETAS[0]
    for t in range(1, steps + 1):
        g = R.grads()
        if t <= params["warmup"]:
            for r in range(n):          # Adam on the mean gradient (the user's optimizer, on every worker)
                for p, *gs in zip(R.ps[r], *g):
                    p.grad = sum(gi / n for gi in gs)
                R.opts[r].step()
            continue
        if t == params["warmup"] + 1:   # v frozen: the optimizer's own
            R.v = [R.opts[0].state[p]["exp_avg_sq"].clone() for p in R.ps[0]]
            R.m = [[R.opts[r].state[p]["exp_avg"].clone() for p in R.ps[r]] for r in range(n)]
        local = [[m + (1 - b1) * (gi - m) for m, gi in zip(R.m[r], R.coupled(r, g[r]))] for r in range(n)]
        mean = R.exchange(local)
        for r in range(n):
            R.m[r] = [torch.where(v == 0, 0.0, x) for x, v in zip(mean, R.v)]    # no move where v is exactly 0
            R.adam_step(r, R.m[r], params["warmup"], t)
    return [R.flat(r) for r in range(n)]


def replay_zeroone(n, params, steps, compressor=None, memory=None, kind="adamw", layout=None):
    """0/1 Adam (Lu et al. 2022, Alg. 1) as thinwire/algorithms/zeroone_adam.py writes it out: T_v steps (gaps
    doubling after every κ updates, up to var_freeze_step) Adam on the mean gradient; otherwise local momenta
    and steps, u accumulating γ̃m (and AdamW's shrink); at T_u (every step before the freeze, then every H steps, H
    doubling every `local_step_scaler` steps up to `local_step_clipper`) x ← S x_t' − ū/(√v + ε), m ← ū/Σγ̃.
    Returns (models before close, models after close)."""
    R = Replay(n, kind, compressor, memory, layout)
    b1, b2 = BETAS
    freeze, kappa = params["var_freeze_step"], params["var_update_scaler"]
    var_gap, var_count, H, local_count, k = 1, 0, 1, 0, 0
    P = len(R.ps[0])
    u = [[torch.zeros_like(p) for p in R.ps[0]] for _ in range(n)]
    L, S = 0.0, 1.0
    anchor = [R.flat(r) for r in range(n)]
    shrink = 1 - LR * WD if kind == "adamw" else 1.0

    def sync():
        nonlocal L, S
        mean = [torch.where(v == 0, 0.0, x) for x, v in zip(R.exchange(u), R.v)]
        for r in range(n):
            with torch.no_grad():
                at = 0
                for i, p in enumerate(R.ps[r]):
                    base = anchor[r][at:at + p.numel()].view_as(p)
                    step = mean[i] / (R.v[i].sqrt() / (1 - b2 ** k) ** 0.5 + 1e-8)
                    p.copy_(base * S - step if S != 1.0 else base - step)
                    R.m[r][i] = mean[i] / L
                    at += p.numel()
            anchor[r] = R.flat(r)
            u[r] = [torch.zeros_like(x) for x in u[r]]
        L, S = 0.0, 1.0

    for t in range(1, steps + 1):
        g = R.grads()
        frozen = t > freeze
        if not frozen and t % var_gap == 0:          # t ∈ T_v
            mean_g = R.coupled(0, [sum(g[r][i] / n for r in range(n)) for i in range(P)])
            k += 1
            R.v = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(R.v, mean_g)]
            for r in range(n):
                R.m[r] = [m + (1 - b1) * (gi - m) for m, gi in zip(R.m[r], mean_g)]
                R.adam_step(r, R.m[r], k, t)
                anchor[r] = R.flat(r)
            var_count += 1
            if var_count == kappa:
                var_count, var_gap = 0, var_gap * 2
        else:
            rate = LR / (1 - b1 ** t)
            for r in range(n):
                R.m[r] = [m + (1 - b1) * (gi - m) for m, gi in zip(R.m[r], R.coupled(r, g[r]))]
                u[r] = [shrink * ui + rate * m for ui, m in zip(u[r], R.m[r])]
            L, S = shrink * L + rate, S * shrink
            if not frozen or t % H == 0:             # t ∈ T_u
                sync()
            else:                                    # a local step
                for r in range(n):
                    R.adam_step(r, R.m[r], k, t)
        if frozen:
            local_count += 1
            if local_count == params["local_step_scaler"]:
                local_count, H = 0, min(params["local_step_clipper"], 2 * H)
    before = [R.flat(r) for r in range(n)]
    if any(ui.abs().max() > 0 for ui in u[0]):
        sync()
    return before, [R.flat(r) for r in range(n)]


def _layout(params, P=6):
    return [[i] for i in reversed(range(P))] if params.get("schedule") == "wfbp" else [list(reversed(range(P)))]


def close(a, b, tol=1e-12):
    return torch.allclose(a, b, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("world", [2, 4])
def test_each_equals_a_replay_of_its_papers_equations_and_every_byte_is_metered(world, pool2, pool4):
    """The replays to 1e-12; after the warm-up a rank sends its n − 1 chunks of the compressed momentum to their
    owners and the owners' compressed chunks go round an all-gather (each padded to the largest): every byte
    metered. The warm-up's all-reduce sends 2(n − 1)/n of the float64 gradient."""
    results = (pool2 if world == 2 else pool4).run(_cases)
    for name, (alg, params, comp, mem, kind, steps) in CASES.items():
        layout = _layout(params)
        if alg == "onebit-adam":
            want_before = want_after = replay_onebit(world, params, steps, comp, mem, kind, layout)
        else:
            want_before, want_after = replay_zeroone(world, params, steps, comp, mem, kind, layout)
        for rank, r in enumerate(results):
            got = r[name]
            assert got["before"].dtype == torch.float64
            assert close(got["before"], want_before[rank]), (name, rank, (got["before"] - want_before[rank]).abs().max())
            assert close(got["after"], want_after[rank]), (name, rank)
        afters = [r[name]["after"] for r in results]
        assert all(torch.equal(afters[0], a) for a in afters[1:]), name      # one model everywhere
    zo = results[0]["zeroone-adam"]["metrics"]
    assert zo["variance_steps"] == 4 and zo["local_interval"] == 4 and zo["frozen"]   # T_v = {1, 2, 4, 6}
    # local steps after the freeze: their models differ until a sync (and close)
    assert not torch.equal(results[0]["zeroone-adam"]["before"], results[1]["zeroone-adam"]["before"])
    params = list(_model().parameters())
    numel = sum(p.numel() for p in params)
    sizes = _message_bytes("onebit", segments([p.numel() for p in reversed(params)], ALONE), world)
    for rank, r in enumerate(results):
        sent = r["onebit-adam"]["sent"]
        warm, compressed = sent[:ONEBIT["warmup"]], sent[ONEBIT["warmup"]:]
        assert warm == [2 * (world - 1) / world * numel * 8] * len(warm)
        want = sum(s for j, s in enumerate(sizes) if j != rank) + (world - 1) * max(sizes)
        assert compressed == [want] * len(compressed), (rank, compressed, want)
    zo = results[0]["zeroone-adam"]["sent"]
    assert zo[10] == 0 and zo[11] > 0          # t = 11: a local step, t = 12 a sync (H = 2)


def _message_bytes(compressor, sizes, n):
    """The packed message of each owner j: the payloads of chunk j of every parameter (of `sizes` elements)."""
    from thinwire.exchange import wire
    comp = compressors.get(compressor)
    pieces = [torch.randn(k, dtype=torch.float64).tensor_split(n) for k in sizes]
    return [wire.packed_size([t for row in pieces for t in comp.compress(row[j]).tensors]) for j in range(n)]


# -- checkpoints: a resumed run equals the uninterrupted one ------------------------------------------------------
def _resume(rank, world, name, at):
    alg, params, comp, mem, kind, steps = CASES[name]
    whole = _run(rank, world, alg, params, steps, compressor=comp, memory=mem, kind=kind)
    tr, model, loader = _setup(rank, world, alg, params, comp, mem, kind)
    _steps(tr, model, loader, at)
    state, ls = copy.deepcopy(tr.state_dict()), loader.state_dict()
    tr.close()
    tr2, model2, loader2 = _setup(rank, world, alg, params, comp, mem, kind)
    tr2.load_state_dict(state)
    loader2.load_state_dict(ls)
    _steps(tr2, model2, loader2, steps - at)
    before = _flat(model2.parameters())
    tr2.close()
    return whole["before"], whole["after"], before, _flat(model2.parameters())


@pytest.mark.parametrize("name,at", [("onebit-adam", 7), ("zeroone-adam", 14)])
def test_checkpoint_resume_is_bitwise(name, at, pool2):
    """onebit-adam resumed after the warm-up (both errors saved); zeroone-adam in the middle of its local steps
    (u, Σγ̃, S and x_t' saved)."""
    for whole_before, whole_after, before, after in pool2.run(_resume, name, at):
        assert torch.equal(whole_before, before) and torch.equal(whole_after, after)


# -- refusals, before any worker starts --------------------------------------------------------------------------
def _refusal(algorithm, **kw):
    from thinwire.run.train import TrainConfig
    try:
        TrainConfig(algorithm=algorithm, workers=2, progress=False, **kw).validate()
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("algorithm", ["onebit-adam", "zeroone-adam"])
def test_refusals_name_what_to_use(algorithm):
    assert "AdamW" in _refusal(algorithm, workload="digits-mlp", optimizer="sgd")
    assert "AdamW" in _refusal(algorithm, workload="digits-mlp", optimizer="muon")
    assert _refusal(algorithm, workload="digits-mlp", optimizer="adamw") is None
    assert _refusal(algorithm, workload="stdlib-lm") is None              # its own optimizer is AdamW
    assert "onebit" in _refusal(algorithm, workload="stdlib-lm", compressor="powersgd")
    assert "signsgd" in _refusal(algorithm, workload="stdlib-lm", compressor="signum")
    assert "residual" in _refusal(algorithm, workload="stdlib-lm", compressor="topk", memory="sparseloco")
    assert "residual" in _refusal(algorithm, workload="stdlib-lm", memory="residual", params={"momentum": 0.9})
    assert "valid" in _refusal(algorithm, workload="stdlib-lm", params={"schedule": "mgwfbp"})
    assert _refusal(algorithm, workload="stdlib-lm", compressor="topk", memory="residual") is None
    assert "qsgd" in _refusal(algorithm, workload="stdlib-lm", compressor="randomk")       # measured: 0.68, 0.89
    threshold = _refusal(algorithm, workload="stdlib-lm", compressor="threshold")
    assert (threshold is None) == (algorithm == "onebit-adam"), threshold                  # 0/1 Adam sends γ̃m
    model = _model()
    with pytest.raises(UserError, match="amsgrad"):
        from thinwire import algorithms
        algorithms.get(algorithm).check_run(2, torch.optim.Adam(model.parameters(), amsgrad=True))
    assert "warmup" in _refusal("onebit-adam", workload="stdlib-lm", params={"warmup": 0})


# -- everywhere a thinwire algorithm runs: tw.attach and the Lightning strategy, bitwise the Trainer's -----------
SURFACES = [("onebit-adam", {"warmup": 3}), ("zeroone-adam", {"var_freeze_step": 4, "var_update_scaler": 2,
                                                                "local_step_scaler": 2, "local_step_clipper": 2})]


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(9)]


def _small():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _surfaces(rank, world_size):
    import os

    import thinwire as tw
    out = {}
    for algorithm, params in SURFACES:
        flats = {}
        for how in ("trainer", "attach", "lightning"):
            model = _small()
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            loss = lambda x, y: torch.nn.functional.mse_loss(model(x), y)     # noqa: E731
            if how == "trainer":
                trainer = tw.Trainer(model, opt, algorithm=algorithm, **params)
                for x, y in _batches(rank):
                    loss(x, y).backward()
                    trainer.step()
                    opt.zero_grad()
                trainer.close()
                fresh = torch.optim.AdamW(model.parameters(), lr=0.01)    # the state is torch's AdamW's
                fresh.load_state_dict(opt.state_dict())
                out[algorithm, "state"] = all(set(st) == {"step", "exp_avg", "exp_avg_sq"} and
                                              int(st["step"]) == len(_batches(rank)) for st in fresh.state.values())
            elif how == "attach":
                with tw.attach(model, opt, algorithm=algorithm, **params):
                    for x, y in _batches(rank):
                        loss(x, y).backward()
                        opt.step()
                        opt.zero_grad()
            else:
                import lightning as L
                from thinwire.lightning import ThinwireStrategy

                class Module(L.LightningModule):
                    def __init__(self):
                        super().__init__()
                        self.net = model

                    def training_step(self, batch, batch_idx):
                        return loss(*batch)

                    def configure_optimizers(self):
                        return torch.optim.AdamW(self.parameters(), lr=0.01)

                    def train_dataloader(self):
                        xs, ys = zip(*_batches(rank))
                        data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
                        return torch.utils.data.DataLoader(data, batch_size=16)

                os.environ["LOCAL_RANK"] = str(rank)
                try:
                    L.Trainer(strategy=ThinwireStrategy(algorithm=algorithm, **params), devices=world_size,
                              accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                              num_sanity_val_steps=0).fit(Module())
                finally:
                    os.environ.pop("LOCAL_RANK", None)
            flats[how] = _flat(model.parameters())
        out[algorithm] = flats
    return out


def test_attach_and_lightning_train_like_the_trainer(pool2):
    pytest.importorskip("lightning")
    for rank_out in pool2.run(_surfaces):
        for algorithm, flats in rank_out.items():
            if isinstance(algorithm, tuple):
                assert flats is True, algorithm
                continue
            assert torch.equal(flats["trainer"], flats["attach"]), algorithm
            assert torch.equal(flats["trainer"], flats["lightning"]), algorithm


def test_error_feedback_on_the_gradient_under_adam_warns_in_one_line(group):
    """bsp + a biased compressor's error feedback + Adam stalls on the LM (docs/adam.md): the Trainer says so once."""
    import warnings

    import thinwire as tw
    model = _model()
    with pytest.warns(UserWarning, match="onebit-adam") as caught:
        tw.Trainer(model, _adam(model), algorithm="bsp", compressor="onebit", memory="residual").close()
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for alg, comp, mem, opt in (("bsp", "onebit", "residual", torch.optim.SGD), ("bsp", "qsgd", "none", None),
                                    ("onebit-adam", None, None, None)):
            model = _model()
            opt = opt(model.parameters(), lr=0.1) if opt else _adam(model)
            tw.Trainer(model, opt, algorithm=alg, compressor=comp, memory=mem).close()
