"""Fault injection (issue 10): killed workers and servers, crashes while checkpointing, corrupt checkpoints,
NaN gradients, mismatched models, malformed command lines and stalling links. Each case ends with a clear
error or a result identical to the fault-free run, and leaves no process or network namespace behind.

Faults are injected from the outside (SIGKILL from a timer) or from inside a worker through a hook installed by
the test only: a `sitecustomize.py` on PYTHONPATH for CLI subprocesses, a wrapper around `train_worker` for
pool runs. Production code carries no test hooks."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from leftovers import tagged
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from thinwire.errors import UserError, WorkerError
from thinwire.run import checkpoint, workloads
from thinwire.run.train import TrainConfig, train_worker

THINWIRE = [sys.executable, "-m", "thinwire"]
ENV = {**os.environ, "THINWIRE_NO_PROGRESS": "1"}


# -- leftovers -------------------------------------------------------------------------------------------
def _assert_nothing_left(tag: str, grace: float = 10.0) -> None:
    end = time.monotonic() + grace
    while tagged(tag) and time.monotonic() < end:
        time.sleep(0.2)
    assert tagged(tag) == [], f"processes left behind: {tagged(tag)}"


def _netns() -> set[str] | None:
    try:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()} if r.returncode == 0 else None


def _owner_alive(ns: str) -> bool:
    """netem names its namespaces tw<launcher pid>n<rank>: a namespace whose launcher is gone is leaked."""
    digits = ns[2:].split("n")[0] if ns.startswith("tw") else ""
    return not digits.isdigit() or os.path.exists(f"/proc/{digits}")


@pytest.fixture(scope="module", autouse=True)
def no_leaked_namespaces():
    before = _netns()
    yield
    after = _netns()
    if before is not None and after is not None:
        leaked = sorted(n for n in after - before if not _owner_alive(n))
        assert leaked == [], f"network namespaces left behind: {leaked}"


# -- 1. a worker killed at a random step, through the CLI ------------------------------------------------
SITECUSTOMIZE = '''
import os
_spec = os.environ.get("THINWIRE_FAULT")
if _spec:  # "rank:step:stampfile": that rank SIGKILLs itself when it fetches the batch of that step
    import signal, time
    from thinwire.run import workloads as _wl
    _rank, _step, _stamp = _spec.split(":", 2)
    _orig = _wl.ShardLoader.next
    def _next(self):
        self._fault_n = getattr(self, "_fault_n", 0) + 1
        if self.rank == int(_rank) and self._fault_n == int(_step):
            with open(_stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return _orig(self)
    _wl.ShardLoader.next = _next
_stall = os.environ.get("THINWIRE_STALL")
if _stall:  # "rank:step": that rank's training thread blocks for good when it fetches that step's batch
    import time
    from thinwire.run import workloads as _wl2
    _srank, _sstep = (int(v) for v in _stall.split(":"))
    _orig2 = _wl2.ShardLoader.next
    def _next2(self):
        self._stall_n = getattr(self, "_stall_n", 0) + 1
        if self.rank == _srank and self._stall_n == _sstep:
            time.sleep(10**6)
        return _orig2(self)
    _wl2.ShardLoader.next = _next2
'''
STEPS, EVERY, NET = 80, 7, "custom:latency=10ms"   # >= 10 ms per step: a run outlives its first checkpoint
RUN = ["train", "--workload", "linreg", "--workers", "2", "--steps", str(STEPS), "--network", NET, "--json",
       "--quiet"]


def _cli(args, env=None, timeout=300):
    return subprocess.run(THINWIRE + list(args), capture_output=True, text=True, timeout=timeout, env=env or ENV)


def _run(pool, **kw) -> dict:
    """RUN in this process on a shared pool (the kill is what crosses the process boundary, not the reference
    run nor the resume): the summary `thinwire train --json` prints."""
    from thinwire.run.train import run_training
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=STEPS, network=NET, progress=False, **kw)
    return run_training(cfg, pool=pool)


@pytest.fixture(scope="module")
def uninterrupted(pool2, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return _run(pool2, checkpoint_every=EVERY, checkpoint_dir=str(out / "checkpoint"))


def _check_intact(ck: str) -> int:
    """The manifest reads, every rank's file loads at the manifest's step; returns that step."""
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    for r in range(2):
        assert checkpoint.load(ck, r)["step"] == manifest["step"]
    return manifest["step"]


def _resume_and_compare(out, whole, pool):
    resumed = _run(pool, resume=os.path.join(out, "checkpoint"))
    assert resumed["steps"] == STEPS
    assert resumed["final_loss"] == whole["final_loss"]
    assert resumed["model_sha256"] == whole["model_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2])
def test_worker_killed_at_a_random_step_resumes_to_the_same_model(seed, uninterrupted, pool2, tmp_path):
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(EVERY + 1, STEPS)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    stamp, out, tag = tmp_path / "killed_at", str(tmp_path / "run"), f"{os.getpid()}-kill-{seed}"
    env = {**ENV, "THINWIRE_FAULT": f"{rank}:{step}:{stamp}", "THINWIRE_TEST_TAG": tag,
           "PYTHONPATH": os.pathsep.join([str(hooks), ENV.get("PYTHONPATH", "")])}
    r = _cli(RUN + ["--checkpoint-every", str(EVERY), "--out", out], env=env)
    exited = time.time()
    assert r.returncode == 1, r.stderr
    assert f"worker {rank} failed: worker process died (killed by signal 9)" in r.stderr, r.stderr
    assert exited - float(stamp.read_text()) < 30  # detected within seconds (generous: shared machine)
    _assert_nothing_left(tag)
    assert _check_intact(os.path.join(out, "checkpoint")) == (step - 1) // EVERY * EVERY
    _resume_and_compare(out, uninterrupted, pool2)


@pytest.mark.slow
def test_a_stalled_training_thread_stops_the_cli_in_one_line(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    tag = f"{os.getpid()}-stall"
    env = {**ENV, "THINWIRE_STALL": "1:6", "THINWIRE_TEST_TAG": tag,
           "PYTHONPATH": os.pathsep.join([str(hooks), ENV.get("PYTHONPATH", "")])}
    r = _cli(["train", "--workload", "linreg", "--workers", "2", "--steps", "1000000", "--quiet",
              "--progress-timeout", "2"], env=env)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thinwire: rank 1 made no progress for "), r.stderr
    assert "(stuck at step 5; others at step 6)" in lines[0], r.stderr
    stacks = lines[0].rpartition("(every worker's Python stacks: ")[2].rstrip(")")   # aside, in a file
    text = open(stacks).read()
    os.unlink(stacks)
    assert "--- Python stacks of worker 1 when the launcher gave up ---" in text and "worker 0" in text, text
    assert " in _next2" in text.split("of worker 1 when")[1], text        # where the stalled thread sleeps
    _assert_nothing_left(tag)


def _children(parent: int) -> list[int]:
    """The launcher's worker processes, in start order = rank order: the children of its fork server (the one
    child of the launcher whose command line runs multiprocessing's forkserver)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                procs[int(pid)] = (ppid, f.read())
        except (OSError, ValueError, IndexError):
            continue
    servers = {pid for pid, (ppid, cmd) in procs.items() if ppid == parent and b"forkserver" in cmd}
    return sorted(pid for pid, (ppid, _) in procs.items() if ppid in servers)


