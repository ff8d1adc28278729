"""The algorithms on the parameter server: `PSMixin` (the roles every one of them shares) and `bsp` on the PS.

One class per (algorithm, architecture): `bsp` on the PS is `PSBSP` (registered with variant "ps"), `ssp`, `asp`
and `backup` derive from it, `cdsgd`/`odsgd`/`bitsgd` (cdsgd.py) and `localsgd` (localsgd.py) mix `PSMixin` into
their all-reduce class. On a server rank the algorithm sets `role = "server"` and `serve()` runs the server
(`thinwire.exchange.ps.PSServer`) until the workers are done; on a worker rank `role = "worker"`, its exchanges
are `PSExchange`s (a bucket's push starts when backward hands the bucket over, `on_bucket`), and `step()` waits
for the answers its rule needs. Every rank builds the same buckets (the scheduler's, from the same model and
bucket size; `mgwfbp` and `priority` re-plan or reorder them and do not run here); the server owns slice k of each.
"""
from __future__ import annotations

import torch

from ..compress import compressors
from ..errors import UserError
from ..exchange.ps import PSExchange, PSServer, PSWorker, downlink_scale
from ..comm.ps import PSLayout
from ..optim import step_subset
from ..tensors import copy_flat
from ._registry import register, registry
from .base import Algorithm
from .cost import CostFamily

# Table II of Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A Comprehensive
# Survey", arXiv 2003.06307: which architectures each PS-only scheme lacks, and what to use instead
_ALTERNATIVES = {"allreduce": "for all-reduce use bsp or localsgd", "gossip": "for gossip use dpsgd, adpsgd, sgp or choco"}


def clone_optimizer(template: torch.optim.Optimizer, params: list) -> torch.optim.Optimizer:
    """The worker's optimizer (its class and param_groups[0] hyper-parameters) over the server's slices."""
    group = {k: v for k, v in template.param_groups[0].items() if k != "params"}
    try:
        return type(template)(params, **group)
    except TypeError:
        return torch.optim.SGD(params, lr=group["lr"], momentum=group.get("momentum", 0.0),
                               weight_decay=group.get("weight_decay", 0.0))


