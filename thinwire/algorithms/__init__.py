"""Synchronization schemes and training algorithms, registered by name (`thinwire.algorithms.get("dts")`)."""
from ..registry import Registry, import_submodules

# one class per (algorithm, architecture)
registry = Registry("algorithm", variant_param="architecture", default_variant=lambda cls: cls.architectures[0])
register = registry.register
get = registry.get
names = registry.names

from .base import Algorithm  # noqa: E402

import_submodules(__name__, __path__)


def architectures(name: str) -> tuple[str, ...]:
    """The architectures `name` runs on, its default first (seed 000 Table II)."""
    return tuple(dict.fromkeys([*registry.lookup(name).architectures, *registry.variants(name)]))

__all__ = ["Algorithm", "architectures", "get", "names", "register", "registry"]
