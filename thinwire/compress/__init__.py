"""Compressors and memories, one file each, registered by name (`thinwire.compressors.get("qsgd", ...)`)."""
from ..registry import Registry, import_submodules

compressors = Registry("compressor")
memories = Registry("memory")

from .base import Compressor, Memory, Payload  # noqa: E402
from ._coding import coders  # noqa: E402  (lossless coders, composed as "compressor+coder")

import_submodules(__name__, __path__)

__all__ = ["Compressor", "Memory", "Payload", "coders", "compressors", "memories"]
