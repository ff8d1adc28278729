"""Shared fixtures. Starting gloo workers costs seconds, so each test module keeps one pool per world size
(`pool2`, `pool4`) and runs many checks inside it; a pool whose run failed is restarted on next use."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("THINWIRE_NO_PROGRESS", "1")


class LazyPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._pool = None

    def run(self, fn, *args, network="lan", seed=0, timeout=300):
        from thinwire.run.launcher import Pool
        if self._pool is None or self._pool._closed:
            self._pool = Pool(self.world_size, timeout=timeout)
        return self._pool.run(fn, *args, network=network, seed=seed, timeout=timeout)

    @property
    def pool(self):
        return self._pool

    def close(self):
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="module")
def pool2():
    p = LazyPool(2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool4():
    p = LazyPool(4)
    yield p
    p.close()
