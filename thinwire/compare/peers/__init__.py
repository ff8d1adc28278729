"""The race's peers, what a user would pick instead of thinwire, one module per peer or family, each declaring and
registering its own (`registry.py`): PyTorch's DDP with its comm hooks and model averagers (`ddp.py`), torchft's
DiLoCo (`torchft_diloco.py`). Their all-reduces are charged and counted as the Transport's are (`counter.py`)."""
from ...registry import import_submodules
from .registry import Peer, find, names, register, resolve, unregister

import_submodules(__name__, __path__)

__all__ = ["Peer", "find", "names", "register", "resolve", "unregister"]
