"""Compressors and memories, one file each, registered by name (`thinwire.compressors.get("qsgd", ...)`)."""
from ..registry import Registry, import_submodules

compressors = Registry("compressor", retired={   # the exchange names the collective (`thinwire.exchange.exchange`)
    "sparse_collective": "it is the exchange's parameter — pass sparse_collective=... to the Trainer / "
                         "--sparse-collective",
    "aggregation": "the collective is the exchange's parameter — pass collective=... to the Trainer / --collective"})
memories = Registry("memory")

from .base import Compressor, Memory, Payload  # noqa: E402
from .coding import coders  # noqa: E402  (lossless coders, composed as "compressor+coder")

import_submodules(__name__, __path__)

__all__ = ["Compressor", "Memory", "Payload", "coders", "compressors", "memories"]
