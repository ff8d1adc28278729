"""The interface every synchronization scheme / training algorithm implements.

The Trainer builds the algorithm from its registered name and parameters, then calls `attach(trainer)`.
After each backward pass the user calls `trainer.step()`, which calls `algorithm.step()`: the algorithm
decides what to exchange (gradients, deltas, models), when to wait, and applies the optimizer update itself.
`close()` drains in-flight communication and leaves every worker with the model the algorithm defines.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import UserError


class Algorithm:
    name: ClassVar[str] = ""
    architectures: ClassVar[tuple[str, ...]] = ("allreduce",)   # the first one is the default
    compression: ClassVar[bool] = True          # whether it takes a compressor and memory
    default_compressor: ClassVar[str] = "none"
    default_memory: ClassVar[str] = "none"

    def __init__(self, architecture: str | None = None):
        arch = architecture or self.architectures[0]
        if arch not in self.architectures:
            raise UserError(f"algorithm {self.name!r} does not run on architecture {arch!r}; "
                            f"valid: {', '.join(self.architectures)}")
        self.architecture = arch

    # -- wiring ----------------------------------------------------------------------------------------
    def attach(self, trainer) -> None:
        self.trainer = trainer
        self.model = trainer.model
        self.optimizer = trainer.optimizer
        self.transport = trainer.transport
        self.params: list[torch.nn.Parameter] = trainer.parameters
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        self.tracer = trainer.tracer
        if getattr(self, "allreduce", "gloo") != "gloo":  # an `allreduce=` parameter picks the algorithm
            from ..comm.collectives import parse
            parse(self.allreduce, self.world_size)
            self.transport.allreduce = self.allreduce
        self.setup()

    def setup(self) -> None:
        """Build exchanges and buffers (called once the trainer is wired)."""

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Drain in-flight communication; leave models consistent."""

    def metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- helpers shared by the algorithms ----------------------------------------------------------------
    def grads(self) -> list[torch.Tensor]:
        """The gradients of the trainable parameters (zeros for a parameter that got none this step)."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in self.grads()])

    def set_flat_grad(self, flat: torch.Tensor) -> None:
        offset = 0
        for g in self.grads():
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_flat_params(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def optimizer_step(self) -> None:
        with self.tracer.span("optimizer", "optimizer"):
            self.optimizer.step()
