"""Hugging Face Accelerate: `tw.attach` on what `accelerator.prepare` returned (public name: `thinwire.accelerate`).

    accelerator = Accelerator(cpu=True)              # launched by `accelerate launch --multi_gpu --num_processes 4`
    optimizer, loader = accelerator.prepare(optimizer, loader)      # not the model: no DDP wrapper
    model.to(accelerator.device)
    with thinwire.accelerate.attach(accelerator, model, optimizer, algorithm="diloco", period=20) as run:
        for x, y in loader:
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()                 # the algorithm's step: communication and the update
            optimizer.zero_grad()

Accelerate wraps a prepared model in `DistributedDataParallel` whenever it runs several processes, and DDP's
all-reduce would then run beside the algorithm's (and DiLoCo or local SGD would not be local at all): prepare the
optimizer, the data loaders and the scheduler, not the model, and move the model to `accelerator.device`
yourself. The optimizer Accelerate returns wraps yours; its `step()` calls yours, whose hooks run the algorithm.
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import UserError, require_extra
from ..trainer import Attachment
from ..trainer import attach as _attach

require_extra("accelerate", "accelerate", "thinwire.accelerate (Hugging Face Accelerate)")


def attach(accelerator, model: torch.nn.Module, optimizer, algorithm="bsp", **params) -> Attachment:
    """`tw.attach(model, optimizer, algorithm, **params)` for an Accelerate script: `optimizer` may be the one
    `accelerator.prepare` returned; `model` must not have been prepared (see the module's docstring).

    Args:
        accelerator: the script's `Accelerator` (gradient accumulation is refused).
        model: the model, not prepared (no DDP wrapper), on `accelerator.device`.
        optimizer: the optimizer, or the one `accelerator.prepare` returned.
        algorithm: a registered algorithm's name, as for `tw.Trainer`.
        **params: `tw.Trainer`'s other parameters and the algorithm's, compressor's and memory's own.

    Returns:
        `tw.attach`'s `Attachment`.
    """
    if isinstance(model, DistributedDataParallel):
        raise UserError("the model is wrapped in DistributedDataParallel (accelerator.prepare(model)), whose "
                        "all-reduce would run beside thinwire's algorithm: prepare the optimizer and data loaders "
                        "only and move the model with model.to(accelerator.device)")
    if getattr(accelerator, "gradient_accumulation_steps", 1) != 1:
        raise UserError("Accelerate's gradient accumulation skips optimizer steps that thinwire's backward hooks "
                        "would still exchange: use gradient_accumulation_steps=1 (a larger batch instead)")
    inner = getattr(optimizer, "optimizer", optimizer)      # AcceleratedOptimizer wraps the user's optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise UserError(f"optimizer must be a torch.optim.Optimizer or Accelerate's wrapper of one, "
                        f"got {type(optimizer).__name__}")
    return _attach(model, inner, algorithm=algorithm, **params)
