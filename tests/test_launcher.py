"""The embedded launcher: results by rank, failures named with their traceback, nothing left behind."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

import thinwire as tw
import thinwire.launcher.pool  # noqa: F401  (tw.launcher.pool below)
from thinwire.errors import UserError, WorkerError


def _identity(rank, world_size, offset):
    import torch.distributed as dist
    return {"rank": rank, "world": world_size, "dist_rank": dist.get_rank(), "value": rank * 10 + offset}


def _raise_on(rank, world_size, bad):
    if rank == bad:
        raise ValueError(f"boom from {rank}")
    import torch.distributed as dist
    dist.barrier()  # the others block in a collective: the launcher must stop them
    return rank


def _die_on(rank, world_size, bad, after):
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    for step in range(1000):
        if rank == bad and step == after:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        time.sleep(0.01)
    return rank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_launch_returns_values_by_rank():
    out = tw.launch(_identity, world_size=3, args=(7,))
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["dist_rank"] == o["rank"] for o in out)
    assert [o["value"] for o in out] == [7, 17, 27]


def test_pool_runs_many_tasks_and_a_raise_names_the_rank():
    pool = tw.Pool(2)
    try:
        assert pool.run(_identity, 1) == pool.run(_identity, 1)
        pids = pool.pids
        with pytest.raises(WorkerError) as err:
            pool.run(_raise_on, 1)
        assert err.value.rank == 1
        assert "boom from 1" in str(err.value) and "Traceback" in err.value.traceback
        assert not err.value.stacks and "Python stacks" not in str(err.value)    # its own exception: no hang
    finally:
        pool.close()
    assert not _feeders(pool)
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_killed_worker_is_reported_within_seconds_and_nothing_is_left():
    pool = tw.Pool(3)
    pids = pool.pids
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        pool.run(_die_on, 2, 5)
    elapsed = time.monotonic() - t0
    assert err.value.rank == 2 and "signal 9" in str(err.value)
    assert elapsed < 15, elapsed
    assert not _feeders(pool)  # closed by force too
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _feeders(pool) -> list:
    """The pool's task-queue feeder threads still running. One that outlives `close()` may release the queue's
    semaphores while the process exits, too late to tell multiprocessing's resource tracker ("leaked semaphore"
    after SIGTERM, issue 18)."""
    return [q._thread for q in pool._tasks if getattr(q, "_thread", None) is not None and q._thread.is_alive()]


class _CtrlCOnSecondStart(tw.launcher.pool.ctx.Process):
    started: list = []   # pids of the workers that did start

    def start(self):
        if _CtrlCOnSecondStart.started:
            raise KeyboardInterrupt  # Ctrl-C after the first worker started
        super().start()
        _CtrlCOnSecondStart.started.append(self.pid)


def test_a_run_with_its_progress_bar_ends_without_a_leaked_semaphore():
    """`thinwire train` with its progress bar (drawn by rank 0, a worker process) ended every run with the resource
    tracker's "1 leaked semaphore": tqdm's default lock is a multiprocessing semaphore, made in the worker and not
    released when it exits. The bar now takes a thread lock (`loop.progress_bar`)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "THINWIRE_NO_PROGRESS"}
    out = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "linreg", "--workers", "2",
                          "--steps", "5"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "step" in out.stderr                          # the bar was drawn
    assert "leaked" not in out.stderr, out.stderr[-500:]


def test_ctrl_c_between_two_worker_starts_leaves_nothing(monkeypatch):
    from thinwire.launcher import pool as launcher
    monkeypatch.setattr(launcher.ctx, "Process", _CtrlCOnSecondStart)
    _CtrlCOnSecondStart.started = []
    with pytest.raises(KeyboardInterrupt):  # not an error of the clean-up ("can only join a started process")
        tw.Pool(2)
    time.sleep(0.2)
    assert _CtrlCOnSecondStart.started and not any(_alive(p) for p in _CtrlCOnSecondStart.started)


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world size"),
    ({"world_size": 2, "network": "moon"}, "unknown network 'moon'"),
    ({"world_size": 2, "network": "custom:bandwidth=fast"}, "malformed bandwidth"),
    ({"world_size": 2, "backend": "mpi"}, "unknown backend"),
])
def test_bad_launch_arguments(kwargs, message):
    with pytest.raises(UserError, match=message):
        tw.launch(_identity, args=(0,), **kwargs)


