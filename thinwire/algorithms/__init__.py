"""Synchronization schemes and training algorithms, registered by name (`thinwire.algorithms.get("dts")`)."""
from ..registry import import_submodules
from ._registry import architectures, get, names, register, registry
from .base import Algorithm
from .cost import CostFamily

import_submodules(__name__, __path__)

__all__ = ["Algorithm", "CostFamily", "architectures", "get", "names", "register", "registry"]
