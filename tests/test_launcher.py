"""The embedded launcher: results by rank, failures named with their traceback, nothing left behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

import thinwire as tw
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
    finally:
        pool.close()
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
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


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
