"""Point-to-point messages of device tensors through host buffers, where the backend needs them.

gloo's send/recv take host memory only (a CUDA tensor aborts the process: "gloo::IoException ... Bad address"),
so under gloo a point-to-point op of a device tensor goes through a host buffer (`Transport.send` copies into
it, `Transport.recv` out of it); NCCL's send/recv take device memory. THINWIRE_STAGE_P2P=1 stages CPU tensors
too: the same path, exercised where there is no GPU.
"""
from __future__ import annotations

import os

import torch


class Staging:
    """Which point-to-point ops of one transport go through a host buffer."""

    def __init__(self, nccl: bool):
        self.device = not nccl                                        # gloo: every tensor off the host
        self.forced = os.environ.get("THINWIRE_STAGE_P2P") == "1"     # every tensor, on the host too

    def staged(self, tensor: torch.Tensor) -> bool:
        """Whether a point-to-point op of `tensor` goes through a host buffer (`host_buffer`)."""
        return self.forced or (self.device and tensor.device.type != "cpu")

    @staticmethod
    def host_buffer(nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """A uint8 host buffer for one point-to-point op of `like`: page-locked when `like` is on a CUDA device,
        so the copy to or from the device is a DMA. Page-locked buffers come from PyTorch's caching host
        allocator, which keeps freed blocks for reuse (a block is reused only once the copies queued on it are
        done), so a buffer is allocated once per size in steady state, not per message."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=like.device.type == "cuda")
