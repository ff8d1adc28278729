"""Workloads of the user's (`--workload module:function`, `path/file.py:function`): a module written to a temporary
directory trains through `thinwire train`, races through `thinwire compare` and is measured by `thinwire advise`;
every bad spec is refused in one line with exit status 2 before any worker starts; datasets, iterables and
optimizer factories; a Hugging Face GPT-2 from a config trains on two workers."""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
import textwrap
from unittest import mock

import pytest
import torch

import thinwire as tw
from thinwire.errors import MissingExtra, UserError
from thinwire.run import data, user, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOY = """
import functools

import torch
import torch.nn.functional as F

import thinwire as tw


def data(features=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, features, generator=g)
    y = (x @ torch.randn(features, 4, generator=g)).argmax(1)
    ds = torch.utils.data.TensorDataset
    return ds(x[:384], y[:384]), ds(x[384:], y[384:])


def make(**kw):
    args = dict(name="toy", data=data(), build=lambda: torch.nn.Linear(8, 4), target=0.9,
                batch_size=16, optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    return tw.Workload(**{**args, **kw})
"""


def _module(tmp_path, name: str, body: str = "") -> str:
    """A workload module `name` in tmp_path: the toy workload above and `body`; returns its file's path."""
    path = tmp_path / f"{name}.py"
    path.write_text(TOY + textwrap.dedent(body))
    return str(path)


def _on_pool(pool):
    """`thinwire.run.train.launch` as a run on the session's pool (its workers were started before the module
    was written: they find it by the spec's file path)."""
    return lambda fn, world, **kw: pool.run(fn, *kw["args"], network=kw["network"], seed=kw["seed"])


def _tripwire(*a, **k):
    raise AssertionError("a worker was started despite a bad workload")


