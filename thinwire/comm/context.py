"""Process-wide defaults set by the launcher (or `thinwire.init`): the emulated network of this worker, and the
store its process group met at (what the training loop posts its evaluations to without waiting for anyone)."""
from __future__ import annotations

import os
from datetime import timedelta

from ..net import Link, parse_network

_network: Link = parse_network("lan")
_seed: int = 0
_store = None


def set_default_network(spec, seed: int = 0) -> Link:
    global _network, _seed
    _network = parse_network(spec)
    _seed = seed
    return _network


def default_network() -> Link:
    return _network


def default_seed() -> int:
    return _seed


def set_store(store) -> None:
    """(a launcher, in the worker it started) The store this worker's process group met at."""
    global _store
    _store = store


def store():
    """This worker's store: the launcher's, or under torchrun a client of MASTER_ADDR:MASTER_PORT's; None
    elsewhere."""
    global _store
    if _store is None and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        import torch.distributed as dist
        _store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=300))
    return _store
