"""Communication: the Transport (counted, emulated collectives and point-to-point ops) and its parts."""
from .context import default_network, set_default_network
from .emulation import LinkClock
from .meter import Meter
from .handle import Handle
from .transport import Transport, subgroup

__all__ = ["Handle", "LinkClock", "Meter", "Transport", "default_network", "set_default_network", "subgroup"]