def test_port_in_use_is_a_user_error():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        with pytest.raises(UserError, match="in use"):
            tw.launch(_identity, world_size=1, args=(0,), port=s.getsockname()[1])
    finally:
        s.close()


def _listening(pids: list[int]) -> list[str]:
    """The local addresses (`ip:port`) of the TCP sockets these processes listen on, from /proc."""
    import ipaddress
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexip)  # kernel byte order: 32-bit words, each little-endian
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(f"{ipaddress.ip_address(raw)}:{int(hexport, 16)}")
    return found


def _gloo_listeners(rank, world_size):
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))
    return _listening([os.getpid()])


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads listening sockets from Linux's /proc/net/tcp")
def test_store_and_gloo_listen_on_loopback_only():
    with tw.Pool(2) as pool:
        store = _listening([os.getpid()])
        workers = pool.run(_gloo_listeners)
    assert f"127.0.0.1:{pool.port}" in store, store
    addresses = store + [a for w in workers for a in w]
    assert addresses and all(a.startswith("127.") for a in addresses), addresses


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 513}, "at most 512"),
    ({"world_size": 2, "progress_timeout": float("nan")}, "progress_timeout must be"),
    ({"world_size": 2, "timeout": -1}, "timeout must be"),
    ({"world_size": 2, "worker_init": 3}, "worker_init must be callable"),
])
def test_bad_pool_arguments_start_nothing(kwargs, message):
    from unittest import mock

    from thinwire.launcher import pool as launcher

    class Tripwire:  # were a check missing, nothing is spawned (513 workers would exhaust a small machine)
        def __getattr__(self, name):
            raise AssertionError(f"started despite bad input (multiprocessing {name})")
    with mock.patch.object(launcher, "ctx", Tripwire()), pytest.raises(UserError, match=message):
        tw.Pool(**kwargs)


def _enter(tag, rank, world_size):
    os.environ["THINWIRE_INIT_TAG"] = f"{tag}-{rank}-{world_size}"


def _read_tag(rank, world_size):
    return os.environ.get("THINWIRE_INIT_TAG")


def _init_fails(rank, world_size):
    if rank == 1:
        raise OSError("no such namespace")


def test_worker_init_runs_in_each_worker_before_the_process_group():
    import functools
    assert tw.launch(_read_tag, 2, worker_init=functools.partial(_enter, "ns")) == ["ns-0-2", "ns-1-2"]
    with pytest.raises(WorkerError, match="worker_init failed: OSError: no such namespace") as err:
        tw.launch(_read_tag, 2, worker_init=_init_fails)
    assert err.value.rank == 1


# -- long runs (issue 34, item 1): no global deadline where the progress watchdog watches ---------------------
def _progressing(rank, world_size, seconds):
    """Reports a step every 20 ms for `seconds`: a run that progresses."""
    from thinwire.launcher import report_progress
    end, step = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        step += 1
        report_progress(step)
        time.sleep(0.02)
    return step


def test_a_run_longer_than_the_old_deadline_is_not_cut_off(pool2):
    """The shortened clock: `timeout=1` stands for launch's 3600 s. A `thinwire train` loop (and any run that
    reports progress) outlives it; the progress watchdog bounds it instead. Before: `stalled: no result within`."""
    from thinwire.run.train import TrainConfig, train_worker
    net = "custom:latency=5ms"
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=80, progress=False, network=net).validate()
    pool2.run(train_worker, replace(cfg, steps=1), network=net)   # warm: the workers import the loop first
    t0 = time.monotonic()
    out = pool2.run(train_worker, cfg, network=net, timeout=1.0)
    assert time.monotonic() - t0 > 1.0 and [len(o["steps"]) for o in out] == [80, 80]


