"""`Trainer`: the user-facing object around a model and an optimizer.

    trainer = tw.Trainer(model, opt, algorithm="dts", delay=4, period=4, compressor="topk", ratio=0.01)
    ...; loss.backward(); trainer.step(); opt.zero_grad()
    trainer.close()

Keyword parameters are routed by name to the algorithm, the compressor, the memory, the scheduler
(`thinwire.sched.make`: schedule, bucket_mb, ...), the transport (`allreduce`: the all-reduce algorithm) and the
exchange (`collective`, `sparse_collective`: `thinwire.exchange.exchange`);
each gets the ones it declares, and a parameter none of them takes is an error at construction. On the parameter
server, `downlink_<name>` is parameter <name> of the downlink compressor (`downlink_compressor="qsgd",
downlink_levels=3`; gathered into the algorithm's `downlink_params`).
"""
from __future__ import annotations

import hashlib
import inspect
import threading

import torch
import torch.distributed as dist

from . import algorithms, sched
from .algorithms.base import Context
from .comm import Transport
from .comm import elastic
from .comm.engine import ENGINE
from .comm.membership import MEMBERSHIP, PeerLost
from .comm.progress import report as report_progress
from .comm.state import broadcast_state
from .compress import compressors, memories
from .compress.finite import NonFiniteError
from .errors import UserError
from .exchange.exchange import check_collectives
from .optim import check_momentum, hand_over_momentum, in_own_step, momentum_taker, replaces_momentum  # noqa: F401
from .registry import call, route
from .trace import NULL, Tracer

SCHED_PARAMS = tuple(inspect.signature(sched.make).parameters)
TRANSPORT_PARAMS = ("allreduce",)
EXCHANGE_PARAMS = tuple(inspect.signature(check_collectives).parameters)[1:]   # collective, sparse_collective


def build_components(algorithm, compressor=None, memory=None, **params):
    """Resolve defaults, route `params` by name and build (algorithm, compressor, memory, scheduler, transport
    options, exchange options); raises UserError for unknown names, unknown parameters, bad values and invalid
    combinations (used before launching too)."""
    alg_cls = (algorithms.registry.constructor(algorithm, params) if isinstance(algorithm, str)
               else type(algorithm))
    compressor = compressor or getattr(alg_cls, "default_compressor", "none")
    memory = memory or getattr(alg_cls, "default_memory", "none")
    if isinstance(algorithm, str) and algorithms.registry.accepts(algorithm, "downlink_params"):
        down = {k: params.pop(k) for k in list(params)
                if k.startswith("downlink_") and k not in ("downlink_compressor", "downlink_params")}
        if down:   # the downlink compressor's own parameters (it names the valid ones)
            params["downlink_params"] = {**(params.get("downlink_params") or {}),
                                         **{k[len("downlink_"):]: v for k, v in down.items()}}
    alg_params, comp_params, mem_params, sched_params, transport_params, exchange_params = route(
        {"algorithm": (algorithms.registry, algorithm), "compressor": (compressors, compressor),
         "memory": (memories, memory)}, params, (SCHED_PARAMS, TRANSPORT_PARAMS, EXCHANGE_PARAMS))
    if not getattr(alg_cls, "compression", True) and compressor != "none":
        raise UserError(f"algorithm {alg_cls.name!r} does not exchange gradients through a compressor; "
                        f"drop --compressor or use one of: "
                        f"{', '.join(n for n in algorithms.names() if algorithms.registry.lookup(n).compression)}")
    schedule = sched_params.get("schedule", "fusion")
    if isinstance(schedule, str) and schedule not in getattr(alg_cls, "schedules", sched.SCHEDULES):
        raise UserError(f"algorithm {alg_cls.name!r} does not run with schedule {schedule!r}; "
                        f"valid: {', '.join(alg_cls.schedules)}")
    alg, comp, mem = (algorithms.get(algorithm, **alg_params), compressors.get(compressor, **comp_params),
                      memories.get(memory, **mem_params))
    alg.check_components(comp, mem)      # invalid pairings are refused here, before any worker starts
    check_collectives(comp, **exchange_params)
    return alg, comp, mem, call(sched.make, "schedule", sched_params), transport_params, exchange_params


