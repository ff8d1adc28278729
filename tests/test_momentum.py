"""Momentum and error feedback (issue 17): where the exchange carries the gradients the optimizer applies, the
optimizer's heavy-ball momentum moves into the memory (EF-SGDM, Zheng et al. 2019, Alg. 1; DGC's momentum
correction, Lin et al. 2018 §3.2) or the compressor (signum), and the optimizer runs without it; a memory that is
its own momentum (demo, sparseloco) zeroes the optimizer's; momentum given twice is refused before any work.
One process (world size 1, gloo): the logic is the Trainer's, not the wire's."""
from __future__ import annotations

import pytest
import torch

import thinwire as tw
from thinwire.errors import UserError
from thinwire.run.train import TrainConfig


def _train(steps=12, momentum=0.9, weight_decay=0.0, **trainer_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    trainer = tw.Trainer(model, opt, **trainer_kw)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(64, 12, generator=g), torch.randint(3, (64,), generator=g)
    try:
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            trainer.step()
            opt.zero_grad()
    finally:
        trainer.close()
    return model, opt, trainer


def _momenta(opt):
    return {g["momentum"] for g in opt.param_groups}


def test_momentum_in_the_memory_is_heavy_ball_for_a_lossless_compressor(group):
    """EF-SGDM with the identity compressor is heavy-ball SGD: u = μu + g sent, x -= lr·u."""
    ref, ref_opt, _ = _train(algorithm="bsp")
    got, opt, trainer = _train(algorithm="bsp", memory="residual")
    assert _momenta(ref_opt) == {0.9} and _momenta(opt) == {0.0}
    assert trainer.momentum_handed == 0.9 and trainer.memory.momentum == 0.9
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_dgc_and_signum_take_the_optimizers_momentum(group):
    _, opt, trainer = _train(algorithm="bsp", compressor="dgc", memory="dgc", ratio=0.1)
    assert _momenta(opt) == {0.0} and trainer.memory.momentum == 0.9
    _, opt, trainer = _train(algorithm="bsp", compressor="signum", memory="none", momentum=0.8)
    assert _momenta(opt) == {0.0} and trainer.compressor.beta == 0.8
    _, opt, trainer = _train(algorithm="bsp", compressor="signum", memory="residual")
    assert trainer.compressor.beta == 0.9 and trainer.memory.momentum == 0.0    # applied once, by the compressor


def test_a_memory_that_is_the_momentum_zeroes_the_optimizers(group):
    for memory, comp, params in (("demo", "demo", {}), ("sparseloco", "sparseloco", {})):
        _, opt, trainer = _train(algorithm="bsp", compressor=comp, memory=memory, **params)
        assert _momenta(opt) == {0.0}, memory


def test_momentum_stays_with_the_optimizer_where_models_are_exchanged_or_decay_is_on(group):
    _, opt, trainer = _train(algorithm="localsgd", memory="none")
    assert _momenta(opt) == {0.9} and trainer.momentum_handed == 0.0
    _, opt, trainer = _train(algorithm="bsp", memory="residual", weight_decay=1e-4)     # not heavy ball alone
    assert _momenta(opt) == {0.9} and trainer.memory.momentum_or_default() == 0.0


def test_momentum_given_twice_is_refused_before_launch():
    base = dict(workload="digits-mlp", algorithm="bsp", workers=2, progress=False)
    with pytest.raises(UserError, match="applies momentum 0.9 itself"):
        TrainConfig(**base, compressor="topk", memory="residual", params={"momentum": 0.9}, momentum=0.9).validate()
    with pytest.raises(UserError, match="keeps its own momentum"):
        TrainConfig(**base, compressor="demo", memory="demo", momentum=0.9).validate()
    TrainConfig(**base, compressor="demo", memory="demo").validate()                       # the workload's: zeroed
    TrainConfig(**base, compressor="topk", memory="residual", params={"momentum": 0.9}, momentum=0.0).validate()


def test_the_asynchronous_family_keeps_its_momentum_on_the_server():
    """ssp/asp net the optimizer's momentum of asynchrony's own on the server (StalenessAware); handed to an
    error-feedback memory as well it was applied on top of stale gradients (ssp + topk: 0.15 in the matrix)."""
    from thinwire import algorithms, compressors, memories
    from thinwire.optim import momentum_taker
    residual = memories.get("residual")
    for name in ("ssp", "asp"):
        assert momentum_taker(algorithms.get(name), compressors.get("topk"), residual) is None, name
    assert momentum_taker(algorithms.get("bsp", architecture="ps"), compressors.get("topk"), residual) is residual
