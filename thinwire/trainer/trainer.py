"""`Trainer`: the user-facing object around a model and an optimizer.

    trainer = tw.Trainer(model, opt, algorithm="dts", delay=4, period=4, compressor="topk", ratio=0.01)
    ...; loss.backward(); trainer.step(); opt.zero_grad()
    trainer.close()

The Trainer builds its components from names and keyword parameters (`assembly.py`), checks that every rank holds
the same model, starts every rank from rank 0's, and runs each step as the algorithm dictates, under the NaN/Inf
policy of `nonfinite.py`; surviving a lost worker and taking newcomers in are its `Resilience`'s (`resilience.py`).
"""
from __future__ import annotations

import hashlib
import warnings

import torch

from .. import speeds
from ..algorithms.base import Context
from ..comm import Transport, elastic
from ..comm.collectives import parse
from ..comm.membership import PeerLost
from ..comm.progress import report as report_progress
from ..errors import UserError
from ..optim import hand_over_momentum
from ..tensors import digest
from ..trace import NULL, Tracer
from .assembly import adam_feedback_warning, build_components, check_elastic, check_on_failure, check_optimizer_of
from .nonfinite import FiniteGuard, nonfinite_flag, nonfinite_params
from .resilience import Resilience


class Trainer:
    """A model and its optimizer trained by a thinwire algorithm (see the module's docstring); `step()` after
    each backward, `close()` at the end. `failures` and `joins` record the workers lost and taken in.

    Args:
        model: the model every worker builds alike (a bare `torch.nn.Module`, not wrapped in
            DistributedDataParallel); rank 0's initial weights are broadcast to the others.
        optimizer: the optimizer over the model's parameters; the algorithm calls its `step()` (DiLoCo's inner
            optimizer; a memory or compressor that applies momentum before compression takes its momentum).
        algorithm: a registered algorithm's name (`thinwire list`; the API reference's Algorithms page lists
            each one's parameters) or an `Algorithm` instance.
        compressor: a registered compressor's name (default: the algorithm's, usually "none").
        memory: a registered error-feedback memory's name (default: the algorithm's, usually "none").
        transport: the `Transport` to communicate through (default: one on the default process group).
        network: the network to emulate: a profile name ("lan", "wan", "world", ...), "custom:bandwidth=..,
            latency=..", or a `Link` (default: the one `tw.launch` or `tw.init` was given, else "lan").
        tracer: a `Tracer` recording the run's events (`--trace`); default none.
        sync_initial_model: broadcast rank 0's model at the start (else the ranks must start equal, checked).
        nonfinite: "stop" (a NaN/Inf gradient stops every rank) or "skip" (every rank skips that step).
        on_failure: "stop", or "continue": the survivors of a lost worker go on (algorithms that allow it).
        **params: routed by name to the algorithm, the compressor, the memory, the scheduler (`schedule`,
            `bucket_mb`, ...), the transport (`allreduce`) and the exchange (`collective`, `sparse_collective`);
            one that none of them takes is a `UserError` naming the valid ones.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm="bsp",
                 compressor=None, memory=None, transport: Transport | None = None, network=None,
                 tracer: Tracer | None = None, sync_initial_model: bool = True, nonfinite: str = "stop",
                 on_failure: str = "stop", **params):
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise UserError("the model is wrapped in DistributedDataParallel, which all-reduces every gradient "
                            "itself: pass the module inside it (model.module) and let the algorithm communicate")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise UserError("the model has no trainable parameters")
        check_optimizer_of(model, optimizer)
        self.tracer = tracer or NULL
        params = nonfinite_params(nonfinite, params)   # skip: no exchange during backward
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._warned_late_change = False
        (self.algorithm, self.compressor, self.memory, self.scheduler,
         transport_params, exchange_params) = build_components(algorithm, compressor, memory, **params)
        self.momentum_handed = hand_over_momentum(optimizer, self.algorithm, self.compressor, self.memory)
        self.elastic = elastic.MEMBER if transport is None else None   # a member of an elastic job, or None
        if self.elastic is not None:
            check_elastic(self.algorithm, self.scheduler)
            on_failure = "continue"      # an elastic job survives a loss (the algorithm allows it: checked above)
        check_on_failure(on_failure, self.algorithm)
        self.on_failure = on_failure
        self.failures: list[dict] = []   # workers lost and survived (on_failure="continue")
        self.joins: list[dict] = []      # newcomers taken in (an elastic job)
        # the ranks that took part in each synchronization (at each `committed` boundary: its group's size), as
        # runs [first step, last step, ranks]: a newcomer counts from the first boundary after it joined
        self.participants: list[list[int]] = []
        self.committed = 0               # the last synchronization boundary passed (bsp: every step; localsgd,
        #                                  diloco: a sync; dts: a window's end): the work before it counts
        self.step_count = 0
        self.resilience = Resilience(self)   # joins and recovery
        joined = None
        if self.elastic is not None:     # the generation's own group (thinwire.comm.elastic)
            self.elastic.agree("trainer", self.resilience.describe(params))
            if self.elastic.joining:
                joined = self.elastic.join()
            elif self.elastic.group is None:
                self.elastic.start()
            transport = Transport(group=self.elastic.group, network=network, tracer=self.tracer,
                                  device=self.parameters[0].device, **transport_params)
            transport.generation = self.elastic.gen
        elif transport is None:
            transport = Transport(network=network, tracer=self.tracer, device=self.parameters[0].device,
                                  **transport_params)
        elif "allreduce" in transport_params:     # a transport given: the all-reduce algorithm asked for
            parse(transport_params["allreduce"], transport.world_size)
            transport.allreduce = transport_params["allreduce"]
        self.transport = transport
        warning = adam_feedback_warning(self.algorithm, self.compressor, self.memory, optimizer)
        if warning and self.transport.rank == 0:
            warnings.warn(warning, stacklevel=2)
        if tracer is not None:
            self.transport.tracer = tracer
        if joined is None:               # a newcomer is checked by its fingerprint and takes a live peer's state
            self._check_models_match(values=not sync_initial_model)
            if sync_initial_model:
                self.resilience.broadcast_model()
        # policy stop: every step's gradients checked on the device, the verdict read with the next exchange;
        # none where the algorithm's exchange checks every gradient bucket itself before sending it
        self.finite = (FiniteGuard(self.parameters, self.transport.rank)
                       if nonfinite == "stop" and not self.algorithm.checks_finite else None)
        self.context = Context(model, optimizer, self.parameters, self.scheduler, self.transport, self.tracer,
                               self.compressor, self.memory, failures=self.failures, finite=self.finite,
                               collectives=exchange_params)
        self.algorithm.attach(self.context)
        if joined is not None:
            self.resilience.welcome(joined, previous=[])
        self.scheduler.next_step(self.algorithm.communicates())
        # a step whose exchanges land at the end of backward (bsp) waits there: its progress is reported first
        self.scheduler.before_landing = self._report_progress
        # under `tw.launch(..., speeds=)`: this worker's model at its emulated speed (`thinwire.speeds`)
        self.slowdown = speeds.for_process(model, self.tracer)

    @property
    def pace(self) -> str:
        """How the workers' steps relate (`Algorithm.pace`): "step" (lockstep), "round" (different step counts
        between syncs every worker takes) or "free" (no worker waits for another)."""
        return self.algorithm.pace

    @property
    def finished(self) -> bool:
        """(pace "round") A sync read a stop request (`request_stop`): every worker leaves its loop now."""
        return self.algorithm.finished

    @property
    def cut(self) -> int | None:
        """(pace "round") After a step that ended a round: a number every worker gives that round's end, where a
        checkpoint of every worker can be cut (`Algorithm.cut`); else None."""
        return self.algorithm.cut

    def request_stop(self) -> None:
        """(pace "round") Ask every worker to stop: they end together at the next sync (`finished` turns true).
        Under pace "step" every worker stops at the same step on its own; under "free" each whenever it will."""
        self.algorithm.request_stop()

    def _check_models_match(self, values: bool) -> None:
        """Refuse to start when the ranks' models differ in shape (or, without the initial broadcast, in
        value): two tiny all-reduces of a fingerprint at start-up, outside the training meter."""
        if self.transport.world_size == 1:
            return
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
        fp = [len(tensors), sum(t.numel() for t in tensors), int(hashlib.sha256(shapes).hexdigest()[:12], 16)]
        alike = self.transport.alike(fp + ([digest(tensors)] if values else []))
        if not all(alike):
            what = "shapes" if not all(alike[:3]) else "initial values"
            raise UserError(f"the workers' models differ in {what} (rank {self.transport.rank} has "
                            f"{fp[0]} tensors, {fp[1]} elements): build the same model on every rank")

    def step(self) -> dict:
        """Communicate and update as the algorithm dictates; returns this step's traffic counters.

        A NaN or Inf gradient is never applied: with `nonfinite="stop"` (default) this rank raises and the
        launcher stops every rank; with `nonfinite="skip"` the ranks agree through one small all-reduce per step
        (it costs a round trip of latency) and all skip the step.

        With `on_failure="continue"`, a worker lost at this step (the launcher announces it) leaves the
        survivors to form a new group here and go on from the new rank 0's model (`Resilience.recover`).

        Under thinwire's launcher the step is reported to its progress watchdog first (two stores into shared
        memory, `comm/progress.py`; at the end of backward already where the step's exchanges land there, as
        bsp's do): a rank stuck in the loop around it is named like one of `thinwire train`."""
        self._report_progress()
        if self.algorithm.used_changed() and not self._warned_late_change and self.transport.rank == 0:
            self._warned_late_change = True
            warnings.warn(f"thinwire: the loop changed gradients (clipped? unscaled?) between backward and "
                          f"trainer.step() that {self.algorithm.name} had already applied in backward (a sync "
                          f"step's local update): the change did not reach that step; pass schedule='none', "
                          f"which hands the gradients over in trainer.step()", stacklevel=2)
        losses, resilience = len(self.failures), self.resilience
        if resilience.behind:            # rejoining the survivors' step count after a loss: nothing applied
            resilience.behind -= 1
            self.scheduler.discard_step()
        else:
            try:
                self._step()
            except PeerLost as lost:
                resilience.recover(lost)
        self.step_count += 1
        if not resilience.behind and len(self.failures) == losses:
            if self.algorithm.join_boundary(self.step_count):
                self.committed = self.step_count     # every step's work up to here is in every member's model
                self._took_part(self.transport.world_size)
                if self.elastic is not None:
                    resilience.boundary()
            elif self.elastic is not None:       # rank 0 may fix a join's switch between boundaries
                self.elastic.ahead(self.step_count, self.algorithm.join_next)
        self.algorithm.used.clear()     # (updates this step took itself, after the loop's changes)
        # a local step next, or one skipped to rejoin the others: no gradient hook runs
        self.scheduler.next_step(self.algorithm.communicates() and not resilience.behind)
        return self.transport.meter.mark_step()

    def _report_progress(self) -> None:
        report_progress(self.step_count + 1)

    def _step(self) -> None:
        if self.nonfinite == "skip":
            # every rank's verdict before anything is applied: one all-reduce and one host read per step
            grads = [p.grad for p in self.parameters if p.grad is not None]
            flag = torch.zeros(1, device=grads[0].device if grads else self.transport.device)
            if grads:
                nonfinite_flag(grads, flag)
            flag = flag.to(self.transport.device)
            self.transport.all_reduce(flag, op="max")
            if flag.item() > 0:                     # host: once per step (every rank's verdict)
                for p in self.parameters:
                    if p.grad is not None:
                        p.grad.zero_()
                self.skipped_steps += 1
                self.scheduler.discard_step()
                return
        elif self.finite is not None:               # on the device; read with the next exchange
            self.finite.check(self.parameters, self.step_count + 1)
        self.algorithm.step()

    def close(self) -> None:
        """Drain what is in flight and leave every worker with the model the algorithm defines (DiLoCo's last
        outer step, DTS's last window); call it once, after the last `step()`."""
        if self.finite is not None:
            self.finite.read_with(seen="at close")
        try:
            self.algorithm.close()
        except PeerLost as lost:         # lost while draining: survive it, then drain the survivors' way
            self.resilience.recover(lost)
            self.algorithm.close()

    def _took_part(self, ranks: int) -> None:
        """The synchronization that ended this step ran among `ranks` ranks (`participants`)."""
        last = self.participants[-1] if self.participants else None
        if last is not None and last[2] == ranks and last[1] < self.step_count:
            last[1] = self.step_count
        else:
            self.participants.append([self.step_count, self.step_count, ranks])

    def metrics(self) -> dict:
        """This rank's counters: `steps`, `skipped_steps`, the transport's traffic (`bytes_sent`, `bytes_recv`,
        `emulated_s`, `wait_s`, ...), `failures` if any, and the algorithm's own metrics."""
        out = {"steps": self.step_count, "skipped_steps": self.skipped_steps, **self.transport.meter.totals()}
        if self.failures:
            out["failures"] = list(self.failures)
        if self.participants:
            out["participants"] = [list(run) for run in self.participants]
        out.update(self.algorithm.metrics())
        return out

    def state_dict(self) -> dict:
        """This rank's checkpoint: the step, the model, the optimizer and the algorithm's, compressor's and
        memory's state (error-feedback residuals, DiLoCo's anchor and outer optimizer)."""
        if self.finite is not None:        # a checkpoint never holds a model a non-finite gradient went into
            self.finite.read_with(seen="at a checkpoint")
        return {"step": self.step_count, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.state_dict(),
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s result, saved by this rank.

        Args:
            state: what `state_dict()` returned.
        """
        self.step_count = state["step"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.algorithm.load_state_dict(state["algorithm"])