def nonfinite_stop(rank: int, step: int, seen: str = "") -> NonFiniteError:
    """The error of the NaN/Inf policy `stop` (the Trainer's and the peers'): this rank raises, and the launcher
    stops every rank. Without `seen`: nothing of the step was applied; with it (the Trainer's check, read where
    `seen` says): nothing computed from the gradient was sent, though this worker's own steps since applied it."""
    what = "nothing was applied" if not seen else (f"seen {seen}: nothing computed from it was sent (this "
                                                   f"worker's own steps since applied it)")
    return NonFiniteError(f"rank {rank}: NaN or Inf in the gradient at step {step}; {what} (policy nonfinite=stop)")


def nonfinite_flag(grads: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor | None = None) -> None:
    """Set `found` (a float tensor of one element, on the gradients' device) to 1 if any of `grads` (on that
    device) holds NaN or Inf, on the device, nothing read: one fused op (GradScaler's check at a scale of `one`,
    1: multiplying by 1 leaves every value as it is); sparse or differentiable gradients are only read."""
    try:
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones_like(found) if one is None
                                                             else one)
    except (NotImplementedError, RuntimeError):      # sparse gradients, differentiable ones (create_graph)
        for g in grads:
            g = g.detach().coalesce().values() if g.is_sparse else g.detach()
            found.copy_(torch.maximum(found, (~torch.isfinite(g).all()).to(found.dtype)))


class FiniteGuard:
    """The NaN/Inf policy `stop` without a host read per step: each step's gradients are checked on their device
    (`nonfinite_flag`, a few device ops, nothing read), and the verdict is read by the host once, with the next
    exchange's own finiteness read (`Exchange.guard`: before anything is sent), at a checkpoint and at close. An
    error names the first step whose gradient was not finite."""

    def __init__(self, params: list[torch.Tensor], rank: int):
        self.rank = rank
        devices = sorted({p.device for p in params}, key=str)
        self.device = devices[0]
        self.groups = None if len(devices) == 1 else {d: [i for i, p in enumerate(params) if p.device == d]
                                                      for d in devices}
        self.flags = torch.zeros(2, device=self.device)      # [found, steps checked before the first bad one]
        self._found, self._clean, self._one = self.flags[:1], self.flags[1:], torch.ones(1, device=self.device)
        self.steps: list[int] = []                           # the steps checked since the last verdict
        self._lock = threading.Lock()

    def check(self, params: list[torch.Tensor], step: int) -> None:
        """Check the gradients of step `step` (on the device; nothing read)."""
        with self._lock:
            found = self._found
            if self.groups is None:
                grads = [g for p in params if (g := p.grad) is not None]
                if grads:
                    nonfinite_flag(grads, found, self._one)
            else:
                for d, idx in self.groups.items():
                    grads = [params[i].grad for i in idx if params[i].grad is not None]
                    if grads:
                        f = found if d == self.device else torch.zeros(1, device=d)
                        nonfinite_flag(grads, f)
                        if f is not found:
                            found.copy_(torch.maximum(found, f.to(self.device)))
            self._clean.add_(found == 0)
            self.steps.append(step)

    def read_with(self, extra: torch.Tensor | None = None, seen: str = "with an exchange") -> list[float]:
        """One host read of `extra` (a small device tensor; may be None) and of the verdict on the gradients
        checked since the last read; raises `NonFiniteError` if one was not finite, else returns extra's
        values."""
        with self._lock:
            if not self.steps:
                return [] if extra is None else extra.tolist()   # host: the one read of this exchange
            parts = [self.flags] if extra is None else [extra.reshape(-1).to(self.device, torch.float32), self.flags]
            values = torch.cat(parts).tolist()             # host: the one read of this exchange
            found, clean = values[-2:]
            if found:
                raise nonfinite_stop(self.rank, self.steps[int(clean)], seen)
            self.flags.zero_()
            self.steps.clear()
            return values[:-2]


def nonfinite_params(nonfinite: str, params: dict) -> dict:
    """`params` with the schedule the NaN/Inf policy `nonfinite` needs: "skip" agrees on every rank before any
    gradient is sent, so it runs schedule "none" (another schedule is refused); "stop" changes nothing."""
    if nonfinite not in ("stop", "skip"):
        raise UserError(f"nonfinite must be 'stop' or 'skip', got {nonfinite!r}")
    if nonfinite == "stop":
        return params
    if params.get("schedule", "none") != "none":
        raise UserError("nonfinite='skip' needs schedule='none' (gradients are checked on every rank "
                        "before any is sent); use nonfinite='stop' with overlapping schedules")
    return {**params, "schedule": "none"}


