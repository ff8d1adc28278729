"""Process-wide defaults set by the launcher (or `thinwire.init`): the emulated network of this worker."""
from __future__ import annotations

from ..net import Link, parse_network

_network: Link = parse_network("lan")
_seed: int = 0


def set_default_network(spec, seed: int = 0) -> Link:
    global _network, _seed
    _network = parse_network(spec)
    _seed = seed
    return _network


def default_network() -> Link:
    return _network


def default_seed() -> int:
    return _seed