@pytest.mark.slow
def test_worker_killed_by_a_timer_after_a_checkpoint_resumes_to_the_same_model(uninterrupted, pool2, tmp_path):
    out, tag = str(tmp_path / "run"), f"{os.getpid()}-timer-kill"
    proc = subprocess.Popen(THINWIRE + RUN + ["--checkpoint-every", str(EVERY), "--out", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "THINWIRE_TEST_TAG": tag})
    manifest = os.path.join(out, "checkpoint", checkpoint.MANIFEST)
    deadline = time.monotonic() + 300
    while not os.path.exists(manifest) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = _children(proc.pid)
    assert len(workers) == 2 and proc.poll() is None, "the run ended before its first checkpoint"
    victim = random.Random(3).randrange(2)
    os.kill(workers[victim], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert time.monotonic() - killed < 30
    assert f"worker {victim} failed: worker process died (killed by signal 9)" in err, err
    _assert_nothing_left(tag)
    assert _check_intact(os.path.join(out, "checkpoint")) % EVERY == 0
    _resume_and_compare(out, uninterrupted, pool2)


# -- 2. a crash while writing a checkpoint ---------------------------------------------------------------
def _ck_run(pool, ck, steps, resume=None):
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=steps, progress=False,
                      checkpoint_every=None if resume else 2, checkpoint_dir=None if resume else ck, resume=resume)
    cfg.validate()
    return pool.run(train_worker, cfg)