def check_run(algorithm, transport_params: dict, world_size: int, optimizer=None, on_failure: str = "stop",
              watching: bool | None = None) -> None:
    """What built components cannot check alone, before any worker starts (`TrainConfig.validate`): the
    all-reduce algorithm over `world_size` ranks, the algorithm's own limits on the run (`Algorithm.check_run`:
    the world size, the optimizer) and `on_failure`."""
    if "allreduce" in transport_params:
        from .comm.collectives import parse
        parse(transport_params["allreduce"], world_size)
    algorithm.check_run(world_size, optimizer)
    check_on_failure(on_failure, algorithm, watching)


def check_optimizer_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds tensors other than `model`'s parameters (another model's: it would update
    nothing the algorithm exchanges, and no rank would notice)."""
    mine = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in mine for p in held)
    if foreign:
        raise UserError(f"the optimizer holds {foreign} of {len(held)} tensors that are not the model's parameters "
                        f"(another model's?): build it from this model's parameters (model.parameters())")


ON_FAILURE = ("stop", "continue")


def check_on_failure(on_failure: str, algorithm, watching: bool | None = None) -> None:
    """`continue` only for algorithms whose averages stay meaningful over a smaller group, and only where a
    launcher announces the survivors (`watching`; default: whether this process's launcher does)."""
    if on_failure not in ON_FAILURE:
        raise UserError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    if on_failure == "continue" and not getattr(algorithm, "survives_failures", False):
        valid = sorted(n for n in algorithms.names()
                       if getattr(algorithms.registry.lookup(n), "survives_failures", False))
        raise UserError(f"on_failure='continue' needs an algorithm whose averages stay meaningful over fewer "
                        f"workers; {algorithm.name!r} is not one; valid: {', '.join(valid)} "
                        f"(elsewhere: on_failure='stop' and resume from a checkpoint)")
    if on_failure == "continue" and not (MEMBERSHIP.watching if watching is None else watching):
        raise UserError("on_failure='continue' needs thinwire's launcher to announce the survivors: start the "
                        "workers with thinwire.launch(..., on_failure='continue') (thinwire train "
                        "--on-failure continue); under torchrun use on_failure='stop' and --max-restarts")


def check_elastic(algorithm, scheduler) -> None:
    """An elastic job needs an algorithm that names its synchronization boundaries (where newcomers join)."""
    if type(algorithm).join_boundary is algorithms.base.Algorithm.join_boundary:
        valid = sorted(n for n in algorithms.names()
                       if algorithms.registry.lookup(n).join_boundary is not algorithms.base.Algorithm.join_boundary)
        raise UserError(f"an elastic job needs an algorithm that takes newcomers in at its synchronization "
                        f"boundaries; {algorithm.name!r} does not; valid: {', '.join(valid)}")
    if getattr(scheduler, "defers_update", False):
        raise UserError("an elastic job cannot run schedule='priority' (its update is applied in the next "
                        "forward, so a step's end is no synchronization boundary); use fusion, wfbp or mgwfbp")


class Trainer:
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
        self.committed = 0               # the last synchronization boundary passed (bsp: every step; localsgd,
        #                                  diloco: a sync; dts: a window's end): the work before it counts
        self._behind = 0                 # steps to skip to rejoin the survivors' step after a loss
        self.step_count = 0
        joined = None
        if self.elastic is not None:     # the generation's own group (thinwire.comm.elastic)
            self.elastic.agree("trainer", self.describe(params))
            if self.elastic.joining:
                joined = self.elastic.join()
            elif self.elastic.group is None:
                self.elastic.start()
            transport = Transport(group=self.elastic.group, network=network, tracer=self.tracer,
                                  device=self.parameters[0].device, **transport_params)
            transport.generation = self.elastic.gen
        self.transport = transport or Transport(network=network, tracer=self.tracer,
                                                device=self.parameters[0].device, **transport_params)
        if transport is not None and "allreduce" in transport_params:
            from .comm.collectives import parse
            parse(transport_params["allreduce"], transport.world_size)
            transport.allreduce = transport_params["allreduce"]
        if tracer is not None:
            self.transport.tracer = tracer
        if joined is None:               # a newcomer is checked by its fingerprint and takes a live peer's state
            self._check_models_match(values=not sync_initial_model)
            if sync_initial_model:
                self._broadcast_model()
        # policy stop: every step's gradients checked on the device, the verdict read with the next exchange;
        # none where the algorithm's exchange checks every gradient bucket itself before sending it
        self.finite = (FiniteGuard(self.parameters, self.transport.rank)
                       if nonfinite == "stop" and not getattr(self.algorithm, "checks_finite", False) else None)
        self.context = Context(model, optimizer, self.parameters, self.scheduler, self.transport, self.tracer,
                               self.compressor, self.memory, failures=self.failures, finite=self.finite,
                               collectives=exchange_params)
        self.algorithm.attach(self.context)
        if joined is not None:
            self._welcome(joined, previous=[])
        self.scheduler.next_step(self.algorithm.communicates())

    def _check_models_match(self, values: bool) -> None:
        """Refuse to start when the ranks' models differ in shape (or, without the initial broadcast, in
        value): two tiny all-reduces of a fingerprint at start-up, outside the training meter."""
        if self.transport.world_size == 1:
            return
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
        fp = [len(tensors), sum(t.numel() for t in tensors), int(hashlib.sha256(shapes).hexdigest()[:12], 16)]
        if values:
            digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors)).hexdigest()
            fp.append(int(digest[:12], 16))
        hi = torch.tensor(fp, dtype=torch.float64, device=self.transport.device)
        lo = -hi.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.transport.group)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.transport.group)
        if not torch.equal(hi, -lo):
            what = "shapes" if not torch.equal(hi[:3], -lo[:3]) else "initial values"
            raise UserError(f"the workers' models differ in {what} (rank {self.transport.rank} has "
                            f"{fp[0]} tensors, {fp[1]} elements): build the same model on every rank")

    def _broadcast_model(self) -> None:
        """Start every worker from rank 0's model (as DDP does); not counted as training traffic."""
        if self.transport.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                self._raw(dist.broadcast, t.data, group=self.transport.group, group_src=0)

    def step(self) -> dict:
        """Communicate and update as the algorithm dictates; returns this step's traffic counters.

        A NaN or Inf gradient is never applied: with `nonfinite="stop"` (default) this rank raises and the
        launcher stops every rank; with `nonfinite="skip"` the ranks agree through one small all-reduce per step
        (it costs a round trip of latency) and all skip the step.

        With `on_failure="continue"`, a worker lost at this step (the launcher announces it) leaves the
        survivors to form a new group here and go on from the new rank 0's model (`_recover`).

        Under thinwire's launcher the step is reported to its progress watchdog first (two stores into shared
        memory, `comm/progress.py`): a rank stuck in the loop around it is named like one of `thinwire train`."""
        report_progress(self.step_count + 1)
        losses = len(self.failures)
        if self._behind:                 # rejoining the survivors' step count after a loss: nothing applied
            self._behind -= 1
            self.scheduler.discard_step()
        else:
            try:
                self._step()
            except PeerLost as lost:
                self._recover(lost)
        self.step_count += 1
        if not self._behind and len(self.failures) == losses:
            if self.algorithm.join_boundary(self.step_count):
                self.committed = self.step_count     # every step's work up to here is in every member's model
                if self.elastic is not None:
                    self._boundary()
            elif self.elastic is not None:       # rank 0 may fix a join's switch between boundaries
                self.elastic.ahead(self.step_count, self.algorithm.join_next)
        # a local step next, or one skipped to rejoin the others: no gradient hook runs
        self.scheduler.next_step(self.algorithm.communicates() and not self._behind)
        return self.transport.meter.mark_step()

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

    def _recover(self, lost: PeerLost, counted: int | None = None) -> None:
        """With `on_failure="continue"`, the survivors of `lost` form a new group and go on (else `lost` is raised):
        the interrupted step is abandoned everywhere, every survivor takes the new rank 0's model and optimizer
        state, and a survivor that got less far skips the steps it is behind (so every rank's loop issues the
        same operations again). A loss during the recovery starts it again, with the newer membership."""
        if self.on_failure != "continue":
            raise lost
        counted = self.step_count + 1 if counted is None else counted
        while True:
            try:
                ENGINE.abandon(lost)
                if self.elastic is not None:     # the newest generation's own group (it may take newcomers in)
                    previous = self.elastic.members
                    rec = self.elastic.regroup(lost.generation)
                    self._regrouped(rec, previous)
                else:
                    self.transport.regroup(dist.new_group(lost.members, use_local_synchronization=True))
                self._resync(lost, counted)
                return
            except PeerLost as again:
                lost = again

    def _raw(self, fn, *args, **kwargs):
        """A torch.distributed call outside the Transport (the recovery's agreement, the model's broadcast): in an
        elastic job a peer lost meanwhile is a `PeerLost`, as in a Transport's wait."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if self.elastic is None:
                raise
            lost = MEMBERSHIP.wait_change(self.transport.generation or 0, 30.0)
            if lost is None:
                raise
            raise lost from e

    def _resync(self, lost: PeerLost, counted: int) -> None:
        """After a loss, on the new group: agree on the step (the most any member has counted once `counted`, this
        member's, ends; a member behind skips the steps it lacks), and every member takes rank 0's model,
        optimizer state and algorithm state. A newcomer (`counted` 0) starts at the agreed step.

        Where the algorithm `keeps_local_work` (local SGD, DiLoCo) and every member counted the same step (the
        loss met at the same synchronization, no newcomer), the survivors keep their own models and optimizer
        state instead: the work since the last boundary goes into the next average (`"kept"` in the record)."""
        self.scheduler.discard_step()
        at = torch.tensor([float(counted), -float(counted)], dtype=torch.float64, device=self.transport.device)
        self._raw(dist.all_reduce, at, op=dist.ReduceOp.MAX, group=self.transport.group)
        agreed, least = (int(v) for v in at.tolist())      # host: once per recovery
        kept = self.algorithm.keeps_local_work and -least == agreed
        if counted == 0:
            self.step_count = agreed
        else:
            self._behind = agreed - counted
        if not kept:
            self._broadcast_model()
            # tensors and a checked JSON layout, never a pickle (comm/state.py)
            mine = self.optimizer.state_dict() if self.transport.rank == 0 else None
            if self.elastic is not None:     # (a group of its own: addressed through the transport)
                state = elastic.broadcast_state(self.transport, mine, 0)
            else:
                state = broadcast_state(mine, src=self.transport.global_of(0), group=self.transport.group,
                                        device=self.transport.device)
            self.optimizer.load_state_dict(state)
        # "step": the step every survivor has counted once this one ends (and behind ranks skipped theirs)
        self.failures.append({"lost": lost.lost, "step": agreed, "members": lost.members, "kept": kept})
        self.algorithm.recover()

    # -- elastic jobs: newcomers (docs/reliability.md, "Workers that join a running job") -------------------
    def describe(self, params: dict) -> dict:
        """What every member of an elastic job must share, JSON-able: a newcomer that differs is refused."""
        return {"algorithm": self.algorithm.name, "algorithm parameters": dict(sorted(params.items())),
                "compressor": self.compressor.name, "memory": self.memory.name,
                "optimizer": type(self.optimizer).__name__,
                "optimizer settings": [{k: v for k, v in sorted(g.items()) if k != "params"}
                                       for g in self.optimizer.param_groups],
                "model": [[name, list(p.shape), str(p.dtype)] for name, p in self.model.named_parameters()]}

    def _boundary(self) -> None:
        """A synchronization boundary of the algorithm: admit newcomers (rank 0), switch to a join generation
        whose boundary this is (every member), or survive a loss announced since (this step is counted: it
        ended at the boundary). A newcomer lost while it takes its state is such a loss."""
        try:
            if not self.elastic.boundary(self.step_count, self.algorithm.join_after):
                return
            self.algorithm.before_switch()          # e.g. DTS applies every average in flight
            previous = self.elastic.members
            rec = self.elastic.switch()
            self._regrouped(rec, previous)
            if rec["kind"] == "loss":               # a loss while the group formed: as any loss
                lost = sorted(set(previous) - set(rec["members"]))
                self._resync(PeerLost(self.elastic.gen, rec["members"], lost), self.step_count)
            else:
                self._welcome(rec, previous)
        except PeerLost as lost:
            self._recover(lost, self.step_count)

    def _regrouped(self, rec: dict, previous: list) -> None:
        self.transport.regroup(self.elastic.group, self.elastic.gen)
        self.elastic.retire_old()
        self.algorithm.regrouped()
        new = [m for m in rec["members"] if m not in previous]
        if new:
            self.joins.append({"joined": new, "step": self.step_count, "members": list(rec["members"])})

    def _welcome(self, rec: dict, previous: list) -> None:
        """A join generation formed: rank 0 hands each newcomer its state (point to point, tensors behind a JSON
        manifest); the others keep theirs. A newcomer pulled into a loss generation goes through the loss's
        resynchronisation with everyone instead, as does a newcomer whose generation loses a member while it
        takes its state (the members' side of that is `_boundary`'s)."""
        newcomer = not previous
        try:
            if rec["kind"] == "loss":
                self._resync(PeerLost(self.elastic.gen, rec["members"], rec.get("lost", [])), 0)
                return
            if newcomer:
                state = elastic.recv_state(self.transport, 0)
                self.step_count = int(state["step"])
                with torch.no_grad():
                    for t, v in zip(self._model_tensors(), state["model"]):
                        t.copy_(v)
                self.optimizer.load_state_dict(state["optimizer"])
                self.algorithm.take_newcomer_state(state["algorithm"])
            elif self.transport.rank == 0:
                state = {"step": self.step_count, "model": self._model_tensors(),
                         "optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.newcomer_state()}
                for r in [rec["members"].index(m) for m in rec["members"] if m not in previous]:
                    elastic.send_state(self.transport, state, r)
            self._raw(self.algorithm.after_join)
        except PeerLost as lost:
            if not newcomer:
                raise
            self._recover(lost, 0)       # with the others, from the newer generation: at the step they agree

    def _model_tensors(self) -> list[torch.Tensor]:
        return [t.data for t in list(self.model.parameters()) + list(self.model.buffers())]

    def close(self) -> None:
        if self.finite is not None:
            self.finite.read_with(seen="at close")
        try:
            self.algorithm.close()
        except PeerLost as lost:         # lost while draining: survive it, then drain the survivors' way
            self._recover(lost)
            self.algorithm.close()

    def metrics(self) -> dict:
        out = {"steps": self.step_count, "skipped_steps": self.skipped_steps, **self.transport.meter.totals()}
        if self.failures:
            out["failures"] = list(self.failures)
        out.update(self.algorithm.metrics())
        return out

    def state_dict(self) -> dict:
        if self.finite is not None:        # a checkpoint never holds a model a non-finite gradient went into
            self.finite.read_with(seen="at a checkpoint")
        return {"step": self.step_count, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.state_dict(),
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.algorithm.load_state_dict(state["algorithm"])


class Attachment:
    """What `attach` returns: a thinwire algorithm driven from the optimizer's own `step()` (see `attach`).

    `metrics()`, `state_dict()`, `load_state_dict()` are the `Trainer`'s; `close()` drains in-flight communication,
    leaves every worker with the model the algorithm defines and removes the hooks. As a context manager it
    closes on a normal exit and only removes the hooks when an exception leaves the block (nothing more is sent).
    On a parameter-server rank (`role == "server"`) call `serve()` instead of training.
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
        return self.trainer.algorithm

    @property
    def role(self) -> str:
        """"worker", or "server" on a parameter-server rank (which calls `serve()` instead of training)."""
        return getattr(self.trainer.algorithm, "role", "worker")

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    def serve(self, checkpoint=None) -> None:
        """(parameter-server rank) Serve the workers until they are done."""
        self.trainer.algorithm.serve(checkpoint=checkpoint)

    def metrics(self) -> dict:
        return self.trainer.metrics()

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def detach(self) -> None:
        """Remove the optimizer's hooks and the scheduler's; nothing is sent (the optimizer steps plainly again)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._unmute()
        self.trainer.scheduler.close()

    def close(self) -> None:
        if not self._hooks:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._unmute()
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

        with tw.attach(model, opt, algorithm="diloco", period=50, compressor="fp4") as tw_run:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                opt.step()                     # the algorithm's step: communication and the update
                opt.zero_grad()

    The model's backward hooks (the scheduler's, on every parameter) hand each bucket to the algorithm during
    backward; the optimizer's step pre-hook runs the algorithm's step where the loop calls `optimizer.step()`
    (after evaluating its closure, if it passes one) and the loop's own call then updates nothing, the
    algorithm having applied its update; the post-hook restores the parameter groups. Parameters are the
    `Trainer`'s (compressor, memory, schedule, network, nonfinite, ...), and the result is the Trainer's, bitwise,
    for the same seed. Don't wrap the model in DistributedDataParallel: the algorithm does the communicating."""
    return Attachment(Trainer(model, optimizer, algorithm=algorithm, **params))
