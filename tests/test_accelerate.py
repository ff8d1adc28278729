"""Hugging Face Accelerate (`thinwire.accelerate.attach`, extra `accelerate`): what it refuses, in one line, and the
optimizer it hooks. That a script launched by `accelerate launch` trains with DiLoCo on 4 processes is
tests/test_examples.py's run of examples/accelerate_diloco.py."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("accelerate")

import thinwire as tw  # noqa: E402

ONE = types.SimpleNamespace(gradient_accumulation_steps=1)     # an accelerator's one attribute read here


def test_attach_refuses_what_would_exchange_twice():
    from thinwire.accelerate import attach
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tw.UserError, match="gradient_accumulation_steps=1"):
        attach(types.SimpleNamespace(gradient_accumulation_steps=4), model, opt, algorithm="diloco")
    with pytest.raises(tw.UserError, match="torch.optim.Optimizer"):
        attach(ONE, model, object(), algorithm="diloco")


def test_attach_hooks_the_optimizer_accelerate_wraps(monkeypatch):
    """The optimizer Accelerate prepared wraps the user's: thinwire hooks the inner one, whose step() the
    wrapper calls."""
    from accelerate import Accelerator

    import thinwire.integrations.accelerate as acc
    accelerator = Accelerator(cpu=True)         # one process here
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = accelerator.prepare(inner)
    assert prepared is not inner and prepared.optimizer is inner
    seen = {}
    monkeypatch.setattr(acc, "_attach", lambda m, o, algorithm, **p: seen.update(model=m, opt=o, alg=algorithm))
    acc.attach(accelerator, model, prepared, algorithm="diloco", period=5)
    assert seen == {"model": model, "opt": inner, "alg": "diloco"}
