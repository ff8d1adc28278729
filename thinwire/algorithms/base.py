"""The interface every synchronization scheme / training algorithm implements.

The Trainer (or `tw.attach`) builds the algorithm from its registered name and parameters, then calls
`attach(context)` with a `Context`: what the algorithm sees of the training (model, optimizer, parameters, the
scheduler's public view, the transport, the tracer, the compressor and memory, the failure record, and the factory
of its exchanges), never the trainer itself. `attach` calls `setup()` and attaches the scheduler
(`thinwire.sched`) to the model. Every gradient then walks one
path: during backward the scheduler hands each full bucket to `on_bucket(bucket)`, where the algorithm decides
what to do with it at once — start its exchange (`self.exchange.start(...)`, which returns a future), accumulate it,
take a local optimizer step of its parameters — while backward goes on with the earlier layers. After backward the
user calls `trainer.step()`, which calls `step()`: it calls `self.scheduler.flush()` (the buckets backward did not
hand over), waits only for what this step needs, applies the update, and ends with `self.scheduler.end_step()`.
An algorithm that tolerates latency (DTS, CD-SGD) keeps futures across steps instead of waiting.
A step that sends nothing (`communicates()` is false: DiLoCo's and local SGD's inner steps, DTS's sparse steps)
costs what a plain `optimizer.step()` costs: no gradient hook runs in its backward and `step()` calls
`local_update()` (or `self.scheduler.local_step()`) instead of `flush()`.
`close()` drains in-flight communication and leaves every worker with the model the algorithm defines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..comm import Transport
from ..errors import UserError
from ..exchange import Exchange
from ..exchange.ps import check_uplink
from ..optim import own_step
from ..sched import Scheduler
from ..trace import Tracer
from ._registry import architectures
from .cost import CostFamily


def int_at_least(what: str, value, low: int, hint: str = "") -> int:
    """`value` if it is an integer >= `low`, else a UserError naming `what` (and ending with `hint`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{what} must be an integer >= {low}, got {value!r}{hint}")
    return value


@dataclass
class Context:
    """What an algorithm sees of the training it runs in (`Algorithm.attach`).

    `params`: the model's trainable parameters, in model order. `scheduler`: used through its public view only
    (`buckets`, `flush()`, `end_step()`, `began`, `close()`, `describe()`, `defers_update`, `finish_step()`).
    `failures`: the record of workers lost and survived (`on_failure="continue"`), one dict per loss
    (`lost`, `step`: the step every survivor has counted once the interrupted one ends, `members`), appended by
    whoever drives the steps before it calls `Algorithm.recover()`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list
    scheduler: Scheduler
    transport: Transport
    tracer: Tracer
    compressor: Any
    memory: Any
    failures: list = field(default_factory=list)
    finite: Any = None        # the gradients' pending NaN/Inf verdict, read with every exchange's own check
    modes: dict = field(default_factory=dict)     # the scheduler's options for every exchange (`exchange`)
    collectives: dict = field(default_factory=dict)   # the user's for the training's compressor (or a wrapper)

    def exchange(self, cls: type = Exchange, compressor=None, memory=None, transport=None, **options) -> Exchange:
        """An exchange of class `cls` on `transport` (default: the training's), through `compressor` and `memory`
        (default: the training's, with the user's `collectives`), its programs run as the scheduler's `modes`
        say (background, serial); its finiteness check reads the gradients' pending verdict too (`guard`)."""
        chosen = self.collectives if compressor is None else {}
        return cls(self.transport if transport is None else transport,
                   self.compressor if compressor is None else compressor, self.memory if memory is None else memory,
                   guard=self.finite, **self.modes, **chosen, **options)


class Algorithm:
    name: ClassVar[str] = ""
    architectures: ClassVar[tuple[str, ...]] = ("allreduce",)   # the first one is the default
    compression: ClassVar[bool] = True          # whether it takes a compressor and memory
    default_compressor: ClassVar[str] = "none"
    default_memory: ClassVar[str] = "none"
    schedules: ClassVar[tuple[str, ...]] = ("none", "wfbp", "fusion", "mgwfbp")   # priority applies bsp's update
    checks_finite: ClassVar[bool] = False       # its exchange checks every gradient bucket before sending it
    exchanges_gradients: ClassVar[bool] = False  # its exchange carries the gradients the optimizer applies (a
    #   memory that applies momentum before compression takes the optimizer's: Trainer's hand_over_momentum)
    overlaps_steps: bool = False                # its exchanges outlive the step that started them (DTS, CD-SGD)
    lands_in_backward: bool = False             # as DDP: every p.grad holds the mean gradient when backward
    #   returns (`land()`, at its end), for the training loop to read or change (clip, unscale) before step()
    survives_failures: ClassVar[bool] = False   # its averages stay meaningful over fewer workers (recover())
    keeps_local_work: ClassVar[bool] = False    # at a loss, each survivor's model and optimizer since the last
    #   boundary are its own to keep (local SGD, DiLoCo: the next average takes them in); recover() makes the state
    #   that must agree (an anchor, an outer optimizer) agree. Else every survivor takes the new rank 0's.
    inner_state_own: ClassVar[bool] = False     # each worker's optimizer state is its own and its model is set from
    #   the algorithm's state at every sync (DiLoCo's inner AdamW and θ): an elastic job's newcomer takes θ from
    #   newcomer_state() and starts its optimizer afresh, and neither crosses the link twice. Else it takes rank 0's.
    exchange_class: ClassVar[type] = Exchange   # what make_exchange builds (the PS and gossip forms: their own)
    cost: ClassVar[CostFamily | None] = None    # how the planner predicts it (`thinwire.algorithms.cost`)
    sgd_only: ClassVar[bool] = False            # its update compensates plain or momentum SGD only (check_run)
    adam_only: ClassVar[bool] = False           # Adam's update or moments: Adam/AdamW only (check_run)
    role: str = "worker"                        # "server" on a parameter-server rank (`PSMixin`: it calls serve())
    # how the workers' steps relate, for the training loop's evaluations and stop: "step" (every worker takes the
    # same steps in lockstep: evaluations meet at a common step), "round" (workers take different numbers of steps
    # between syncs they all take: `request_stop`, then every worker ends at the sync where `finished` turns
    # true), "free" (no worker waits for another between steps: each stops on its own)
    pace: str = "step"
    finished: bool = False                      # ("round") a sync read a stop request: every worker ends now
    # ("round") after a step that ended a round (every worker has merged the same syncs, none is in flight): a
    # number every worker gives that round's end, where a checkpoint of every worker can be cut; else None
    cut: int | None = None

    def __init__(self, architecture: str | None = None):
        arch = architecture or self.architectures[0]
        if arch not in self.architectures:
            valid = architectures(self.name) if self.name else self.architectures
            raise UserError(f"algorithm {self.name!r} does not run on architecture {arch!r}; "
                            f"valid: {', '.join(valid)}")
        self.architecture = arch

    # -- wiring ----------------------------------------------------------------------------------------
    def attach(self, ctx: Context) -> None:
        """Wire the algorithm to `ctx`, build its exchanges and state (`setup`), attach the scheduler."""
        self.ctx = ctx
        self.model, self.optimizer = ctx.model, ctx.optimizer
        self.params: list[torch.nn.Parameter] = ctx.params
        self.transport, self.tracer, self.scheduler = ctx.transport, ctx.tracer, ctx.scheduler
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        self.compressor, self.memory = ctx.compressor, ctx.memory
        self._exchanges: list[Exchange] = []
        self.used: list = []        # (gradient, its version) of every bucket stepped since the last `used_changed`
        ctx.modes = self.scheduler.modes(self.transport, self.compressor, self.overlaps_steps)
        self.setup()
        self.scheduler.attach(self.model, self.params, self, self.transport, self.tracer, self.optimizer)

    def check_components(self, compressor, memory) -> None:
        """Raise UserError (naming what to use instead) if this algorithm cannot run with `compressor` and
        `memory`; called at construction, before any worker starts. The parameter server's links cannot carry a
        compressor whose rounds are summed over every rank (aggregation "custom")."""
        if self.architecture == "ps" and compressor is not None:
            check_uplink(compressor)

    def check_run(self, world_size: int, optimizer=None) -> None:
        """Raise UserError if this algorithm cannot run with `world_size` ranks (servers included) or the run's
        `optimizer` (None: not known yet); called before any worker starts (`TrainConfig.validate`, with an
        optimizer of the run's kind and settings) and again by `setup` where it matters."""

    def setup(self) -> None:
        """Build exchanges and buffers (called once the trainer is wired, before the scheduler attaches)."""

    # -- the step --------------------------------------------------------------------------------------
    def communicates(self) -> bool:
        """Whether the coming step (its backward and its `step()`) exchanges anything; asked once the previous
        step is over. False: a local step, whose backward hands no bucket over (no gradient hook runs) and whose
        `step()` must not call `flush()`."""
        return True

    def local_update(self) -> None:
        """A step that sends nothing: the optimizer on the gradients as backward left them (missing ones as zeros,
        as on every step), and the step closed."""
        self.scheduler.local_step()
        self.optimizer_step()
        self.scheduler.end_step()

    def on_bucket(self, bucket) -> None:
        """Backward handed over a full bucket of gradients (`bucket.buffer`, `bucket.params`). Default: keep it."""

    def land(self) -> None:
        """(`lands_in_backward`; the scheduler calls it at the end of a backward that handed buckets over) Wait
        for their exchanges: the mean gradients in place in their p.grad."""

    def step(self) -> None:
        raise NotImplementedError

    def request_stop(self) -> None:
        """("round") The loop would stop: send it with the next sync, at which every worker ends together."""

    def close(self) -> None:
        """Drain in-flight communication; leave models consistent. Subclasses call super().close() last."""
        self.scheduler.close()

    def recover(self) -> None:
        """A worker was lost: the survivors hold the new rank 0's model and optimizer state and go on from here
        (`Trainer._recover`); drop what the interrupted step had in flight."""
        raise NotImplementedError(f"{self.name} does not survive a lost worker")

    @staticmethod
    def full_precision_steps(params: dict, steps: int) -> int:
        """Of the first `steps` steps under `params` (the constructor's), how many all-reduce the full-precision
        gradient as bsp does (1-bit Adam's warm-up, 0/1 Adam's variance steps): the race's forecast times them as
        bsp's (`thinwire.compare.forecast`)."""
        return 0

    def replicated(self) -> list:
        """The tensors every member holds alike (an anchor, an outer optimizer's state). After a loss the Trainer
        checks that the survivors still do (a digest agreed on: `"alike"` in the failure's record), and recover()
        sends rank 0's only where they do not (an average completed on some survivors only, a newcomer)."""
        return []

    # -- elastic jobs (docs/reliability.md, "Workers that join a running job") ------------------------------
    def join_boundary(self, step: int) -> bool:
        """Whether the step `step` (1-based, just ended) is a synchronization boundary where newcomers may join.
        An algorithm that leaves this out cannot run in an elastic job."""
        return False

    def join_after(self, step: int) -> int:
        """The boundary where a join announced at boundary `step` switches: far enough ahead that no member can
        pass it before rank 0 wrote the announcement (it needs rank 0's part of a synchronization issued later)."""
        return step + 1

    def join_next(self, step: int) -> int | None:
        """At the end of step `step` (no boundary): the first boundary whose synchronization has not been issued
        yet (a join's switch may be fixed there before any member can pass it), or None to wait for a boundary
        (`join_after`)."""
        return None

    def before_switch(self) -> None:
        """At the boundary where the members switch to a generation with newcomers: leave nothing in flight
        on the old group."""

    def regrouped(self) -> None:
        """The transport's group changed (a newcomer, a loss): the rank and the world size follow."""
        self.rank, self.world_size = self.transport.rank, self.transport.world_size

    def newcomer_state(self) -> dict:
        """(rank 0 of a join generation) The algorithm's state a newcomer takes: tensors, numbers, lists."""
        return {}

    def take_newcomer_state(self, state: dict) -> None:
        """(a newcomer) `newcomer_state()` of rank 0; the Trainer loaded the model and optimizer before."""

    def after_join(self) -> None:
        """Every member of the join generation, once the newcomers have their state (collectives allowed)."""

    def rekey(self, old: list, new: list) -> None:
        """The scheduler re-planned its buckets ((key, numel) lists): per-bucket exchange state follows."""
        for ex in self._exchanges:
            ex.rekey(old, new)

    def make_exchange(self, compressor=None, memory=None, **options) -> Exchange:
        """An `exchange_class` from the context's factory (by default through the training's compressor and
        memory)."""
        ex = self.ctx.exchange(self.exchange_class, compressor, memory, **options)
        self._exchanges.append(ex)
        return ex

    def metrics(self) -> dict:
        """The schedule, and where an exchange aggregates robustly its counts (`Robust.metrics`)."""
        robust = next((ex.robust.metrics() for ex in getattr(self, "_exchanges", ()) if ex.robust is not None), {})
        return {"schedule": self.scheduler.describe(), **robust}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- helpers shared by the algorithms ----------------------------------------------------------------
    def optimizer_step(self, params: list[torch.Tensor] | None = None) -> None:
        """The user's optimizer: a full step, or a step of `params` only (a bucket, during backward)."""
        with self.tracer.span("optimizer", "optimizer"):
            own_step(self.optimizer, params)
        if params is not None:      # a bucket's update, taken in backward: the loop changes its gradients too late
            self.used += [(g, g._version) for p in params if (g := p.grad) is not None]

    def used_changed(self) -> bool:
        """Whether a gradient that a bucket's update took (`optimizer_step(bucket.params)`, in backward) has been
        changed in place since (the loop clipped or unscaled it before `trainer.step()`); forgets them."""
        changed = any(g._version != v for g, v in self.used)
        self.used = []
        return changed

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


class Periodic:
    """(mixed in first) H local steps, then a synchronisation: the bookkeeping of local SGD on all-reduce and on
    gossip."""

    def _period_init(self, period: int, hint: str) -> None:
        self.period = int_at_least(f"{self.name} period H", period, 1, hint)
        self.local_steps = 0      # since the last synchronisation
        self.syncs = 0

    def syncing(self) -> bool:
        """Whether this step ends a period (its models are averaged)."""
        return self.local_steps + 1 >= self.period

    def metrics(self):
        return {**super().metrics(), "period": self.period, "syncs": self.syncs}

    def state_dict(self):
        return {**super().state_dict(), "local_steps": self.local_steps, "syncs": self.syncs}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.local_steps, self.syncs = state["local_steps"], state["syncs"]
