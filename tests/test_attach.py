"""`tw.attach`: a thinwire algorithm driven from the optimizer's own step hooks, for loops that call
`optimizer.step()` themselves; the result is `tw.Trainer`'s, bitwise, for every algorithm family."""
from __future__ import annotations

import pytest
import torch

import thinwire as tw

FAMILIES = [
    ("bsp", {"compressor": "topk", "ratio": 0.25, "memory": "residual"}),
    ("localsgd", {"period": 3}),
    ("diloco", {"period": 4}),
    ("diloco", {"period": 4, "fragments": 2, "overlap": 1, "compressor": "fp8"}),    # Streaming DiLoCo
    ("dts", {"delay": 2, "period": 2}),
    ("cdsgd", {"warmup": 2, "k": 3}),
    ("choco", {"compressor": "topk", "ratio": 0.5}),                                  # gossip
    ("bsp", {"architecture": "ps"}),                                                  # parameter server
]


def _train(rank, algorithm, params, how, opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = opt_cls(model.parameters(), lr=0.05, **({"momentum": 0.5} if opt_cls is torch.optim.SGD else {}))
    g = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(10)]
    loss = lambda x, y: torch.nn.functional.mse_loss(model(x), y)
    if how == "trainer":
        trainer = tw.Trainer(model, opt, algorithm=algorithm, **params)
        if getattr(trainer.algorithm, "role", "worker") == "server":
            trainer.algorithm.serve()
        else:
            for x, y in batches:
                loss(x, y).backward()
                trainer.step()
                opt.zero_grad()
        trainer.close()
        steps = trainer.step_count
    else:
        with tw.attach(model, opt, algorithm=algorithm, **params) as run:
            if run.role == "server":
                run.serve()
            for x, y in batches if run.role == "worker" else []:
                if how == "closure":            # Lightning's way: forward and backward inside step()
                    def closure():
                        opt.zero_grad()
                        out = loss(x, y)
                        out.backward()
                        return out
                    assert torch.is_tensor(opt.step(closure))
                else:
                    loss(x, y).backward()
                    opt.step()
                    opt.zero_grad()
            steps = run.metrics()["steps"]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), steps


def _families(rank, world_size):
    out = []
    for algorithm, params in FAMILIES:
        want, n = _train(rank, algorithm, params, "trainer")
        got, m = _train(rank, algorithm, params, "attach")
        out.append((algorithm, params, torch.equal(want, got), n, m))
    want, _ = _train(rank, "diloco", {"period": 3}, "trainer", torch.optim.Adam)
    got, _ = _train(rank, "diloco", {"period": 3}, "closure", torch.optim.Adam)
    out.append(("diloco", "adam, closure", torch.equal(want, got), 0, 0))
    return out


def test_attach_matches_the_trainer_bitwise_for_every_family(pool2):
    for rank_out in pool2.run(_families):
        for algorithm, params, same, n, m in rank_out:
            assert same, (algorithm, params)
            assert n == m, (algorithm, params, n, m)


def test_attach_leaves_the_optimizer_as_it_found_it(group):
    """One process: the hooks go with `close()`, or without communicating when an exception leaves the block."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(RuntimeError, match="boom"):
        with tw.attach(model, opt, algorithm="localsgd", period=2):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            raise RuntimeError("boom")
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert [list(g["params"]) for g in opt.param_groups] == groups
    before = model.weight.detach().clone()
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()                                  # a plain step again
    assert torch.equal(model.weight.detach(), before - 0.1 * 2)


def test_a_model_wrapped_in_ddp_is_refused(group):
    """DDP would all-reduce every gradient beside the algorithm's own exchange: one line naming what to pass."""
    from thinwire.errors import UserError
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    with pytest.raises(UserError, match=r"pass the module inside it \(model.module\)"):
        tw.attach(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), algorithm="diloco")
