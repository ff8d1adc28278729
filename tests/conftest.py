"""Shared fixtures. Starting gloo workers costs seconds, so the whole session keeps one pool per world size
(`pool2`, `pool4`) and every module runs its checks inside them; a pool whose run failed is restarted on next
use."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("THINWIRE_NO_PROGRESS", "1")


class LazyPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._pool = None

    def run(self, fn, *args, network="lan", seed=0, timeout=300, deadline=None):
        from thinwire.launcher.pool import Pool
        if self._pool is None or self._pool.closed:
            self._pool = Pool(self.world_size, timeout=max(timeout, 300))
        return self._pool.run(fn, *args, network=network, seed=seed, timeout=timeout, deadline=deadline)

    @property
    def pool(self):
        return self._pool

    def close(self):
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="session")
def pool2():
    p = LazyPool(2)
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool4():
    p = LazyPool(4)
    yield p
    p.close()


# Modules whose tests kill, stall or restart worker processes (or start processes of their own): the property
# they test is the process boundary. `make test` runs them; `make test-fast` (the inner loop) leaves them out.
PROCESS_MODULES = {"test_faults", "test_survive", "test_elastic", "test_reliability", "test_reliability_ps",
                   "test_launcher", "test_torchrun", "test_hosts"}


# The longest files first (seconds in one run of `make test` with `--durations=0`, summed per file: faults 94,
# examples 79, reliability 63, compare 56, survive 50, torchrun 12-42, launcher 39, matrix 39, ...). `make test`
# hands out whole files in collection order (`--dist loadfile --no-loadscope-reorder`; xdist's own reorder puts
# the files with the most tests first, which left the 79-second examples file running alone at the end): longest
# first, no long file ends the run on one core while the other idles.
LONGEST_FIRST = ("test_faults", "test_examples", "test_reliability", "test_compare", "test_survive", "test_torchrun",
                 "test_hosts", "test_launcher", "test_matrix", "test_reliability_ps", "test_localsgd_gossip",
                 "test_compress_diloco", "test_cdsgd", "test_elastic", "test_sparse_collectives",
                 "test_compress_training", "test_cli", "test_ps", "test_train", "test_gossip", "test_device",
                 "test_diloco", "test_dts", "test_workloads")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in PROCESS_MODULES:
            item.add_marker(pytest.mark.processes)
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.module.__name__.rpartition(".")[2], len(order)))   # stable


@pytest.fixture(scope="session")
def two_hosts():
    """Two hosts with their own addresses: network namespaces on a veth pair (tests/hosts.py documents the API).
    Skipped, with the reason in one line, where this machine cannot make them."""
    from hosts import open_two_hosts
    hosts, why = open_two_hosts()
    if hosts is None:
        pytest.skip(f"two hosts: {why}")
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """Each device a test should run on: "cpu", and "cuda" where torch sees a GPU (skipped, with the reason,
    where it does not). torch is imported only here, lazily: thinwire sets allocator options before its import."""
    if request.param == "cuda":
        import torch
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device on this machine (torch.cuda.is_available() is False)")
    return request.param


@pytest.fixture
def group():
    """A one-rank gloo process group in this process (single-process tests of the Trainer and `tw.attach`)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
