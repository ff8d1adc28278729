"""Every input checked before work starts, through one path (issue 34, item 4): the registry converts and checks
every parameter by its constructor's signature and declared `limits` (type, finiteness, range), `TrainConfig.validate`
checks each run's pairings before any worker starts, and `train`, `compare`'s cells, `bench`, `simulate` and the
Python API all go through them. Each case: one line, exit status 2, no worker started (every pool start and
launch is a tripwire), in-process."""
from __future__ import annotations

import hashlib
import json
import os
from unittest import mock

import pytest
import torch

import thinwire as tw
from thinwire import compressors, memories
from thinwire.errors import UserError
from thinwire.registry import Param, at_least, between, check_params

L = ["train", "--workload", "linreg", "--workers", "2", "--steps", "3"]
D = ["train", "--workload", "digits-mlp", "--workers", "2", "--steps", "3"]


def _compare(cells, *more, out="/tmp/thinwire-never"):
    return ["compare", "--workload", "linreg", "--workers", "2", "--budget", "5", "--algorithms", cells,
            "--out", out, *more]


# the 28 inputs of issue 34 that misbehaved, and the 9 refused only after the workers started (the two damaged
# rank files are below): (command line, what the one line says)
BAD = [
    # compare's cells: checked up front, as `thinwire train` checks a run (they ran the reference, wrote out/,
    # then failed the cell, or exited 0)
    (_compare("bsp+topk:ratio=2"), "cell 'bsp+topk:ratio=2': ratio must be in (0, 1]"),
    (_compare("dts:delay=-1"), "cell 'dts:delay=-1': delay must be an integer >= 1, got -1"),
    (_compare("dpsgd+topk"), "cell 'dpsgd+topk': algorithm 'dpsgd' does not exchange gradients through a compressor"),
    (_compare("bsp:servers=2"), "cell 'bsp:servers=2': --servers is for the parameter-server architecture"),
    (_compare("localsgd:period=abc"), "algorithm 'localsgd': period must be an integer, got 'abc'"),
    (_compare("bsp+qsgd:levels=nan"), "compressor 'qsgd': levels must be an integer, got nan"),
    (_compare("bsp,dts:delay=0"), "cell 'dts:delay=0': delay must be an integer >= 1, got 0"),
    # parameters accepted that cannot work
    (L + ["--compressor", "terngrad", "--clip", "nan"], "compressor 'terngrad': clip must be a finite number"),
    (L + ["--compressor", "dgc", "--warmup-steps", "-5"], "compressor 'dgc': warmup_steps must be an integer >= 0"),
    (L + ["--compressor", "gaussiank", "--adjust", "-3"], "compressor 'gaussiank': adjust must be an integer >= 0"),
    (L + ["--bucket-mb", "nan"], "schedule: bucket_mb must be a finite number >= 0, got 'nan'"),
    (D + ["--target", "5"], "--target must be an accuracy in [0, 1] for workload 'digits-mlp'"),
    (["compare", "--workload", "digits-mlp", "--algorithms", "bsp", "--target", "5", "--out", "/tmp/thinwire-never"],
     "--target must be an accuracy in [0, 1] for workload 'digits-mlp'"),
    (L + ["--out", ""], "--out needs a directory name, got ''"),
    # accepted, then failing at step 1 with a traceback that blamed something else
    (L + ["--compressor", "fp16", "--scale", "inf"], "compressor 'fp16': scale must be a finite number"),
    (L + ["--memory", "residual", "--beta", "inf"], "memory 'residual': beta must be a finite number"),
    # benchmarks and simulate
    (["bench", "compressors", "--out", "/etc/hostname"], "--out '/etc/hostname' names a file, not a directory"),
    (["bench", "compressors", "--only", "randomk", "--set", "ratio=2"], "ratio must be in (0, 1], got 2.0"),
    (["bench", "compressors", "--only", "qsgd", "--set", "ratio=0.1"], "--set ratio: none of the compressors"),
    (["bench", "latency", "--latencies", "abc"], "--latencies takes one-way milliseconds separated by commas"),
    (["bench", "matrix", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["bench", "matrix", "--epochs", "-1"], "--epochs must be a finite number > 0"),
    (["bench", "matrix", "--out", "/tmp"], "--out '/tmp' names a directory, not a file"),
    (["simulate", "--algorithms", ","], "--algorithms names no schedule"),
    (["simulate", "--algorithms", "dts:delay=2.5"], "schedule 'dts': delay must be an integer, got '2.5'"),
    # refused only after the workers had started (7-11 s instead of ~2.5 s)
    (L + ["--allreduce", "nosuch"], "unknown all-reduce algorithm 'nosuch'"),
    (L + ["--algorithm", "backup", "--backups", "2"], "backups=2 leaves no gradient to wait for with 2 workers"),
    (L + ["--algorithm", "cdsgd", "--on-failure", "continue"], "needs an algorithm whose averages stay meaningful"),
    (L + ["--algorithm", "dts", "--optimizer", "adamw"], "dts compensates plain or momentum SGD; got optimizer AdamW"),
    (L + ["--algorithm", "cdsgd", "--optimizer", "adamw"], "use torch.optim.SGD (got AdamW)"),
    (L + ["--schedule", "priority", "--nonfinite", "skip"], "nonfinite='skip' needs schedule='none'"),
    (L + ["--batch-size", "100000"], "a worker's shard of 768 samples is smaller than the batch size 100000"),
    # the exchange names the collective; the compressors' old spellings are refused naming it
    (L + ["--compressor", "topk", "--sparse-collective", "ring"], "unknown sparse collective 'ring'; valid: allgather"),
    (L + ["--compressor", "qsgd", "--sparse-collective", "gtopk"], "needs a top-k-family compressor, not 'qsgd'"),
    (L + ["--compressor", "topk", "--collective", "allreduce"], "compressor 'topk' (aggregation 'allgather', "
                                                               "linear=False) cannot use collective 'allreduce'"),
    (L + ["--compressor", "int8", "--aggregation", "allreduce"], "compressor 'int8' no longer takes aggregation: the "
                                                                 "collective is the exchange's parameter"),
    # runs that could never end, and an optimizer that would silently be another
    (L[:5] + ["--seed", "0", "--steps", str(10**20)], f"--steps {10**20} is more than any run could reach: at most "
                                                       f"1,000,000,000 steps"),
    (L[:5] + ["--seed", "0", "--epochs", "1e300"], "--epochs 1e+300 (4.8e+301 steps) is more than any run could reach"),
    (L[:5] + ["--seed", "0", "--epochs", "1e308"], "--epochs 1e+308 is more than any run could reach"),
    (L + ["--optimizer", "muon"], "this model has none, so Muon would train nothing: use --optimizer adamw"),
    (D[:5] + ["--seed", "0", "--workload", "digits-cnn", "--optimizer", "muon"], "Muon would train nothing"),
]


class Started(AssertionError):
    pass


def _tripwire(*a, **k):
    raise Started("a worker started despite bad input")


def _refused(args, capsys) -> str:
    from thinwire.cli import main
    with mock.patch("thinwire.launcher.pool.Pool.__init__", _tripwire), \
            mock.patch("thinwire.run.train.launch", _tripwire):
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("args, needle", BAD, ids=[" ".join(a[7:] if a[0] == "compare" else a[1:] if a[0] != "train"
                                                            else a[7:])[:50] for a, _ in BAD])
def test_bad_input_is_refused_before_any_worker_starts(args, needle, capsys):
    err = _refused(args, capsys)
    assert needle in err, err
    assert not os.path.exists("/tmp/thinwire-never")


def _config(**kw):
    from thinwire.run.train import TrainConfig
    return TrainConfig(**{"workload": "linreg", "workers": 2, **kw}).validate()


@pytest.mark.parametrize("call, needle", [
    (lambda: compressors.get("qsgd", levels=2.5), "compressor 'qsgd': levels must be an integer, got 2.5"),
    (lambda: compressors.get("terngrad", clip=float("nan")), "compressor 'terngrad': clip must be a finite number"),
    (lambda: memories.get("residual", beta=float("inf")), "memory 'residual': beta must be a finite number"),
    (lambda: compressors.get("qsgd", levels=True), "levels must be an integer, got True"),
    (lambda: compressors.get("randomk", scale=2), "scale must be true or false, got 2"),
    (lambda: compressors.get("topk", seed=-1), "seed must be an integer in 0..9.22337e+18, got -1"),
    (lambda: tw.algorithms.get("localsgd", period=4.5), "period must be an integer"),
    (lambda: compressors.get("topk", sparse_collective="gtopk"), "compressor 'topk' no longer takes sparse_collective"),
    (lambda: tw.ddp_hook("int8", aggregation="allreduce"), "compressor 'int8' no longer takes aggregation"),
    (lambda: _config(steps=10**9 + 1), "--steps 1000000001 is more than any run could reach"),
    (lambda: _config(epochs=1e300), "--epochs 1e+300 (4.8e+301 steps) is more than any run could reach"),
    (lambda: _config(optimizer="muon"), "Muon would train nothing"),
    (lambda: tw.optim.MuonWithAdamW([], [torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.0),
     "Muon would train nothing"),
    (lambda: tw.Trainer(torch.nn.Linear(3, 1), torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1)),
     "the optimizer holds 2 of 2 tensors that are not the model's parameters"),
])
def test_the_python_api_takes_the_same_path(call, needle):
    with pytest.raises(UserError) as err:
        call()
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1


def test_values_convert_by_declared_type():
    assert compressors.get("qsgd", levels=3.0).levels == 3            # 3.0 is the integer 3; 2.5 is refused
    assert compressors.get("qsgd", levels="1e1").levels == 10
    assert tw.algorithms.get("choco", gamma="0.5").gamma == 0.5 and tw.algorithms.get("choco").gamma == "auto"
    p = {"n": Param("n", (int, type(None)), None, at_least(1)), "x": Param("x", (float,), 0.5, between(0, 1))}
    assert check_params("t", p, {"n": "4", "x": "1"}) == {"n": 4, "x": 1.0}
    assert check_params("t", p, {"n": None}) == {"n": None}
    with pytest.raises(UserError, match=r"t: x must be a finite number in \[0, 1\], got '1.5'"):
        check_params("t", p, {"x": "1.5"})


@pytest.mark.parametrize("name, params, typed", [
    ("ddp-postlocalsgd", {"period": "4"}, {"period": 4}),
    ("ddp-powersgd", {"rank": "2"}, {"rank": 2}),
    ("ddp-hierarchical", {"period": "4", "local_period": "2", "group": "1"}, {"period": 4, "local_period": 2,
                                                                             "group": 1}),
])
def test_peer_parameters_parse_like_every_other(name, params, typed):
    """`thinwire train --algorithm ddp-postlocalsgd --period 4` was refused ("got '4'")."""
    from thinwire.compare.peers import resolve
    from thinwire.run.train import TrainConfig
    cfg = resolve(TrainConfig(workload="linreg", algorithm=name, workers=2, steps=3, params=params)).validate()
    assert cfg.params == typed
    with pytest.raises(UserError, match="period must be an integer >= 1, got '0'"):
        resolve(TrainConfig(workload="linreg", algorithm="ddp-postlocalsgd", workers=2,
                            params={"period": "0"})).validate()


def _checkpoint(directory, cfg, world=2, step=2):
    """A committed checkpoint of `cfg` at `step`, written the way `checkpoint.save` writes one (no workers)."""
    from thinwire.run import checkpoint
    os.makedirs(directory)
    sums = {}
    for r in range(world):
        path = os.path.join(directory, f"rank-{r}.pt")
        torch.save({"step": step, "trainer": {"w": torch.ones(3)}}, path)
        sums[str(r)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    manifest = {"step": step, "world_size": world, "fingerprint": checkpoint.fingerprint(cfg),
                "algorithm": cfg.algorithm, "workload": cfg.workload, "sha256": sums}
    with open(os.path.join(directory, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return manifest


def test_damaged_rank_files_are_refused_before_any_worker_starts(tmp_path, capsys):
    """A flipped byte, a truncated file, a planted object: the launcher reads every rank's file as the rank will."""
    import argparse

    from thinwire.run.train import TrainConfig
    ck = str(tmp_path / "ck")
    manifest = _checkpoint(ck, TrainConfig(workload="linreg", workers=2, steps=3))
    args = L + ["--resume", ck, "--quiet"]
    rank1 = os.path.join(ck, "rank-1.pt")
    data = open(rank1, "rb").read()
    with open(rank1, "wb") as f:
        f.write(data[:-40] + bytes([data[-40] ^ 1]) + data[-39:])
    assert f"checkpoint file '{rank1}' is corrupt: its sha256" in _refused(args, capsys)
    with open(rank1, "wb") as f:
        f.write(data[:100])
    assert f"checkpoint file '{rank1}' is corrupt" in _refused(args, capsys)
    torch.save({"step": 2, "trainer": argparse.Namespace(x=1)}, rank1)    # its checksum in the manifest: planted
    manifest["sha256"]["1"] = hashlib.sha256(open(rank1, "rb").read()).hexdigest()
    with open(os.path.join(ck, "checkpoint.json"), "w") as f:
        json.dump(manifest, f)
    assert "it refers to argparse.Namespace, which is not a tensor" in _refused(args, capsys)
