"""`thinwire compare` under torchrun (thinwire/compare/cluster.py): the matrix it builds (the processes torchrun
started, `lan`), what it refuses in one line (exit 2) before any process group starts, rank 0's refusals after
it sent to the followers, and the protocol itself (rank 0 sends each run, the others follow) on two local
workers. The race across two hosts under torchrun is in tests/test_hosts.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from thinwire.cli import build_parser, main
from thinwire.compare import CompareConfig, cluster, peers
from thinwire.errors import UserError


@pytest.fixture
def torchrun(monkeypatch):
    """This process as rank 0 of 2 under torchrun; starting its process group is an error (nothing may start)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)

    def started(*a, **k):
        raise AssertionError("a process group was started")
    monkeypatch.setattr("thinwire.cli.compare.init", started)


def _refused(capsys, argv: list[str]) -> str:
    assert main(["compare", "--workload", "linreg", "--budget", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("thinwire: error: ") and "\n" not in err, err
    return err


def test_the_matrix_is_the_processes_torchrun_started_on_lan(torchrun):
    from thinwire.cli.compare import config_from_args
    args = build_parser().parse_args(["compare", "--workload", "linreg", "--algorithms", "bsp;localsgd"])
    cfg = config_from_args(args)
    assert (cfg.workers, cfg.networks, cfg.torchrun) == (2, ["lan"], True)
    args = build_parser().parse_args(["compare", "--workload", "linreg", "--algorithms", "bsp", "--network",
                                      "wan", "--workers", "2"])
    assert config_from_args(args).networks == ["wan"]      # emulated on top of the real network, as train does


def test_outside_torchrun_the_matrix_is_unchanged():
    from thinwire.cli.compare import config_from_args
    cfg = config_from_args(build_parser().parse_args(["compare", "--workload", "linreg", "--algorithms", "bsp"]))
    assert (cfg.workers, cfg.networks, cfg.torchrun) == (4, ["wan"], False)


@pytest.mark.parametrize("argv, message", [
    (["--algorithms", "bsp", "--netem"], "--netem makes network namespaces on one machine"),
    (["--algorithms", "bsp", "--workers", "3"], "--workers must be the 2 processes torchrun started, got 3"),
    (["--algorithms", "bsp;asp"], "cell 'asp': parameter-server cells need server ranks"),
    (["--algorithms", "bsp:architecture=ps"], "parameter-server cells need server ranks"),
])
def test_what_cannot_run_under_torchrun_is_refused_before_anything_starts(torchrun, capsys, argv, message):
    assert message in _refused(capsys, argv)


def test_a_peer_of_one_machine_is_refused(torchrun, capsys):
    assert peers.find("torchft-diloco").one_machine     # its Lighthouse on 127.0.0.1
    peers.register(dataclasses.replace(peers.find("ddp"), name="ddp-on-loopback",
                                       one_machine="it listens on 127.0.0.1"))
    try:
        err = _refused(capsys, ["--algorithms", "bsp;ddp-on-loopback"])
    finally:
        peers.unregister("ddp-on-loopback")
    assert "cell 'ddp-on-loopback': ddp-on-loopback runs on one machine only (it listens on 127.0.0.1)" in err


def test_cuda_is_refused_under_torchrun():
    cfg = CompareConfig(workload="linreg", workers=2, device="cuda")
    with pytest.raises(UserError, match=r"--device cuda is not supported under torchrun"):
        cluster.check(cfg, [], lambda c: 0)


def _matrix(tmp_path, torchrun: bool) -> str:
    from thinwire.compare.matrix import new_results
    cfg = CompareConfig(workload="linreg", workers=2, networks=["lan"], budget_s=1.0, torchrun=torchrun)
    (tmp_path / "results.json").write_text(json.dumps(new_results(cfg)))
    return str(tmp_path)


def test_a_torchrun_matrix_resumes_under_torchrun_only(tmp_path, capsys):
    err = _refused(capsys, ["--resume", _matrix(tmp_path, torchrun=True)])
    assert "this matrix ran under torchrun: resume it under torchrun" in err


def test_rank_0_sends_its_refusal_to_the_followers(torchrun, tmp_path, monkeypatch, capsys):
    """A local matrix resumed under torchrun: rank 0 finds out after the process group started (only it reads
    the directory), says so, and ends the followers with its status and message."""
    import thinwire.cli.compare as cli
    sent = []
    monkeypatch.setattr(cli, "init", lambda *a, **k: (0, 2))
    monkeypatch.setattr(cluster.ClusterPool, "close", lambda self, code, error=None: sent.append((code, error)))

    def exit_past_gloo(code=0):
        raise SystemExit(code)
    monkeypatch.setattr(cli, "exit_past_gloo", exit_past_gloo)
    with pytest.raises(SystemExit) as e:
        main(["compare", "--resume", _matrix(tmp_path, torchrun=False)])
    assert e.value.code == 2
    why = "this matrix is for thinwire's local worker pools: run it without torchrun"
    assert sent == [(2, why)] and capsys.readouterr().err.strip() == f"thinwire: error: {why}"


def _race_of_two(rank, world):
    """Rank 0 sends two runs (a calibration-like one and a cell), then stop with status 3; the other follows."""
    from thinwire.run.loop import train_worker
    from thinwire.run.train import TrainConfig, summarize
    if rank:
        return cluster.follow(rank, world)
    pool, out = cluster.ClusterPool(world), []
    for algorithm in ("local", "bsp"):
        cfg = TrainConfig(workload="linreg", algorithm=algorithm, workers=world, steps=6, progress=False)
        s = summarize(cfg, pool.run(train_worker, cfg.validate(), network="lan", seed=0), 0.0)[0]
        out.append((s["workers"], s["steps"], s["bytes_sent_per_worker"], s["emulated_comm_s"]))
    pool.close(3)
    return out


def test_the_followers_train_what_rank_0_sends_and_end_with_its_status(pool2):
    runs, code = pool2.run(_race_of_two)
    assert code == 3
    assert [r[:2] for r in runs] == [(2, 6), (2, 6)]
    assert runs[0][2] == 0 and runs[1][2] > 0 and runs[1][3] == 0    # local sends nothing; bsp, no emulation


def test_the_pool_runs_train_worker_only():
    with pytest.raises(TypeError, match="train_worker"):
        cluster.ClusterPool(2).run(print, 1)
