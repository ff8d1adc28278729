"""Reliability of parameter-server runs and of checkpoints (issue 10): PS checkpoint/resume (bitwise for bsp
and ssp s=0; complete for the timing-dependent asp, ssp s>0, backup), per-file checksums, and an elastic
restart under torchrun that resumes from the last checkpoint to the uninterrupted run's model."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import LazyPool
from leftovers import tagged

from thinwire.errors import UserError
from thinwire.run import checkpoint
from thinwire.run.train import TrainConfig, train_worker

PS = dict(workload="linreg", workers=2, servers=1, steps=10, progress=False, momentum=0.9)


@pytest.fixture(scope="module")
def pool3():  # 2 workers + 1 server
    p = LazyPool(3)
    yield p
    p.close()


def _run(pool, **kw):
    return pool.run(train_worker, TrainConfig(**kw).validate())


def _sha(results):
    return [r["model_sha256"] for r in results if r["role"] == "worker"]


def _server(results):
    return next(r for r in results if r["role"] == "server")["metrics"]


@pytest.mark.parametrize("algorithm, params, extra", [
    ("bsp", {"architecture": "ps"}, {}),
    # every piece of PS state: server momentum, worker error feedback, server-side downlink residual
    ("bsp", {"architecture": "ps", "downlink_compressor": "topk"}, {"compressor": "topk", "memory": "residual"}),
    ("ssp", {"staleness": 0}, {}),
    # CD-SGD on the PS: the server's momentum, the workers' W, W_prev and residuals, the k-step rule's counter
    ("cdsgd", {"architecture": "ps", "k": 2, "warmup": 2}, {}),
    # local SGD on the PS: the server's model, the workers' anchors; the cut counts pushes, one per period
    ("localsgd", {"architecture": "ps", "period": 3}, {}),
], ids=["bsp-ps", "bsp-ps-topk-both-ways", "ssp-s0", "cdsgd-ps", "localsgd-ps"])
def test_ps_resume_reproduces_the_uninterrupted_run_bitwise(pool3, tmp_path, algorithm, params, extra):
    base = dict(PS, algorithm=algorithm, params=params, **extra)
    ck, again = str(tmp_path / "ck"), str(tmp_path / "again")
    plain = _run(pool3, **base)
    whole = _run(pool3, checkpoint_every=6, checkpoint_dir=ck, **base)
    assert _sha(whole) == _sha(plain)            # checkpointing does not perturb a synchronous run
    with open(os.path.join(ck, checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["step"] == 6 and manifest["world_size"] == 3 and sorted(manifest["sha256"]) == ["0", "1", "2"]
    # the resumed run checkpoints again: the server finds the next cut (step 9) from its restored counters
    resumed = _run(pool3, resume=ck, checkpoint_every=3, checkpoint_dir=again, **base)
    assert _sha(resumed) == _sha(whole)
    assert [len(r["steps"]) for r in resumed if r["role"] == "worker"] == [10, 10]
    pushes = -(-10 // params.get("period", 1))     # local SGD: every period, and once more at close()
    assert _server(resumed)["ps_updates"] == _server(whole)["ps_updates"] == pushes
    assert checkpoint.check(again, 3, TrainConfig(**base))["step"] == 9


@pytest.mark.parametrize("algorithm, params, updates", [
    ("asp", {}, 20), ("ssp", {"staleness": 2}, 10), ("backup", {"backups": 1}, None)])
def test_timing_dependent_ps_algorithms_checkpoint_and_resume(pool3, tmp_path, algorithm, params, updates):
    """Not bitwise (their trajectory depends on arrival order), but resume is accepted, restores the server's
    counters and runs every remaining step to a finite model."""
    base = dict(PS, algorithm=algorithm, params=params)
    ck = str(tmp_path / "ck")
    whole = _run(pool3, checkpoint_every=4, checkpoint_dir=ck, **base)
    assert checkpoint.check(ck, 3, TrainConfig(**base))["step"] == 8
    resumed = _run(pool3, resume=ck, **base)
    for r in resumed:
        if r["role"] == "worker":
            assert len(r["steps"]) == 10 and all(s["loss"] == s["loss"] for s in r["steps"])
    if updates is not None:  # asp: one update per push; ssp: one per clock
        assert _server(resumed)["ps_updates"] == _server(whole)["ps_updates"] == updates


def test_checkpoint_checksum_names_the_corrupt_file(pool3, tmp_path):
    base = dict(PS, algorithm="bsp", steps=4, params={"architecture": "ps"})
    ck = str(tmp_path / "ck")
    _run(pool3, checkpoint_every=2, checkpoint_dir=ck, **base)
    for r in range(3):
        assert checkpoint.load(ck, r)["step"] == 2
    path = os.path.join(ck, "rank-2.pt")            # the server's file
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01                # one flipped bit, mid-file
        f.seek(0)
        f.write(data)
    with pytest.raises(UserError, match=r"rank-2\.pt' is corrupt: its sha256 .* differs from the manifest's"):
        checkpoint.load(ck, 2)
    assert checkpoint.load(ck, 0)["step"] == 2      # the others are intact
    with pytest.raises(UserError, match="rank-2.pt"):
        _run(pool3, resume=ck, **base)


def test_ps_checkpoint_refused_only_where_unsupported():
    # every algorithm on the PS checkpoints now (CD-SGD and its set were refused before: the server's shard and
    # momentum were not saved)
    for algorithm in ("bsp", "cdsgd", "odsgd", "bitsgd", "ssgd", "localsgd"):
        TrainConfig(**dict(PS, algorithm=algorithm, params={"architecture": "ps"}), checkpoint_every=2,
                    checkpoint_dir="unused").validate()
    for algorithm in ("asp", "ssp", "backup"):
        TrainConfig(**dict(PS, algorithm=algorithm), checkpoint_every=2, checkpoint_dir="unused").validate()
    with pytest.raises(UserError, match="nonfinite skip needs every rank"):  # it hung: servers never step
        TrainConfig(**dict(PS, algorithm="asp"), nonfinite="skip").validate()


# -- an elastic restart under torchrun -------------------------------------------------------------------
CRASH_ONCE = '''
import os
_spec = os.environ.get("THINWIRE_CRASH_ONCE")
if _spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    # "rank:step": on torchrun's first attempt only, that rank SIGKILLs itself fetching that step's batch
    import signal
    from thinwire.run import workloads as _wl
    _rank, _step = (int(v) for v in _spec.split(":"))
    _orig = _wl.ShardLoader.next
    def _next(self):
        self._crash_n = getattr(self, "_crash_n", 0) + 1
        if self.rank == _rank and self._crash_n == _step:
            os.kill(os.getpid(), signal.SIGKILL)
        return _orig(self)
    _wl.ShardLoader.next = _next
'''


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_last_checkpoint(pool2, tmp_path):
    steps, every, crash = 30, 10, 25
    reference = pool2.run(train_worker, TrainConfig(workload="linreg", workers=2, steps=steps, progress=False))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(CRASH_ONCE)
    ck, out, tag = str(tmp_path / "ck"), str(tmp_path / "out"), f"{os.getpid()}-torchrun-restart"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    # a private store per group: torchrun's shared one may hand the restarted group the failed group's
    # addresses (pytorch#135712); thinwire warns when it is missing
    env = {**os.environ, "THINWIRE_NO_PROGRESS": "1", "THINWIRE_CRASH_ONCE": f"1:{crash}",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "THINWIRE_TEST_TAG": tag, "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "thinwire", "train",
           "--workload", "linreg", "--steps", str(steps), "--checkpoint-every", str(every),
           "--checkpoint-dir", ck, "--resume", ck, "--out", out, "--json", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # SIGTERM: torchrun stops its workers (they run in sessions of their own)
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        finally:
            for pid in tagged(tag):
                os.kill(pid, signal.SIGKILL)
        raise
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exitcode: -9" in r.stderr, r.stderr[-3000:]                        # the first attempt crashed
    assert f"no checkpoint in {ck} yet: starting from step 0" in r.stderr       # ... having started fresh
    assert f"resuming from the checkpoint in {ck} (step 20)" in r.stderr, r.stderr[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in r.stderr
    summary = json.loads(r.stdout)
    assert summary["steps"] == steps and summary["workers"] == 2
    assert summary["model_sha256"] == reference[0]["model_sha256"]
    assert tagged(tag) == []
