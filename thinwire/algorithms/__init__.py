"""Synchronization schemes and training algorithms, registered by name (`thinwire.algorithms.get("dts")`)."""
from ..registry import Registry, import_submodules

registry = Registry("algorithm")
register = registry.register
get = registry.get
names = registry.names

from .base import Algorithm  # noqa: E402

import_submodules(__name__, __path__)

__all__ = ["Algorithm", "get", "names", "register", "registry"]