class PSMixin:
    """The parameter-server roles of an algorithm; mixed in before its base class (an all-reduce algorithm's class,
    or `Algorithm`). The base class's `setup()` makes its exchanges with `make_exchange` as usual: here they are
    `PSExchange`s, one codec each (a server decodes a push with the compressor of the exchange that made it).
    Class attributes: `rule` (the server's: "sync", "async", "backup", "quorum"). The server applies `server_update`
    (default: the worker's optimizer on the mean gradient, Tang et al. eq. 6)."""

    architectures = ("ps",)
    schedules = ("none", "wfbp", "fusion")
    rule = "sync"
    backups = 0
    exchange_class = PSExchange
    server_opt: torch.optim.Optimizer | None = None   # (server) what `server_update` steps; none for averaging

    def _ps_init(self, servers, downlink_compressor: str = "none", downlink_params: dict | None = None) -> None:
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise UserError(f"{self.name} needs servers >= 1 parameter-server ranks (--servers K), got {servers!r}")
        if downlink_params is not None and not isinstance(downlink_params, dict):
            raise UserError(f"downlink_params must be a dict of the downlink compressor's parameters (or give "
                            f"them as downlink_<name>), got {downlink_params!r}")
        self.servers = servers
        self.downlink = compressors.get(downlink_compressor, **(downlink_params or {}))   # names the valid ones
        if self.downlink.name == "none":
            self.downlink, self.downlink_scale = None, 1.0
        else:
            self.downlink_scale = downlink_scale(self.downlink)   # contractive, or refused here
        self.server = self.worker = None

    # -- wiring --------------------------------------------------------------------------------------------
    def make_exchange(self, compressor=None, memory=None, **options) -> PSExchange:
        return super().make_exchange(compressor, memory, codec=len(self._exchanges), **options)

    def attach(self, ctx) -> None:
        super().attach(ctx)                # setup(), then the scheduler builds its buckets
        buckets = self.scheduler.buckets
        keys = [b.key for b in buckets]
        with torch.no_grad():
            initial = [b.flat([p.detach() for p in b.params]) for b in buckets]
        self.layout = PSLayout(sum(x.numel() for x in initial), self.world_size, self.servers)
        if self.layout.is_server(self.rank):
            self.role = "server"
            k = self.layout.shard_of(self.rank)
            spans = [self.layout.slices(x.numel())[k] for x in initial]
            params = [torch.nn.Parameter(x[lo:hi].clone()) for x, (lo, hi) in zip(initial, spans)]
            self.server = PSServer(self.transport, self.layout, keys, params,
                                   [ex.compressor for ex in self._exchanges], self.server_update, rule=self.rule,
                                   backups=self.backups, downlink=self.downlink, downlink_scale=self.downlink_scale,
                                   **self.server_options())
            self.server_setup()
        else:
            self.worker_rank = self.rank
            self.worker = PSWorker(self.transport, self.layout, keys, initial, self.downlink)
            for ex in self._exchanges:
                ex.bind(self.worker)

    # -- the server ----------------------------------------------------------------------------------------
    def server_options(self) -> dict:
        """(server) The rest of `PSServer`'s options (quorum, grace, max_staleness, weight, note): none here."""
        return {}

    def server_setup(self) -> None:
        """(server) The state `server_update` needs: the worker's optimizer over this server's slices."""
        self.server_opt = clone_optimizer(self.optimizer, [p for p in self.server.params if p.numel()])

    def server_update(self, b: int, param: torch.nn.Parameter, mean: torch.Tensor, info: dict) -> None:
        """(server) Apply the aggregated gradient of bucket b's slice: the optimizer's step."""
        param.grad = mean
        step_subset(self.server_opt, [param])

    def pushes_at(self, step: int) -> int:
        """The pushes of each bucket a worker has made after `step` steps (the server's checkpoint cut)."""
        return step

    def serve(self, checkpoint=None) -> None:
        """Run the server; `checkpoint=(every, total, save)` joins the workers' checkpoints (PSServer.serve)."""
        if self.server is None:
            raise RuntimeError(f"rank {self.rank} is a worker, not a server")
        self.server.serve(checkpoint, self.pushes_at)

    # -- the worker ----------------------------------------------------------------------------------------
    def _worker_only(self) -> None:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} is a parameter server: call serve(), not step()")

    def step(self) -> None:
        """The base class's step, on a worker rank only."""
        self._worker_only()
        super().step()

    def close(self) -> None:
        if self.server is not None:
            self.scheduler.close()
            return
        super().close()                    # the algorithm's own end (drain, last average...)
        self.worker.done()

    def metrics(self) -> dict:
        part = self.server if self.server is not None else self.worker
        return {**super().metrics(), "architecture": "ps", "servers": self.servers,
                **(part.metrics() if part else {})}

    def state_dict(self) -> dict:
        """A consistent cut of this rank's end. A worker first waits for what its step waits for (a checkpoint is
        a quiescent point: every worker checkpoints at the same step, so the servers answer them all); a server is
        called at that cut (PSServer.serve). The worker's memory and compressor are the trainer's."""
        if self.server is not None:
            opt = self.server_opt
            return {"server": self.server.state_dict(), "optimizer": None if opt is None else opt.state_dict()}
        return {**super().state_dict(), "worker": self.worker.state_dict(),
                "ps_exchanges": [ex.state_dict() for ex in self._exchanges]}

    def load_state_dict(self, state: dict) -> None:
        if self.server is not None:
            self.server.load_state_dict(state["server"])
            if state.get("optimizer") is not None:
                self.server_opt.load_state_dict(state["optimizer"])
            return
        super().load_state_dict(state)
        self.worker.load_state_dict(state["worker"])
        for ex, saved in zip(self._exchanges, state["ps_exchanges"]):
            ex.load_state_dict(saved)


def checkpointable_on_ps(algorithm: str) -> bool:
    """Whether `algorithm`'s parameter-server runs can be checkpointed: the ones built on PSMixin."""
    ctor = registry.constructor(algorithm, {"architecture": "ps"})
    return isinstance(ctor, type) and issubclass(ctor, PSMixin)


@register("bsp", variant="ps")
class PSBSP(PSMixin, Algorithm):
    """`bsp` on the PS: a bucket's round is released when every worker's push of it is in (Tang et al. §III-A); the
    server applies the worker's optimizer to the mean (Tang et al. eq. 6) and answers everyone with the new slice.
    Each bucket is pushed as soon as backward hands it over; `step()` waits for every answer."""

    checks_finite = True      # each bucket is checked (Exchange._check_finite) before it is pushed
    exchanges_gradients = True
    cost = CostFamily("parameter_server")   # and ssp, asp, backup: built on it

    def __init__(self, architecture: str | None = None, servers: int = 1, downlink_compressor: str = "none",
                 downlink_params: dict | None = None):
        if architecture not in (None, "ps"):
            alt = _ALTERNATIVES.get(architecture, "valid: ps")
            raise UserError(f"{self.name or type(self).__name__.lower()} runs on the parameter server only "
                            f"(architecture=ps); {alt}")
        Algorithm.__init__(self, architecture)
        self._ps_init(servers, downlink_compressor, downlink_params)

    def setup(self) -> None:
        self.exchange = self.make_exchange()
        self.pending: dict[int, object] = {}

    def on_bucket(self, bucket) -> None:
        self.pending[bucket.index] = self.exchange.start(bucket.buffer, bucket.key)

    def step(self) -> None:
        self._worker_only()
        self.scheduler.flush()
        for bucket in self.scheduler.buckets:      # every answer into the model (the server ran the optimizer)
            copy_flat(bucket.params, self.pending.pop(bucket.index).wait())
        self.worker.commit()
        self.scheduler.end_step()

    def close(self) -> None:
        if self.worker is not None and self.scheduler.began:   # a backward without its step: answered, kept
            PSBSP.step(self)
        super().close()


