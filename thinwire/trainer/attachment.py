"""`attach`: a thinwire algorithm driven from PyTorch's own hook points, for a loop that calls `optimizer.step()`
itself (its own, Lightning's, Accelerate's); the `Attachment` it returns holds a `Trainer`."""
from __future__ import annotations

import torch

from ..optim import in_own_step
from .trainer import Trainer


class Attachment:
    """What `attach` returns: a thinwire algorithm driven from the optimizer's own `step()` (see `attach`).

    `metrics()`, `state_dict()`, `load_state_dict()` are the `Trainer`'s; `close()` drains in-flight communication,
    leaves every worker with the model the algorithm defines and removes the hooks. As a context manager it
    closes on a normal exit and only removes the hooks when an exception leaves the block (nothing more is sent).
    On a parameter-server rank (`role == "server"`) call `serve()` instead of training.

    Args:
        trainer: the `Trainer` the hooks drive (`attach` builds it).
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.optimizer = trainer.optimizer
        self._muted: list | None = None
        self.last: dict = {}          # the traffic counters of the last step (what `Trainer.step` returns)
        self._hooks = [self.optimizer.register_step_pre_hook(self._pre),
                       self.optimizer.register_step_post_hook(self._post)]

    # -- the optimizer's hook points ----------------------------------------------------------------------
    def _pre(self, optimizer, args, kwargs):
        """Before the loop's `optimizer.step()`: evaluate its closure (Lightning's forward and backward), run the
        algorithm's step (communication and the update, the algorithm's own optimizer steps included), then let
        the loop's call run on no parameters: the update is the algorithm's alone."""
        if in_own_step(optimizer):      # the algorithm's own step (during backward or in its step)
            return None
        self._unmute()
        args, kwargs = tuple(args), dict(kwargs)
        closure = kwargs.pop("closure", None)
        if closure is None and len(args) > 1:
            closure, args = args[1], args[:1] + args[2:]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last = self.trainer.step()
        self._muted = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = []
        if closure is not None:
            kwargs["closure"] = lambda: loss       # the loop's call returns the closure's loss, as it would
        return args, kwargs

    def _post(self, optimizer, args, kwargs):
        if not in_own_step(optimizer):
            self._unmute()

    def _unmute(self) -> None:
        if self._muted is not None:
            for g, params in zip(self.optimizer.param_groups, self._muted):
                g["params"] = params
            self._muted = None

    # -- the handle ---------------------------------------------------------------------------------------
    @property
    def algorithm(self):
        """The running `Algorithm` (the Trainer's)."""
        return self.trainer.algorithm

    @property
    def role(self) -> str:
        """"worker", or "server" on a parameter-server rank (which calls `serve()` instead of training)."""
        return self.trainer.algorithm.role

    @property
    def step_count(self) -> int:
        """The optimizer steps taken so far (the Trainer's)."""
        return self.trainer.step_count

    def serve(self, checkpoint=None) -> None:
        """(parameter-server rank) Serve the workers until they are done.

        Args:
            checkpoint: None, or `(every, total, save)`: the server joins the workers' checkpoints every
                `every` of `total` steps through `save` (`PSServer.serve`).
        """
        self.trainer.algorithm.serve(checkpoint=checkpoint)

    def metrics(self) -> dict:
        """This rank's counters (`Trainer.metrics`): steps, bytes, emulated time, the algorithm's own."""
        return self.trainer.metrics()

    def state_dict(self) -> dict:
        """This rank's checkpoint (`Trainer.state_dict`): save it on every rank."""
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from this rank's `state_dict()` (`Trainer.load_state_dict`).

        Args:
            state: what `state_dict()` returned.
        """
        self.trainer.load_state_dict(state)

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._unmute()

    def detach(self) -> None:
        """Remove the optimizer's hooks and the scheduler's; nothing is sent (the optimizer steps plainly again)."""
        self._unhook()
        self.trainer.scheduler.close()

    def close(self) -> None:
        """Remove the hooks, drain in-flight communication and leave every worker with the model the algorithm
        defines (`Trainer.close`); leaving the `with` block normally does it."""
        if self._hooks:
            self._unhook()
            self.trainer.close()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._hooks:
            self.detach()


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm="bsp", **params) -> Attachment:
    """Run `algorithm` from PyTorch's own hook points, for a loop that calls `optimizer.step()` itself (its own,
    Lightning's, Accelerate's):

        with tw.attach(model, opt, algorithm="diloco", period=50,
                       compressor="fp4") as tw_run:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                opt.step()      # the algorithm's step: communication, update
                opt.zero_grad()

    The model's backward hooks (the scheduler's, on every parameter) hand each bucket to the algorithm during
    backward; the optimizer's step pre-hook runs the algorithm's step where the loop calls `optimizer.step()`
    (after evaluating its closure, if it passes one) and the loop's own call then updates nothing, the
    algorithm having applied its update; the post-hook restores the parameter groups. Parameters are the
    `Trainer`'s (compressor, memory, schedule, network, nonfinite, ...), and the result is the Trainer's, bitwise,
    for the same seed. Don't wrap the model in DistributedDataParallel: the algorithm does the communicating.

    Args:
        model: the model (bare, not wrapped in DistributedDataParallel).
        optimizer: the optimizer the loop steps; its step pre- and post-hooks run the algorithm.
        algorithm: a registered algorithm's name or an `Algorithm` instance, as for `Trainer`.
        **params: the `Trainer`'s other parameters (`compressor`, `memory`, `network`, `nonfinite`, ...) and
            the algorithm's, compressor's and memory's own, routed by name.

    Returns:
        The `Attachment`: a context manager with `metrics()`, `state_dict()` and `close()`.
    """
    return Attachment(Trainer(model, optimizer, algorithm=algorithm, **params))
