"""A step that sends nothing costs what PyTorch costs (issue 31): no gradient hook runs in its backward, the
Trainer reads nothing on the host (NaN/Inf are flagged on the device and the verdict is read with the next
exchange), and a step that communicates reads the host at most once per exchange it starts. One process (world
size 1, gloo): these are properties of the step's code path, not of the wire."""
from __future__ import annotations

import pytest
import torch

import thinwire as tw
from thinwire.compress.finite import NonFiniteError

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
CASES = [("local", {}), ("localsgd", {"period": 3}), ("postlocalsgd", {"switch": 2, "period": 3}),
         ("diloco", {"period": 3}), ("diloco", {"period": 4, "fragments": 2, "overlap": 1}),
         ("dts", {"delay": 2, "period": 3}), ("tsparse", {"period": 3})]


@pytest.fixture
def reads(monkeypatch):
    """counts["n"]: the reads of a tensor's value by the host since the last reset (as tests/test_device.py)."""
    counts = {"n": 0}
    for name in HOST_READS:
        def counted(self, *a, _orig=getattr(torch.Tensor, name), **k):
            counts["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))


def _started(trainer) -> int:
    return sum(sum(ex.steps.values()) for ex in trainer.algorithm._exchanges)


@pytest.mark.parametrize("algorithm,params", CASES, ids=[f"{a}{sorted(p.items())}" for a, p in CASES])
def test_a_local_step_runs_no_hook_and_reads_nothing(group, reads, algorithm, params):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    trainer = tw.Trainer(model, opt, algorithm=algorithm, **params)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    kinds = []
    for _ in range(8):
        communicates = trainer.algorithm.communicates()
        before = _started(trainer)
        reads["n"] = 0
        loss = model(x).square().mean()       # (the forward puts the hooks back before a step that sends)
        hooked = any(p._post_accumulate_grad_hooks for p in model.parameters())
        loss.backward()
        trainer.step()
        n, started = reads["n"], _started(trainer) - before
        if communicates:
            assert hooked and started >= 1 and n <= started, (algorithm, n, started)
        else:
            assert not hooked and started == 0 and n == 0, (algorithm, hooked, started, n)
        kinds.append(communicates)
        opt.zero_grad()
    assert any(kinds) and not all(kinds) or algorithm == "local" and not any(kinds)
    trainer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_local_step_on_the_gpu_never_synchronises(group):
    """On CUDA, with torch's sync debug mode raising on any synchronising call: the local steps of localsgd and
    DiLoCo (forward, backward, Trainer.step) run without one."""
    device = "cuda"
    for algorithm in ("localsgd", "diloco"):
        model = _model().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        trainer = tw.Trainer(model, opt, algorithm=algorithm, period=3)
        x = torch.randn(4, 6, device=device)
        for _ in range(6):
            local = not trainer.algorithm.communicates()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if local else "default")
            try:
                model(x).square().mean().backward()
                trainer.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        trainer.close()


def test_a_nan_on_a_local_step_stops_the_run_before_anything_is_sent(group):
    """The verdict of a local step's check is read with the next exchange: the error names the step whose
    gradient was not finite, and the exchange raises before it sends (its own tensor is finite here)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)         # lr 0: the NaN never reaches the model
    trainer = tw.Trainer(model, opt, algorithm="localsgd", period=4)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(1, 4):                                  # steps 1-3 are local
        y = x.clone()
        if step == 2:
            y[0, 0] = float("nan")
        model(y).square().mean().backward()
        trainer.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    with pytest.raises(NonFiniteError, match=r"rank 0: NaN or Inf in the gradient at step 2; seen with an exchange"):
        trainer.step()                                        # step 4 averages: the verdict comes with it
    assert trainer.transport.meter.totals()["bytes_sent"] == 0
    with pytest.raises(NonFiniteError, match="at step 2; seen at close"):
        trainer.close()
