"""`none`: the identity; the uncompressed fp32 baseline."""
from __future__ import annotations

from . import compressors, memories
from .base import Compressor, Memory, Payload


@compressors.register("none")
class NoCompression(Compressor):
    """Identity: sends the tensor as it is (32 bits per fp32 element)."""
    x_memcpy = 0.0

    def compress(self, tensor, key=None, step=0, agreed=None):
        return Payload([tensor], ctx=None)

    def decompress(self, payload):
        return payload.tensors[0]

    def context(self, shape, dtype, key=None, step=0):
        return None


@memories.register("none")
class NoMemory(Memory):
    """No error feedback: what compression drops is lost."""