def net_momentum(mu: float, tau: float) -> float:
    """The optimizer momentum that, with asynchrony's own at mean staleness τ, totals μ: max(0, 1 − (1 − μ)(τ + 1))
    (`StalenessAware`)."""
    return max(0.0, 1.0 - (1.0 - mu) * (tau + 1.0))


class StalenessAware:
    """(mixed in before PSBSP) The step sizes of the asynchronous family (ssp, asp), set from the staleness τ the
    server observes (updates of a bucket applied between the model a gradient was computed on and its own):
    - `scale="staleness"` (default): the rate γ/⟨τ⟩ for a gradient of (mean) staleness τ ≥ 1, γ at τ = 0
      (Zhang, Gupta, Lian, Liu 2016, "Staleness-aware async-SGD for distributed deep learning", §3: α/⟨τ⟩);
      `"mean"`: γ/n per gradient; `"full"`: γ.
    - `implicit_momentum=True` (default): asynchrony with staleness τ acts as momentum 1 − 1/(τ + 1) of its own
      (Mitliagkas, Zhang, Hadjis, Ré 2016, "Asynchrony begets momentum", Theorem 2: M queued workers give
      1 − 1/M); composed with the optimizer's μ_e the total is 1 − (1 − μ_e)/(τ + 1), so the server's SGD runs
      μ_e = max(0, 1 − (1 − μ)(τ̄ + 1)) to keep the total at the configured μ (τ̄: the mean staleness seen so
      far). Without it the stale gradients of `ssp`/`asp` at μ = 0.9 oscillated and diverged (docs/matrix.md's runs).
    """

    SCALES = ("staleness", "mean", "full")
    # the momentum stays with the server's optimizer, where it is net of asynchrony's own (below); handed to an
    # error-feedback memory it applied 0.9 on top of the stale gradients: ssp + topk ended at 0.15 (docs/matrix.md)
    exchanges_gradients = False

    def __init__(self, architecture: str | None = None, scale: str = "staleness", implicit_momentum: bool = True,
                 servers: int = 1, downlink_compressor: str = "none", downlink_params: dict | None = None):
        super().__init__(architecture, servers, downlink_compressor, downlink_params)
        if scale not in self.SCALES:
            raise UserError(f"{self.name} scale must be one of {', '.join(self.SCALES)}, got {scale!r}")
        if not isinstance(implicit_momentum, bool):
            raise UserError(f"{self.name} implicit_momentum must be true or false, got {implicit_momentum!r}")
        self.scale, self.implicit_momentum = scale, implicit_momentum

    def lr_factor(self, taus: list[int]) -> float:
        if self.scale == "mean":
            return 1.0 / self.layout.workers
        if self.scale == "full" or not taus:
            return 1.0
        return 1.0 / max(1.0, sum(taus) / len(taus))

    def server_setup(self) -> None:
        super().server_setup()
        group = self.server_opt.param_groups[0]
        self._lr, self._mu = group["lr"], group.get("momentum", 0.0)
        self._tau_sum = self._tau_count = 0

    def server_momentum(self) -> float:
        """The optimizer momentum the server runs now (see the class docstring)."""
        if not self.implicit_momentum or not self._tau_count:
            return self._mu
        return net_momentum(self._mu, self._tau_sum / self._tau_count)

    def server_update(self, b, param, mean, info) -> None:
        taus = info["taus"]
        self._tau_sum += sum(taus)
        self._tau_count += len(taus)
        group = self.server_opt.param_groups[0]
        group["lr"] = self._lr * self.lr_factor(taus)
        if "momentum" in group and self._mu:
            group["momentum"] = self.server_momentum()
            if not group["momentum"]:     # plain SGD now: a later momentum step starts a fresh buffer
                self.server_opt.state.get(param, {}).pop("momentum_buffer", None)
        super().server_update(b, param, mean, info)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.server is not None:
            state["tau"] = (self._tau_sum, self._tau_count)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.server is not None and "tau" in state:
            self._tau_sum, self._tau_count = state["tau"]