def test_crash_while_checkpointing_leaves_the_previous_checkpoint_usable(pool2, tmp_path):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    whole = _ck_run(pool2, new, 6)       # checkpoints at steps 2 and 4 (the last one stays)
    _ck_run(pool2, old, 3)               # a checkpoint at step 2 only
    sha = [r["model_sha256"] for r in whole]
    assert _check_intact(new) == 4 and _check_intact(old) == 2

    # killed inside torch.save of step 4: a truncated temporary file beside the step-2 checkpoint
    crash = str(tmp_path / "during-save")
    shutil.copytree(old, crash)
    with open(os.path.join(new, "rank-0.pt"), "rb") as f:
        blob = f.read()
    for name in ("rank-0.step-4.pt.tmp", "rank-1.pt.tmp"):
        with open(os.path.join(crash, name), "wb") as f:
            f.write(blob[:len(blob) // 3])
    # ... or after rank 0 staged its step-4 file, before the manifest committed it
    shutil.copy(os.path.join(new, "rank-0.pt"), os.path.join(crash, "rank-0.step-4.pt"))
    assert [r["model_sha256"] for r in _ck_run(pool2, None, 6, resume=crash)] == sha

    # killed after the manifest committed step 4, before rank 0 promoted its staged file
    late = str(tmp_path / "before-promotion")
    shutil.copytree(new, late)
    os.replace(os.path.join(late, "rank-0.pt"), os.path.join(late, "rank-0.step-4.pt"))
    shutil.copy(os.path.join(old, "rank-0.pt"), os.path.join(late, "rank-0.pt"))
    assert [r["model_sha256"] for r in _ck_run(pool2, None, 6, resume=late)] == sha

    # files of different steps under one manifest are refused, never mixed
    os.remove(os.path.join(late, "rank-0.step-4.pt"))
    with pytest.raises(UserError, match="inconsistent"):
        _ck_run(pool2, None, 6, resume=late)


# -- 3. a corrupt checkpoint through the CLI -------------------------------------------------------------
def test_corrupt_checkpoint_is_one_line_and_status_2(pool2, tmp_path):
    ck = str(tmp_path / "ck")
    _ck_run(pool2, ck, 3)
    args = ["train", "--workload", "linreg", "--workers", "2", "--steps", "4", "--resume", ck, "--quiet"]
    with open(os.path.join(ck, "checkpoint.json"), "r+") as f:
        text = f.read()
        f.seek(0)
        f.write(text[:len(text) // 2])
        f.truncate()
    r = _cli(args)
    assert r.returncode == 2 and "unreadable" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with open(os.path.join(ck, "checkpoint.json"), "w") as f:
        f.write(text)
    with open(os.path.join(ck, "rank-1.pt"), "r+b") as f:
        f.truncate(100)
    tag = f"{os.getpid()}-corrupt"
    r = _cli(args, env={**ENV, "THINWIRE_TEST_TAG": tag})
    assert r.returncode == 2, r.stderr
    assert "rank-1.pt" in r.stderr and "corrupt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    _assert_nothing_left(tag)


# -- 4. NaN in a gradient at a chosen step; 5. a mismatched model on one rank ----------------------------
def _train_with_fault(rank, world_size, cfg, fault, bad_rank, at_step):
    """train_worker with a fault on `bad_rank`: a NaN input at `at_step` ("nan"), a model of another shape
    ("shape") or another initial value without the start-up broadcast ("value")."""
    orig_next, orig_model = workloads.ShardLoader.next, workloads.Workload.model
    calls = [0]

    def nan_next(self):
        x, y = orig_next(self)
        calls[0] += 1
        if calls[0] == at_step:
            x = x.clone()
            x[0, 0] = float("nan")
        return x, y

    def other_model(self, seed=0):
        if fault == "shape":
            return torch.nn.Linear(16, 2, bias=False).double()
        return orig_model(self, seed + 1)

    try:
        if rank == bad_rank and fault == "nan":
            workloads.ShardLoader.next = nan_next
        if rank == bad_rank and fault in ("shape", "value"):
            workloads.Workload.model = other_model
        if fault == "value":
            from thinwire.trainer import Trainer
            model = workloads.get(cfg.workload).model(cfg.seed)
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_initial_model=False)
            return None
        out = train_worker(rank, world_size, cfg)
        return {"sha": out["model_sha256"], "skipped": out["metrics"]["skipped_steps"], "final": out["final"]}
    finally:
        workloads.ShardLoader.next, workloads.Workload.model = orig_next, orig_model


def _linreg(**kw):
    return TrainConfig(**{"workload": "linreg", "workers": 2, "steps": 6, "progress": False, **kw})


def test_nan_gradient_is_skipped_by_all_or_stops_all(pool2):
    for algorithm in ("bsp", "localsgd"):
        out = pool2.run(_train_with_fault, _linreg(algorithm=algorithm, nonfinite="skip"), "nan", 1, 3)
        assert [o["skipped"] for o in out] == [1, 1], algorithm
        assert out[0]["sha"] == out[1]["sha"] and all(math.isfinite(o["final"]) for o in out), algorithm
    # caught by the trainer before the step, or by the exchange before it sends a bucket (bsp checks each
    # bucket during backward): either way nothing is applied, every rank stops, the error names the rank
    says = r"rank 0: (NaN or Inf in the gradient at step 4|non-finite value \(NaN/Inf\) .* nothing was sent)"
    for algorithm in ("bsp", "localsgd"):
        with pytest.raises(WorkerError, match=says) as err:
            pool2.run(_train_with_fault, _linreg(algorithm=algorithm, nonfinite="stop"), "nan", 0, 4)
        assert err.value.rank == 0


def test_mismatched_model_on_one_rank_is_refused_at_start_up(pool2):
    with pytest.raises(UserError, match="differ in shapes"):
        pool2.run(_train_with_fault, _linreg(), "shape", 1, 0)
    with pytest.raises(UserError, match="differ in initial values"):
        pool2.run(_train_with_fault, _linreg(), "value", 1, 0)


# -- 6. malformed command lines --------------------------------------------------------------------------


def _train_flags() -> list[str]:
    from thinwire.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    train = sub.choices["train"]
    return sorted(o for a in train._actions for o in a.option_strings if o not in ("-h", "--help"))


FLAGS = _train_flags()
VALUES = st.one_of(
    st.integers(-3, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["linreg", "bsp", "dts", "localsgd", "topk", "qsgd", "lan", "wan", "ps", "stop", "skip",
                     "custom:latency=1ms,loss=0.5", "custom:bandwidth=x", "custom:", "nan", "-inf", "1e309",
                     "0", "-1", "", " ", "=", "--", "k=3", "ratio=2"]),
    st.text(max_size=12))
TOKENS = st.one_of(st.sampled_from(FLAGS), VALUES, st.sampled_from(["--k", "--ratio", "--delay", "--period",
                                                                    "--param", "--x-y", "-", "--=1"]))
SAFE = ["--steps", "1", "--workers", "1", "--workload", "linreg"]


def _fake_run_training(cfg, out=None, pool=None):
    """Everything a real run checks before and at the start of training, without launching it."""
    cfg.validate()
    wl = workloads.get(cfg.workload)
    cfg.total_steps(wl)
    workloads.ShardLoader(*wl.shard(0, cfg.workers), cfg.batch_size or wl.batch_size)
    return {"metric": "loss", "time_to_target_s": None, "steps_to_target": None, "algorithm": cfg.algorithm,
            "workload": cfg.workload, "workers": cfg.workers, "network": cfg.network, "steps": 1,
            "step_time_s": 0.0, "final_loss": 0.0, "target": 0.0, "wall_s": 0.0, "train_s": 0.0,
            "bytes_sent_per_worker": 0.0, "nominal_bytes_per_worker": 0.0, "emulated_comm_s": 0.0,
            "exposed_comm_s": 0.0, "algorithm_metrics": {}}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(tokens=st.lists(TOKENS, max_size=10), safe=st.booleans(), command=st.sampled_from(["train", "train", "x"]))
@example(tokens=["--epochs", "inf", "--workload", "linreg"], safe=False, command="train")  # found: OverflowError
@example(tokens=["--lr", "inf"], safe=True, command="train")                            # found: accepted
@example(tokens=["--epochs", "nan"], safe=False, command="train")
def test_fuzzed_command_lines_exit_0_or_2_with_one_line(tokens, safe, command):
    from unittest import mock

    from thinwire.cli import main
    argv = [command] + (SAFE if safe else []) + tokens
    err, out = io.StringIO(), io.StringIO()
    with mock.patch("thinwire.cli.train.run_training", _fake_run_training), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    assert code in (0, 2), (argv, code, err.getvalue())
    if code == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("thinwire: error: "), (argv, err.getvalue())


def test_fuzz_harness_reaches_the_launch(capsys):
    """The fuzzing above is not vacuous: a valid command line gets through every check to the fake launch, and
    the fake is what the command calls (no worker starts)."""
    from unittest import mock

    from thinwire.cli import main
    with mock.patch("thinwire.cli.train.run_training", side_effect=_fake_run_training) as fake, \
            mock.patch("thinwire.launcher.pool.Pool", side_effect=AssertionError("a worker pool started")):
        assert main(["train", *SAFE, "--algorithm", "localsgd", "--period", "3", "--json"]) == 0
    assert fake.call_count == 1 and "period" in fake.call_args.args[0].params
    assert json.loads(capsys.readouterr().out)["algorithm"] == "localsgd"


# -- 7. a parameter server killed mid-run ----------------------------------------------------------------
def _kill_self_after(rank, world_size, cfg, victim, after_s, stamp):
    if rank == victim:
        def die():
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(after_s, die).start()
    return train_worker(rank, world_size, cfg)


def test_parameter_server_killed_mid_run_stops_the_run_naming_it(tmp_path):
    from thinwire import algorithms
    from thinwire.launcher.pool import Pool
    try:
        import thinwire.comm.ps  # noqa: F401
    except ImportError:
        pytest.skip("no parameter server (thinwire.comm.ps) in this tree")
    if "ps" not in algorithms.registry.lookup("bsp").architectures:
        pytest.skip("bsp has no parameter-server architecture in this tree")
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, servers=1, steps=10**6, progress=False,
                      network="custom:latency=2ms", params={"architecture": "ps"}).validate()
    stamp = str(tmp_path / "killed_at")
    pool = Pool(3, timeout=300)
    pids = pool.pids
    with pytest.raises(WorkerError) as err:
        pool.run(_kill_self_after, cfg, 2, 3.0, stamp, network=cfg.network)
    assert time.time() - float(open(stamp).read()) < 30
    assert err.value.rank == 2 and "killed by signal 9" in err.value.cause, str(err.value)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


# -- 8. a link that stalls for seconds: asynchronous algorithms finish -----------------------------------
@pytest.mark.parametrize("algorithm, params", [("dts", {"delay": 2, "period": 2}), ("localsgd", {"period": 2}),
                                               ("adpsgd", {})])
def test_stalling_link_deadlocks_no_asynchronous_algorithm(algorithm, params, pool2):
    net = "custom:latency=1ms,loss=0.5"   # half the transfers stall >= 200 ms
    cfg = _linreg(algorithm=algorithm, params=params, network=net, steps=10)
    out = pool2.run(train_worker, cfg, network=net, timeout=240)
    assert [len(o["steps"]) for o in out] == [10, 10]
    assert all(math.isfinite(o["final"]) for o in out)
    assert all(o["meter"]["total"]["emulated_s"] > 0.2 for o in out)  # the link did stall


# -- 9. SIGTERM; planted checkpoints -----------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_ends_the_run_in_one_line_with_checkpoints_intact(tmp_path):
    out, tag = str(tmp_path / "run"), f"{os.getpid()}-sigterm"
    proc = subprocess.Popen(THINWIRE + RUN + ["--checkpoint-every", str(EVERY), "--out", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "THINWIRE_TEST_TAG": tag})
    manifest = os.path.join(out, "checkpoint", checkpoint.MANIFEST)
    deadline = time.monotonic() + 300
    while not os.path.exists(manifest) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    # one line of thinwire's and nothing else: no "leaked semaphore" of multiprocessing's resource tracker (the
    # pool ends its queues' feeder threads on close; tests/test_launcher.py checks that directly)
    assert err.strip().splitlines() == ["thinwire: terminated (SIGTERM)"], err
    _assert_nothing_left(tag)
    assert _check_intact(os.path.join(out, "checkpoint")) % EVERY == 0


def _plant(ck: str, rank: int, obj) -> None:
    """Replace a rank's file and make the manifest vouch for it (someone who can write the directory can)."""
    path = os.path.join(ck, f"rank-{rank}.pt")
    torch.save(obj, path)
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    import hashlib
    manifest["sha256"][str(rank)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with open(os.path.join(ck, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_planted_checkpoints_are_refused_in_one_line(pool2, tmp_path, capfd):
    import argparse

    from thinwire.cli import main
    ck = str(tmp_path / "ck")
    _ck_run(pool2, ck, 3)  # a checkpoint at step 2
    _plant(ck, 1, {"step": 2, "trainer": argparse.Namespace(x=1)})
    capfd.readouterr()
    assert main(["train", "--workload", "linreg", "--workers", "2", "--steps", "4", "--resume", ck, "--quiet"]) == 2
    err = capfd.readouterr().err  # the workers' output included
    assert err.strip().splitlines() == [
        f"thinwire: error: checkpoint file '{ck}/rank-1.pt' is refused: it refers to argparse.Namespace, which is "
        f"not a tensor or a plain container (torch.load(weights_only=True) refused it; nothing in it was run)"], err
    # a file of tensors that is no checkpoint; a raw pickle; a manifest of the wrong shape: one line each
    _plant(ck, 1, torch.ones(3))
    with pytest.raises(UserError, match=r"rank-1.pt' is not a thinwire checkpoint") as e:
        checkpoint.load(ck, 1)
    import pickle
    with open(os.path.join(ck, "rank-0.pt"), "wb") as f:
        pickle.dump({"step": 2}, f)
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    manifest.pop("sha256")  # a manifest from before checksums: nothing vouches, torch.load decides
    with open(os.path.join(ck, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(UserError, match=r"rank-0.pt' is refused: it holds something that is not a tensor") as e0:
        checkpoint.load(ck, 0)
    with open(os.path.join(ck, checkpoint.MANIFEST), "w") as f:
        json.dump([manifest], f)
    with pytest.raises(UserError, match="is not a thinwire manifest") as e2:
        checkpoint.check(ck, 2, _linreg())
    assert all(len(str(x.value).splitlines()) == 1 for x in (e, e0, e2))
    assert capfd.readouterr().err == ""  # no warning from torch either