# -- end to end ------------------------------------------------------------------------------------------------
def test_a_workload_module_trains_with_thinwire_train(pool2, tmp_path, monkeypatch, capsys):
    """`thinwire train --workload mod:make` from the module's directory (as `python -m` finds it): trained on two
    workers from a Dataset with the module's own optimizer; the summary names the spec by its file."""
    from thinwire.cli import main
    path = _module(tmp_path, "wl_train")
    monkeypatch.chdir(tmp_path)
    with mock.patch("thinwire.run.train.launch", _on_pool(pool2)):
        assert main(["train", "--workload", "wl_train:make", "--workers", "2", "--steps", "24", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["workload"] == f"{path}:make" and s["steps"] == 24 and s["workers"] == 2
    assert s["metric"] == "accuracy" and s["final_accuracy"] > 0.5 and s["metric_note"] is None
    assert s["num_params"] == 36 and s["bytes_sent_per_worker"] > 0


def test_a_workload_module_races_through_compare(pool2, tmp_path):
    """The same kind of module raced by `thinwire compare` (the no-communication reference and two cells on a
    tiny budget): the report as for a built-in workload."""
    from thinwire.cli.compare import config_from_args
    from thinwire.compare import compare
    import argparse
    path = _module(tmp_path, "wl_race")
    args = argparse.Namespace(preset=None, algorithms="bsp;localsgd", workload=f"{path}:make", workers=2,
                              target=None, budget=1.0, epochs=None, network="lan", seeds=None, seed=0, trace=False,
                              netem=False, tensorboard=None, eval_every=None, device="cpu")
    cfg = config_from_args(args)
    out = str(tmp_path / "race")
    res = compare(cfg, out, progress=False, pool=pool2)
    assert [c["label"] for c in res["cells"]] == ["bsp", "localsgd"]
    assert all(c["status"] == "ok" and c["steps"] > 0 for c in res["cells"]), res["cells"]
    report = open(os.path.join(out, "report.md")).read()
    assert "bsp" in report and "localsgd" in report and f"{path}:make" in report


def test_a_metric_that_never_moves_is_named_in_the_summary(pool2, tmp_path):
    from thinwire.cli.train import format_summary
    from thinwire.run.train import TrainConfig, run_training
    path = _module(tmp_path, "wl_still", """
        def still():
            return make(optimizer=functools.partial(torch.optim.SGD, lr=0.0))
        """)
    s = run_training(TrainConfig(workload=f"{path}:still", workers=2, steps=4, eval_every=2, progress=False),
                     pool=pool2)
    assert "the accuracy never moved" in s["metric_note"] and "at all 3 evaluations" in s["metric_note"]
    assert "note              the accuracy never moved" in format_summary(s)


def test_training_data_from_a_function_of_rank_and_an_iterable_test_set(pool2, tmp_path):
    """`train` as a function (rank, world_size) -> samples (the user shards), `test` a list of samples."""
    from thinwire.run.train import TrainConfig, run_training
    path = _module(tmp_path, "wl_stream", """
        def stream():
            train, test = data()

            def mine(rank, world_size):
                return (train[i] for i in range(rank, len(train), world_size))
            return make(data=(mine, [test[i] for i in range(len(test))]), batch_size=8)
        """)
    s = run_training(TrainConfig(workload=f"{path}:stream", workers=2, epochs=1.0, progress=False), pool=pool2)
    assert s["steps"] == 384 // 2 // 8 and s["final_accuracy"] > 0.5


# -- bad specs: one line, status 2, before any worker ----------------------------------------------------------
BAD = [  # (function body or None, spec tail, what the line says)
    (None, "nosuch_module_xyz:make", "no module named 'nosuch_module_xyz'"),
    (None, "missing_file.py:make", "no file"),
    ("", "FILE:nope", "has no 'nope'"),
    ("import nonexistent_package_xyz", "FILE:make", "failed: ModuleNotFoundError: No module named"),
    ("def broken(:\n    pass", "FILE:make", "failed: SyntaxError"),
    ("def bad():\n    raise RuntimeError('boom')", "FILE:bad", "bad() raised RuntimeError: boom"),
    ("def bad():\n    return 42", "FILE:bad", "bad() returned int, not a thinwire.Workload"),
    ("def bad():\n    return make(data=data(features=6))", "FILE:bad", "does not fit the model and the loss"),
    ("def bad():\n    return make(loss_fn=lambda o, y: F.cross_entropy(o, y, reduction='none'))", "FILE:bad",
     "must be one number (a scalar tensor), got (16,)"),
    ("def bad():\n    return make(loss_fn=lambda o, y: torch.ones((), requires_grad=True))", "FILE:bad",
     "no parameter of the model got a gradient"),
    ("def bad():\n    return make(data=(torch.utils.data.DataLoader(data()[0]), data()[1]))", "FILE:bad",
     "is a DataLoader: pass its dataset"),
    ("def bad():\n    return make(data=data()[:1])", "FILE:bad", "data must be (x_train, y_train, x_test, y_test)"),
    ("def bad():\n    return make(metric='f1')", "FILE:bad", "metric must be accuracy"),
    ("def bad():\n    return make(optimizer=lambda p: 3)", "FILE:bad", "returned int, not a torch.optim.Optimizer"),
]


@pytest.mark.parametrize("body, spec, needle", BAD, ids=[b[2][:40] for b in BAD])
def test_a_bad_workload_is_refused_in_one_line_before_any_worker(body, spec, needle, tmp_path, monkeypatch, capsys):
    from thinwire.cli import main
    monkeypatch.chdir(tmp_path)
    if body is not None:
        name = f"bad_{abs(hash((body, spec))) % 10**8}"
        spec = spec.replace("FILE", _module(tmp_path, name, "\n" + body + "\n"))
    commands = [["train", "--workload", spec, "--workers", "2", "--steps", "2"],
                ["compare", "--workload", spec, "--algorithms", "bsp", "--workers", "2", "--out", str(tmp_path)],
                ["advise", "--workload", spec]]
    with mock.patch("thinwire.run.train.launch", _tripwire), mock.patch("thinwire.cli.compare.compare", _tripwire):
        for argv in commands if body == "" else commands[:1]:
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert needle in err and "thinwire: error: workload '" in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# -- Hugging Face ----------------------------------------------------------------------------------------------
def test_a_tiny_gpt2_from_transformers_trains_on_two_workers(pool2, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="the extra 'hf' (transformers) is not installed")
    from thinwire.cli import main
    spec = os.path.join(ROOT, "examples", "hf_gpt2.py") + ":make"
    with mock.patch("thinwire.run.train.launch", _on_pool(pool2)):
        assert main(["train", "--workload", spec, "--workers", "2", "--steps", "4", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["metric"] == "loss" and s["num_params"] == 445_952 and s["steps"] == 4
    assert math.isfinite(s["final_loss"]) and s["final_loss"] < math.log(256)


def test_a_missing_transformers_is_one_line_naming_the_extra(monkeypatch):
    from thinwire.run.hf import causal_lm
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(MissingExtra, match=r"needs the optional extra 'hf': pip install 'thinwire\[hf\]'"):
        causal_lm(object())


# -- advise ----------------------------------------------------------------------------------------------------
def test_advise_measures_the_step_and_records_the_prediction(tmp_path, capsys):
    from thinwire.cli import main
    from thinwire.launcher.worker import threads_per_worker
    from thinwire.run.measure import read_advice
    path = _module(tmp_path, "wl_advise")
    out = str(tmp_path / "advice")
    argv = ["advise", "--workload", f"{path}:make", "--network", "wan", "--workers", "2", "--local", "--out", out]
    assert main(argv) == 0
    assert "measured toy: 36 parameters, step" in capsys.readouterr().out
    advice = read_advice(out)
    m = advice["measured"]
    assert advice["workload"] == f"{path}:make" and advice["workload_name"] == "toy" and advice["network"] == "wan"
    assert m["params"] == 36 and m["steps"] == len(m["times_s"]) and m["step_s"] > 0
    assert m["threads"] == threads_per_worker(2) and m["local"]
    assert len(m["together_s"]) == 2 and m["compute_s"] == pytest.approx(statistics.median(m["together_s"]))
    assert m["share"] == pytest.approx(m["compute_s"] / m["step_s"])
    assert advice["scenario"]["compute_s"] == pytest.approx(m["compute_s"])
    assert advice["scenario"]["workers"] == 2 and advice["ranking"][0]["iteration_s"] > 0
    assert main(["advise", "--workload", "digits-mlp", "--model", "digits-mlp"]) == 2    # one source of the size


# -- the pieces ------------------------------------------------------------------------------------------------
def test_workload_is_public_and_the_built_in_ones_are_workloads():
    assert tw.Workload is workloads.Workload
    assert all(isinstance(workloads.get(n), tw.Workload) and workloads.get(n).tensors
               for n in ("digits-mlp", "linreg"))


def test_a_spec_resolves_alike_in_every_process(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "wl.py").write_text(TOY)
    monkeypatch.chdir(tmp_path)
    assert user.canonical("pkg.wl:make") == f"{tmp_path}/pkg/wl.py:make"
    assert user.canonical("pkg/wl.py:make") == f"{tmp_path}/pkg/wl.py:make"
    assert user.canonical("json:loads") == "json:loads" and user.canonical("digits-mlp") == "digits-mlp"
    wl = workloads.get(user.canonical("pkg.wl:make"))
    assert wl.name == "toy" and wl.per_worker(2) == 192 and wl.steps_per_epoch(2) == 12
    assert __import__("sys").modules["pkg.wl"].__file__ == f"{tmp_path}/pkg/wl.py"


def test_dataset_and_iterable_loaders_shard_by_rank_and_resume():
    ds = torch.utils.data.TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    seen = [set(), set()]
    for rank in (0, 1):
        loader = data.DatasetLoader(ds, 5, seed=1, rank=rank, world_size=2)
        for _ in range(2):
            x, y = loader.next()
            assert x.shape == (5, 2) and y.shape == (5,)
            seen[rank] |= set(y.tolist())
    assert seen[0] == set(range(0, 20, 2)) and seen[1] == set(range(1, 20, 2))

    class Samples:          # an iterable of samples, iterated again every epoch
        def __iter__(self):
            return ((torch.tensor([float(i)]), i) for i in range(11))
    a = data.StreamLoader(Samples(), 2, rank=1, world_size=2)
    assert a.next()[1].tolist() == [1, 3] and a.next()[1].tolist() == [5, 7]
    state = a.state_dict()
    b = data.StreamLoader(Samples(), 2, rank=1, world_size=2)
    b.load_state_dict(state)
    assert a.next()[1].tolist() == b.next()[1].tolist() == [1, 3]     # the epoch's end: 9 alone is dropped
    assert data.per_worker(Samples(), 2) == 5
    with pytest.raises(UserError, match="fewer than the batch size 8"):
        data.StreamLoader(Samples(), 8, rank=0, world_size=2).next()


def test_an_optimizer_factory_takes_the_runs_lr_and_momentum():
    wl = tw.Workload("f", (torch.zeros(4, 2), torch.zeros(4), torch.zeros(2, 2), torch.zeros(2)),
                     lambda: torch.nn.Linear(2, 2), optimizer=functools.partial(torch.optim.AdamW, lr=0.01))
    model = wl.model()
    opt = wl.make_optimizer(model)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 0.01
    opt = wl.make_optimizer(model, lr=0.5, momentum=0.8)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["betas"] == (0.8, 0.999)
    assert isinstance(wl.make_optimizer(model, optimizer="sgd"), torch.optim.SGD)
    assert wl.optimizer_settings()[0] == "custom"
    by_model = dict(wl.__dict__, optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1))
    by_model.pop("_held_out"), by_model.pop("_sizes")
    assert isinstance(tw.Workload(**by_model).make_optimizer(model), torch.optim.SGD)
