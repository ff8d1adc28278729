"""The command line: listing, one training run, and bad input (one line, exit status 2, no traceback)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import tagged

THINWIRE = [sys.executable, "-m", "thinwire"]
ENV = {**os.environ, "THINWIRE_NO_PROGRESS": "1"}


def run(*args, timeout=300, env=None):
    return subprocess.run(THINWIRE + list(args), capture_output=True, text=True, timeout=timeout, env=env or ENV)


def test_list_json_names_every_family():
    r = run("list", "--json")
    assert r.returncode == 0, r.stderr
    cat = json.loads(r.stdout)
    assert {"workloads", "networks", "algorithms", "compressors", "memories"} <= set(cat)
    assert {"digits-mlp", "digits-cnn", "mnist1d-cnn", "linreg", "wide-mlp"} <= {w["name"] for w in cat["workloads"]}
    assert "bsp" in {a["name"] for a in cat["algorithms"]}


@pytest.mark.parametrize("args, needle", [
    (["train", "--workload", "nope"], "unknown workload 'nope'; valid:"),
    (["train", "--algorithm", "nope"], "unknown algorithm 'nope'; valid:"),
    (["train", "--network", "moon"], "unknown network 'moon'; valid:"),
    (["train", "--network", "custom:bandwidth=fast"], "malformed bandwidth"),
    (["train", "--workers", "0"], "--workers must be >= 1"),
    (["train", "--compressor", "nope"], "unknown compressor 'nope'"),
    (["train", "--epochs", "1", "--steps", "2"], "not allowed with argument"),
    (["train", "--bogus-flag", "3", "--steps", "1", "--workers", "1"], "unknown parameter 'bogus_flag'"),
    (["train", "--workers", "two"], "invalid int value"),
    (["nope"], "invalid choice"),
    (["bench", "all", "--out", "/tmp/x", "--only", "nope"], "unknown benchmark 'nope'; valid: cdsgd,"),
    (["bench", "costmodel", "--configs", "nope"], "unknown configuration 'nope'; valid: bsp"),
])
def test_bad_input_is_one_line_with_status_2(args, needle, capsys):
    from thinwire.cli import main
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_found_in_a_worker_leaves_nothing_behind():
    """A bad value only a worker can check still exits 2 with one line, and stops every worker."""
    tag = f"{os.getpid()}-worker-check"
    r = run("train", "--workload", "linreg", "--workers", "2", "--steps", "2", "--batch-size", "100000",
            env={**ENV, "THINWIRE_TEST_TAG": tag})
    assert r.returncode == 2, r.stderr
    assert "smaller than the batch size" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert tagged(f"THINWIRE_TEST_TAG={tag}") == []


def test_port_in_use_is_reported():
    from thinwire.errors import UserError
    from thinwire.launcher.pool import Pool
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        with pytest.raises(UserError, match="in use"):
            Pool(1, port=s.getsockname()[1])
    finally:
        s.close()


@pytest.mark.slow
def test_train_json_summary(tmp_path):
    r = run("train", "--workload", "linreg", "--workers", "2", "--steps", "10", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    for key in ("workload", "algorithm", "network", "workers", "steps", "wall_s", "final_loss", "time_to_target_s",
                "bytes_sent_per_worker", "nominal_bytes_per_worker", "emulated_comm_s"):
        assert key in s
    assert s["steps"] == 10 and s["bytes_sent_per_worker"] > 0
    assert (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").exists()


# bad paths and numbers (issue 18, finding 4, and a sweep of every numeric option): refused in one line with
# exit status 2 before anything starts; the launch and the comparison matrix are replaced by tripwires
LINREG = ["train", "--workload", "linreg", "--workers", "2", "--steps", "3"]
BAD_INPUTS = [
    (LINREG + ["--out", "/etc/hostname"], "--out '/etc/hostname' names a file, not a directory"),
    (LINREG + ["--out", "/etc/hostname/run"], "lies under the file '/etc/hostname'"),
    (LINREG + ["--out", "/proc/thinwire-run"], "--out '/proc/thinwire-run': cannot write in '/proc'"),
    (LINREG + ["--out", "/tmp/" + "x" * 300], "longer than 255 bytes"),
    (LINREG + ["--checkpoint-every", "2", "--checkpoint-dir", "/etc/hostname"], "--checkpoint-dir '/etc/hostname' names a file"),
    (LINREG + ["--lr", "1e300"], "--lr must be a finite number in (0, 100]"),
    (LINREG + ["--lr", "nan"], "--lr must be a finite number in (0, 100]"),
    (LINREG + ["--seed", str(2**70)], "--seed must be in 0..4294967295"),
    (LINREG + ["--seed", "-1"], "--seed must be in 0..4294967295"),
    (LINREG + ["--network", "custom:latency=1e12ms"], "latency in 'custom:latency=1e12ms' must be in 0..60s"),
    (LINREG + ["--network", "custom:jitter=2min"], "malformed jitter"),
    (LINREG + ["--network", "custom:bandwidth=10bit"], "must be in 1kbit..10000gbit"),
    (LINREG + ["--target", "nan"], "--target must be a finite number >= 0"),
    (LINREG + ["--target", "-1"], "--target must be a finite number >= 0"),
    (["train", "--workload", "linreg", "--workers", "1000000"], "must be at most 512 on one machine"),
    (LINREG + ["--servers", "-1"], "--servers must be >= 0"),
    (["train", "--workload", "linreg", "--epochs", "-1"], "--epochs must be a finite number > 0"),
    (["train", "--algorithm", "ddp", "--epochs", "0"], "--epochs must be a finite number > 0"),
    (["train", "--workload", "linreg", "--steps", "-5"], "--steps must be >= 1"),
    (LINREG + ["--batch-size", "-1"], "--batch-size must be >= 1"),
    (LINREG + ["--eval-every", "-2"], "--eval-every must be >= 1"),
    (LINREG + ["--checkpoint-every", "0", "--out", "/tmp"], "--checkpoint-every must be >= 1"),
    (LINREG + ["--momentum", "nan"], "--momentum must be in [0, 1)"),
    (LINREG + ["--progress-timeout", "0"], "--progress-timeout must be a finite number > 0"),
    (LINREG + ["--progress-timeout", "nan"], "--progress-timeout must be a finite number > 0"),
    (["advise", "--params", "nan"], "--params must be a number of parameters in 1..1e+13"),
    (["advise", "--params", "-5"], "--params must be a number of parameters in 1..1e+13"),
    (["advise", "--params", "1e6", "--compute-ms", "nan"], "--compute-ms must be in (0, 3.6e+06]"),
    (["advise", "--params", "1e6", "--workers", "0"], "--workers must be in 1..1048576"),
    (["advise", "--params", "1e6", "--servers", "-1"], "--servers must be in 0..1048576"),
    (["advise", "--params", "1e6", "--latency", "1e12ms"], "must be in 0..60s"),
    (["simulate", "--params", "nan"], "--params must be a finite number in [1, 1e+13]"),
    (["simulate", "--compute-ms", "-3"], "--compute-ms must be a finite number in (0, 3.6e+06]"),
    (["simulate", "--compute-cv", "nan"], "--compute-cv must be a finite number in [0, 10]"),
    (["simulate", "--straggler-prob", "2"], "--straggler-prob must be a finite number in [0, 1]"),
    (["simulate", "--servers", "0"], "--servers must be in 1..65536"),
    (["simulate", "--steps", "0"], "--steps must be in 1..1000000"),
    (["simulate", "--workers", "nan"], "malformed --workers list 'nan'"),
    (["simulate", "--workers", "4.5"], "malformed --workers list '4.5'"),
    (["simulate", "--latency", "1e12"], "--latency values must be one-way milliseconds in 0..60000"),
    (["simulate", "--latency", "nan"], "--latency values must be one-way milliseconds in 0..60000"),
    (["simulate", "--bandwidth", "1e400"], "--bandwidth must be in 1kbit..10000gbit"),
    (["simulate", "--seed", "-1"], "--seed must be in 0..4294967295"),
    (["simulate", "--out", "/etc/hostname"], "--out '/etc/hostname' names a file"),
    (["compare", "--algorithms", "bsp", "--workers", "0"], "--workers must be in 1..511"),
    (["compare", "--algorithms", "bsp", "--workers", "1000000"], "--workers must be in 1..511"),
    (["compare", "--algorithms", "bsp", "--epochs", "nan"], "--epochs must be a finite number > 0"),
    (["compare", "--algorithms", "bsp", "--target", "nan"], "--target must be a finite number >= 0"),
    (["compare", "--algorithms", "bsp", "--budget", "0"], "--budget must be a finite number > 0"),
    (["compare", "--algorithms", "bsp", "--seed", str(2**70)], "--seed must be in 0..4294967295"),
    (["compare", "--algorithms", "bsp", "--out", "/etc/hostname"], "--out '/etc/hostname' names a file"),
]


@pytest.mark.parametrize("args, needle", BAD_INPUTS, ids=[" ".join(a[0][3:] if a[0][0] == "train" else a[0])[:60]
                                                          for a in BAD_INPUTS])
def test_bad_paths_and_numbers_are_refused_before_anything_starts(args, needle, capsys):
    from unittest import mock

    from thinwire.cli import main

    def tripwire(*a, **k):
        raise AssertionError("started despite bad input")
    with mock.patch("thinwire.run.train.launch", tripwire), mock.patch("thinwire.cli.compare.compare", tripwire):
        assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists("/proc/thinwire-run")


def test_version_is_the_packages_one(capsys):
    """`thinwire --version` prints `thinwire.__version__`, the one source pyproject.toml reads (dynamic attr)."""
    import tomllib

    import thinwire
    from thinwire.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"thinwire {thinwire.__version__}"
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "thinwire.__version__"}


def test_every_extra_the_command_names_exists():
    """Every `thinwire[EXTRA]` that the help or a message names is an optional dependency of the package."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = set(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {m for f in (root / "thinwire").rglob("*.py") for m in re.findall(r"thinwire\[(\w+)\]", f.read_text())}
    assert named and named <= extras, sorted(named - extras)
