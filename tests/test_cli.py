"""The command line: listing, one training run, and bad input (one line, exit status 2, no traceback)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

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
    from thinwire.run.launcher import Pool
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
