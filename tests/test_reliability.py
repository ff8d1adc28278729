"""Faults: resume equality for every algorithm, corrupt and foreign checkpoints, NaN policy, mismatched
models, stalled and killed workers. Each ends with a clear error or an identical result."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from thinwire import algorithms
from thinwire.errors import UserError, WorkerError
from thinwire.run.train import TrainConfig, train_worker

# algorithms whose trajectory depends on timing (asynchronous by design), or that run server ranks
TIMING_DEPENDENT = {"asp", "backup", "ssp"}


def resumable():
    out = []
    for name in algorithms.names():
        cls = algorithms.registry.lookup(name)
        if name in TIMING_DEPENDENT or cls.architectures[0] == "ps":
            continue
        out.append(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", resumable())
def test_resume_reproduces_the_uninterrupted_run(algorithm, pool4, tmp_path):
    steps, at = 10, 5
    params = {"period": 2} if algorithm in ("localsgd", "postlocalsgd", "dts", "tsparse") else {}
    if algorithm in ("dts", "delayed"):
        params["delay"] = 3
    base = dict(workload="linreg", algorithm=algorithm, workers=4, steps=steps, progress=False, params=params,
                optimizer="adamw" if algorithms.registry.lookup(algorithm).adam_only else None)
    ck = str(tmp_path / "ck")
    whole = pool4.run(train_worker, TrainConfig(checkpoint_every=at, checkpoint_dir=ck, **base))
    assert os.path.exists(os.path.join(ck, "checkpoint.json"))
    cfg = TrainConfig(resume=ck, **base)
    cfg.validate()
    resumed = pool4.run(train_worker, cfg)
    assert [r["model_sha256"] for r in resumed] == [r["model_sha256"] for r in whole], algorithm
    assert [len(r["steps"]) for r in resumed] == [steps] * 4


def test_foreign_and_corrupt_checkpoints_are_refused(pool2, tmp_path):
    ck = str(tmp_path / "ck")
    base = dict(workload="linreg", algorithm="bsp", workers=2, steps=4, progress=False)
    pool2.run(train_worker, TrainConfig(checkpoint_every=2, checkpoint_dir=ck, **base))
    with pytest.raises(UserError, match="from 2 ranks"):
        TrainConfig(resume=ck, **{**base, "workers": 3}).validate()
    with pytest.raises(UserError, match="different configuration"):
        TrainConfig(resume=ck, **{**base, "seed": 7}).validate()
    with pytest.raises(UserError, match="no checkpoint"):
        TrainConfig(resume=str(tmp_path), **base).validate()
    with open(os.path.join(ck, "rank-1.pt"), "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupt"):
        pool2.run(train_worker, TrainConfig(resume=ck, **base))


def _nan_run(rank, world_size, policy):
    from thinwire.trainer import Trainer
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = Trainer(model, opt, nonfinite=policy)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(2, 4)
    if rank == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    tr.step()
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"unchanged": same, "skipped": tr.skipped_steps}


def _mismatched(rank, world_size):
    from thinwire.trainer import Trainer
    model = torch.nn.Linear(4, 1 + rank)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_nonfinite_policies_and_mismatched_models(pool2):
    out = pool2.run(_nan_run, "skip")
    assert all(o["unchanged"] and o["skipped"] == 1 for o in out)
    with pytest.raises(WorkerError, match="NaN") as err:
        pool2.run(_nan_run, "stop")
    assert err.value.rank == 1
    with pytest.raises(UserError, match="differ in shapes"):
        pool2.run(_mismatched)


class _Writes(TorchDispatchMode):
    """Records the storages that the aten ops run under it write."""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for spec, arg in zip(func._schema.arguments, args):
            if spec.alias_info is not None and spec.alias_info.is_write:
                for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if isinstance(t, torch.Tensor):
                        self.written.add(t.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def test_the_gradient_check_only_reads_the_gradients(device):
    """The policy stop checks each step's gradients while one of them may be in flight: a bucket all-reduced in
    place during backward, whose gradients are views of it (hierarchical DiLoCo's inner steps). A check that wrote
    them back (GradScaler's unscale at a scale of 1) put this rank's own values over the all-reduce's result on
    some elements, and the workers of an island drifted apart. The check writes nothing of the gradients, and
    still finds NaN and ±Inf, and no finite value however large (the CPU's check and the GPU's)."""
    from thinwire.compress.finite import NonFiniteError
    from thinwire.trainer import FiniteGuard, nonfinite_flag
    bucket = torch.ones(10, dtype=torch.float64, device=device)
    grads = [bucket[:4].view(2, 2), bucket[4:], torch.ones(3, dtype=torch.float16, device=device),
             torch.ones(0, device=device)]
    found = torch.zeros(1, device=device)
    with _Writes() as mode:
        nonfinite_flag(grads, found)
    assert bucket.untyped_storage().data_ptr() not in mode.written and found.item() == 0
    assert all(g.untyped_storage().data_ptr() not in mode.written for g in grads)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            found.zero_()
            nonfinite_flag([torch.ones(2, dtype=torch.float64, device=device),
                            torch.tensor([1.0, bad], dtype=dtype, device=device)], found)
            assert found.item() == 1, (bad, dtype)
    found.zero_()
    nonfinite_flag([torch.full((3,), 1e300, dtype=torch.float64, device=device),
                    torch.full((2,), 6e4, dtype=torch.float16, device=device),
                    torch.sparse_coo_tensor([[0]], [2.0], (4,), check_invariants=True, device=device)], found)
    assert found.item() == 0
    nonfinite_flag([torch.sparse_coo_tensor([[1]], [float("nan")], (4,), check_invariants=True, device=device)],
                   found)
    assert found.item() == 1
    model = torch.nn.Linear(2, 1).to(device)
    guard = FiniteGuard(list(model.parameters()), rank=0)
    model(torch.ones(1, 2, device=device)).sum().backward()
    guard.check(list(model.parameters()), 1)
    model.bias.grad[0] = float("inf")
    guard.check(list(model.parameters()), 2)
    with pytest.raises(NonFiniteError, match="at step 2"):
        guard.read_with()


def _spin(rank, world_size):
    import time as _t
    import torch.distributed as dist
    t = torch.ones(1)
    for _ in range(100000):
        dist.all_reduce(t)
        _t.sleep(0.01)


def test_stopped_worker_is_detected_by_its_silence():
    import signal
    import threading
    import time

    from thinwire.launcher.pool import Pool
    pool = Pool(2, stall_timeout=3.0)
    threading.Timer(1.5, lambda: os.kill(pool.pids[1], signal.SIGSTOP)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="stalled: no heartbeat") as err:
        pool.run(_spin)
    assert err.value.rank == 1 and time.monotonic() - t0 < 20


def _final_sha(rank, world_size, algorithm, params, network):
    cfg = TrainConfig(workload="linreg", algorithm=algorithm, workers=world_size, steps=8, progress=False,
                      params=params, network=network)
    out = train_worker(rank, world_size, cfg)
    return out["model_sha256"], out["meter"]["total"]["emulated_s"]


def test_jitter_and_loss_stalls_change_no_result_and_deadlock_nothing(pool2):
    lossy = "custom:latency=2ms,jitter=2ms,loss=0.3"
    for algorithm, params in (("bsp", {}), ("dts", {"delay": 3, "period": 2})):
        clean = pool2.run(_final_sha, algorithm, params, "lan")
        stalled = pool2.run(_final_sha, algorithm, params, lossy)
        assert [c[0] for c in clean] == [s[0] for s in stalled], algorithm
        assert all(s[1] > 0.2 for s in stalled)  # at least one loss stall (≥ 200 ms) was emulated


# -- the progress watchdog: a training thread that blocks while the process lives on -----------------------
def _train_stalling(rank, world_size, cfg, bad_rank, at_step):
    """train_worker whose `bad_rank` blocks for good when it fetches the batch of `at_step` (its heartbeat
    thread beats on: the process is alive, only its training is stuck)."""
    import time as _t

    from thinwire.run import workloads
    orig, calls = workloads.ShardLoader.next, [0]

    def next_batch(self):
        calls[0] += 1
        if calls[0] == at_step:
            _t.sleep(10**6)
        return orig(self)
    if rank == bad_rank:
        workloads.ShardLoader.next = next_batch
    try:
        return train_worker(rank, world_size, cfg)
    finally:
        workloads.ShardLoader.next = orig


def _slow_then_deadlocked(rank, world_size):
    """Steps of >= 0.2 s, a pause of 3 s (within 50 median steps: not a stall), then both ranks wait on a
    receive from each other: a stuck collective, no rank ahead."""
    import time as _t
    import torch.distributed as dist
    from thinwire.launcher.pool import report_progress
    for step in range(1, 6):
        _t.sleep(0.2)
        report_progress(step)
    _t.sleep(3.0)
    report_progress(6)
    dist.recv(torch.zeros(1), src=1 - rank)


def test_a_stalled_training_thread_is_named_by_the_progress_watchdog():
    from thinwire.launcher.pool import NoProgressError, Pool
    cfg = TrainConfig(workload="linreg", algorithm="bsp", workers=2, steps=10**6, progress=False)
    pool = Pool(2, progress_timeout=2.0)
    pids = pool.pids
    with pytest.raises(NoProgressError) as err:
        pool.run(_train_stalling, cfg, 1, 5)
    assert err.value.rank == 1, str(err.value)
    assert "rank 1 made no progress for" in str(err.value) and "(stuck at step 4; others at step 5)" in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    assert pool.closed and not [p for p in pids if os.path.exists(f"/proc/{p}/status")
                                 and "zombie" not in open(f"/proc/{p}/status").read()]


def test_the_watchdog_scales_with_the_step_time_and_names_a_stuck_collective():
    from thinwire.launcher.pool import NoProgressError, Pool
    pool = Pool(2, progress_timeout=1.0)
    with pytest.raises(NoProgressError, match=r"no rank made progress for .* all at step 6\): a collective is "
                                              r"stuck") as err:
        pool.run(_slow_then_deadlocked)
    assert err.value.rank == -1


def _users_own_loop(rank, world_size, stall_at):
    """The README's loop: a Trainer inside the user's own function under tw.launch; rank 1 blocks in user code
    (its heartbeat thread beats on) before step `stall_at`."""
    import time as _t

    import thinwire as tw
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = tw.Trainer(model, opt, algorithm="bsp")
    for step in range(1, 10**6):
        if rank == 1 and step == stall_at:
            _t.sleep(3600)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        trainer.step()
        opt.zero_grad()


def test_a_stalled_rank_in_a_users_own_loop_is_named():
    """Trainer.step reports progress (issue 34, item 2): a user's loop under tw.launch gets the same bound and
    the same one-line verdict as `thinwire train`. Before: not named after 360 s (only the 3600 s deadline)."""
    import thinwire as tw
    from thinwire.launcher import NoProgressError
    with pytest.raises(NoProgressError) as err:
        tw.launch(_users_own_loop, 2, args=(5,), progress_timeout=1.0)
    assert err.value.rank == 1, str(err.value)
    assert "rank 1 made no progress for" in str(err.value) and "(stuck at step 4; others at step 5)" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_a_resumed_run_counts_the_whole_run(pool2, tmp_path):
    """Bytes, ops, emulated time and skipped steps of the segment before the checkpoint are in the resumed
    run's summary (they were lost: 174 000 bytes reported instead of 348 000)."""
    from thinwire.run.train import summarize
    ck = str(tmp_path / "ck")
    base = dict(workload="linreg", algorithm="bsp", workers=2, steps=8, progress=False,
                network="custom:latency=1ms")
    cfg = TrainConfig(checkpoint_every=4, checkpoint_dir=ck, **base)
    whole = pool2.run(train_worker, cfg, network=cfg.network)
    again = TrainConfig(resume=ck, checkpoint_every=6, checkpoint_dir=str(tmp_path / "ck2"), **base).validate()
    resumed = pool2.run(train_worker, again, network=cfg.network)
    s_whole, s_resumed = summarize(cfg, whole, 0.0)[0], summarize(again, resumed, 0.0)[0]
    assert s_resumed["steps"] == 8 and s_resumed["bytes_sent_per_worker"] > 0
    assert s_resumed["bytes_sent_per_worker"] == s_whole["bytes_sent_per_worker"]
    assert s_resumed["emulated_comm_s"] == pytest.approx(s_whole["emulated_comm_s"], rel=1e-9)
    for w, r in zip(whole, resumed):
        assert r["meter"]["total"]["ops"] == w["meter"]["total"]["ops"]
        assert {k: v["ops"] for k, v in r["meter"]["by_kind"].items()} == \
            {k: v["ops"] for k, v in w["meter"]["by_kind"].items()}
        assert r["metrics"]["bytes_sent"] == w["metrics"]["bytes_sent"]
    # a checkpoint written by the resumed run counts from step 0 as well (a second resume stays whole)
    third = TrainConfig(resume=str(tmp_path / "ck2"), **base).validate()
    s_third = summarize(third, pool2.run(train_worker, third, network=cfg.network), 0.0)[0]
    assert s_third["bytes_sent_per_worker"] == s_whole["bytes_sent_per_worker"]