def _waits_in_a_collective(rank, world_size):
    import torch
    import torch.distributed as dist
    if rank == 1:
        _asleep_here()
    dist.all_reduce(torch.ones(1))


def _asleep_here():
    time.sleep(3600)


@pytest.mark.skipif(tw.launcher.pool.STACKS_SIGNAL is None, reason="no SIGUSR2 on this platform")
def test_a_hang_names_where_every_worker_was(monkeypatch, tmp_path):
    """Rank 1 sleeps, rank 0 waits for it in an all-reduce: the launcher's error (no result within 2 s) carries
    both workers' Python stacks at that moment, each showing where it was. The stacks pass through files unlinked
    when made: nothing of them is in the temporary directory while the pool lives, so a launcher SIGKILLed at any
    moment leaves nothing there (before: a `thinwire-stacks-*` folder)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with tw.Pool(2) as pool, pytest.raises(WorkerError) as err:
        assert os.listdir(tmp_path) == []
        pool.run(_waits_in_a_collective, timeout=2)
    text = str(err.value)
    assert text.startswith("worker 0 failed: stalled: no result within 2 s") and err.value.stacks
    head0, head1 = ("--- Python stacks of worker %d when the launcher gave up ---" % r for r in (0, 1))
    w0, w1 = text.split(head0)[1].split(head1)
    assert "_waits_in_a_collective" in w0 and "all_reduce" in w0 and "_asleep_here" not in w0
    assert "_asleep_here" in w1


def test_an_explicit_deadline_ends_a_progressing_run():
    with tw.Pool(1) as pool, pytest.raises(tw.launcher.DeadlineError,
                                           match=r"deadline: no result within 1 s, the run's deadline"):
        pool.run(_progressing, 30.0, deadline=1.0)


def test_train_has_no_deadline_unless_asked(capsys):
    """`thinwire train` launches with no deadline (the 3600 s one ended longer runs); `--deadline S` sets one."""
    from unittest import mock

    from thinwire.cli import main
    seen = []

    def fake_launch(fn, world_size, **kw):
        seen.append(kw["deadline"])
        raise UserError("launched")
    with mock.patch("thinwire.run.train.launch", fake_launch):
        base = ["train", "--workload", "linreg", "--workers", "2", "--steps", "3"]
        assert main(base) == 2 and main(base + ["--deadline", "7200"]) == 2
        assert main(base + ["--deadline", "nan"]) == 2
    assert seen == [None, 7200.0]
    assert "--deadline must be a finite number > 0" in capsys.readouterr().err


LAUNCHER = """
import sys, time
from thinwire.launcher.pool import Pool

def asleep(rank, world_size):
    time.sleep(600)

if __name__ == "__main__":
    with Pool(2, timeout=900) as pool:
        print("started", flush=True)
        pool.run(asleep)
"""


def test_a_launcher_killed_by_sigkill_takes_its_workers_and_their_fork_server_with_it(tmp_path):
    """Workers are forked from multiprocessing's fork server, which the workers themselves keep alive. A launcher
    SIGKILLed in a run (it cannot clean up) leaves no process behind: each worker ends when its launcher's pidfd
    says it ended, and the server when its last worker has. Every process the launcher made carries its
    environment's tag."""
    import subprocess
    import sys
    from leftovers import tagged
    tag = f"THINWIRE_TEST_TAG=sigkill-{os.getpid()}"
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "THINWIRE_TEST_TAG": tag.split("=")[1]})
    assert proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    while len(tagged(tag)) < 4 and time.monotonic() < deadline:    # the launcher, the server, two workers
        time.sleep(0.05)
    made = set(tagged(tag)) - {proc.pid}
    assert len(made) >= 3, made
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in made) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in made if _alive(p)]
