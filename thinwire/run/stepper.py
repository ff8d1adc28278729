"""What the one training loop (`thinwire.run.loop`) drives: the `Stepper` interface, which thinwire's Trainer
(`loop.TrainerStepper`) and the race's peers (`thinwire.compare.peers`: PyTorch's DDP, torchft's DiLoCo)
implement, and the workload's optimizer they all build."""
from __future__ import annotations

import torch

from ..errors import UserError


class Stepper:
    """What the loop drives. `model` is what forward runs through (a DDP wrapper for a peer), `module` the
    model evaluated and fingerprinted, `optimizer` (each stepper sets it) the one `zero_grad()` clears. `step()`
    applies one step after backward and returns this step's traffic ({"bytes_sent", "emulated_s", "wait_s"});
    `close()` drains what is in flight (inside the training clock); `counted(before)` gives (meter, metrics) of
    the whole run; `shutdown()` releases what the stepper holds (always called, also after an error). `pace`:
    how the workers' steps relate (`thinwire.algorithms.base.Algorithm.pace`); under "round" the loop asks the
    stepper to stop (`request_stop`) and leaves when it is `finished`."""

    role = "worker"
    pace = "step"
    finished = False
    cut = None          # (pace "round") after a round's last step, the number every worker gives it (checkpoints)

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, worker_rank: int):
        self.model, self.module, self.worker_rank = model, module, worker_rank

    @property
    def parameters(self) -> list:
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self) -> dict:
        raise NotImplementedError

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def close(self) -> None:
        pass

    def request_stop(self) -> None:
        pass

    def counted(self, before: dict | None) -> tuple[dict, dict]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise UserError(f"{type(self).__name__} does not write checkpoints")

    def load_state_dict(self, state: dict) -> None:
        raise UserError(f"{type(self).__name__} does not resume from checkpoints")

    def shutdown(self) -> None:
        pass


def model_device(cfg) -> torch.device:
    """Where a worker's model lives: `cfg.device` "cuda" is the worker's current CUDA device (the launcher set
    it: its own GPU, or the GPU it shares with other workers), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def make_optimizer(cfg, wl, model) -> torch.optim.Optimizer:
    """The workload's optimizer (or `cfg.optimizer` by name: sgd, adamw, muon) with `cfg.lr` / `cfg.momentum` over
    `model`'s parameters."""
    return wl.make_optimizer(model, lr=cfg.lr, momentum=cfg.momentum, optimizer=cfg.optimizer)
