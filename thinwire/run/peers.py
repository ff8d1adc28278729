"""PyTorch's own options (and torchft's DiLoCo), run as peers in the same matrix: what a user would pick instead
of thinwire. Each is a *stepper* of the one training loop (`thinwire.run.loop`), so a peer trains the same
workload with the same seed, data shards, batch size, optimizer settings, evaluations, race rules and records as
thinwire's cells, and `thinwire train --algorithm ddp` runs one on its own.

| peer | what runs |
| --- | --- |
| `ddp` | `DistributedDataParallel`, gradients all-reduced in fp32 (`allreduce_hook`, the same as DDP's built-in) |
| `ddp-fp16` | DDP + `fp16_compress_hook` (gradients cast to fp16 for the all-reduce) |
| `ddp-powersgd` | DDP + `powerSGD_hook` (rank 4, error feedback, warm start, compression from step 2). gloo crashes with it when DDP has several buckets, so `bucket_cap_mb` is set large enough for a single bucket |
| `ddp-postlocalsgd` | DDP + `post_localSGD_hook` + `PostLocalSGDOptimizer` with a `PeriodicModelAverager` (`period` 8, after `warmup` 8 synchronous steps) |
| `ddp-hierarchical` | the same with PyTorch's `HierarchicalModelAverager`: groups of `group` workers average every `local_period` steps, all workers every `period` |
| `torchft-diloco` | torchft's `DiLoCo` (`thinwire.run.torchft_peer`; optional extra `thinwire[peers]`) |

**Same network, accounted the same way.** Peers do not use thinwire's Transport, so inside the peer's worker
`torch.distributed.all_reduce` (which all of PyTorch's hooks and its model averagers call) is wrapped for the
run: the real all-reduce runs on the gloo group, then completes no earlier than the emulated link delivers it —
the same α-β ring all-reduce cost and the same per-rank link queue (`LinkClock`) the Transport charges. Bytes are
counted from each all-reduced tensor (its elements × element size, i.e. the model size under the known algorithm:
fp32, fp16, PowerSGD's P and Q factors plus its uncompressed vectors, the averaged parameters) with the ring
all-reduce's bytes sent per worker, as the Transport counts its own. Under `--netem` the link is the real (shaped)
network and the wrapper only counts. torchft's process group is wrapped the same way (`torchft_peer.py`).
"""
from __future__ import annotations

import importlib.util
import threading
import time

import torch
import torch.distributed as dist

from ..comm import LinkClock
from ..comm.context import default_seed
from ..errors import UserError
from ..registry import Param, at_least, between, check_params
from ..net import Islands, parse_network, ring_allreduce
from ..trainer import nonfinite_stop
from .stepper import Stepper, make_optimizer, model_device

_now = time.perf_counter

def _int(name: str, default: int, low: int = 1) -> Param:
    return Param(name, (int,), default, at_least(low))


def _flag(name: str, default: bool) -> Param:
    return Param(name, (bool,), default)


def _peer(*params: Param) -> dict[str, Param]:
    return {p.name: p for p in params}


# each peer's parameters, declared for the registry's one validation path (types, ranges; `check_params`)
_PERIOD, _WARMUP = _int("period", 8), _int("warmup", 8, 0)
PEER_PARAMS: dict[str, dict[str, Param]] = {
    "ddp": {},
    "ddp-fp16": {},
    "ddp-powersgd": _peer(_int("rank", 4)),
    "ddp-postlocalsgd": _peer(_PERIOD, _WARMUP),
    # local_period: period / 4, group: half the workers (None: derived in `_hierarchy`)
    "ddp-hierarchical": _peer(_PERIOD, Param("local_period", (int, type(None)), None, at_least(1)),
                              Param("group", (int, type(None)), None, at_least(1)), _WARMUP),
    "torchft-diloco": _peer(_PERIOD, Param("outer_lr", (float,), 0.7, between(0, 10, low_open=True)),
                            Param("outer_momentum", (float,), 0.9, between(0, 1, high_open=True)),
                            _flag("nesterov", True), _int("fragments", 1), _int("fragment_sync_delay", 0, 0),
                            Param("fragment_update_alpha", (float,), 0.0, between(0, 1)), _flag("quantize", False)),
}
# what the planner and the defaults see each peer as: (thinwire algorithm, compressor)
PEER_AS = {"ddp": ("bsp", "none"), "ddp-fp16": ("bsp", "fp16"), "ddp-powersgd": ("bsp", "powersgd"),
           "ddp-postlocalsgd": ("localsgd", "none"), "ddp-hierarchical": ("localsgd", "none"),
           "torchft-diloco": ("localsgd", "none")}


def optional_missing(name: str) -> str | None:
    """Why peer `name` cannot run here (its optional extra is not installed), or None."""
    if name == "torchft-diloco":
        return missing_torchft()
    return None


def check_peer(name: str, params: dict, workers: int) -> dict:
    """`params` converted to the types the peer declares (`PEER_PARAMS`, the registry's rules: CLI strings like
    every other parameter's); a UserError (one line) for parameters the peer does not take or cannot run with."""
    bad = [k for k in params if k not in PEER_PARAMS[name]]
    if bad:
        takes = ", ".join(PEER_PARAMS[name]) or "no parameters"
        raise UserError(f"peer {name!r} takes {takes}, not {', '.join(bad)}")
    why = optional_missing(name)
    if why:
        raise UserError(why)
    params = check_params(f"peer {name!r}", PEER_PARAMS[name], params)
    if name == "ddp-hierarchical":
        period, local, group = _hierarchy(params, workers)
        if not (local < period and period % local == 0):
            raise UserError(f"ddp-hierarchical: local_period ({local}) must divide period ({period}) and be smaller")
        if workers % group or group >= workers:
            raise UserError(f"ddp-hierarchical: group ({group}) must divide the {workers} workers and be smaller "
                            f"(HierarchicalModelAverager's subgroups)")
    if name == "torchft-diloco":
        check_torchft(params)
    return params


# -- torchft's DiLoCo (`torchft_peer.py`): its checks here, where they run before any worker starts --------
EXTRA = "pip install 'thinwire[peers]' (torch==2.13.0 torchft==0.2.0)"


def missing_torchft() -> str | None:
    """Why torchft's DiLoCo cannot run here, or None."""
    if importlib.util.find_spec("torchft") is None:
        return f"torchft-diloco needs the optional extra: {EXTRA}"
    return None


def check_torchft(params: dict) -> None:
    """Combinations torchft's DiLoCo refuses (its own checks raise deep inside a worker), on parameters already
    converted and range-checked (`check_peer`): a one-line UserError."""
    period = params.get("period", 8)
    fragments = params.get("fragments", 1)
    delay = params.get("fragment_sync_delay", 0)
    if period % fragments:
        raise UserError(f"torchft-diloco: fragments ({fragments}) must divide period ({period})")
    if delay >= period // fragments:
        raise UserError(f"torchft-diloco: fragment_sync_delay ({delay}) must be below period / fragments "
                        f"({period // fragments})")


def _hierarchy(params: dict, workers: int) -> tuple[int, int, int]:
    period = int(params.get("period", 8))
    local, group = params.get("local_period"), params.get("group")
    return period, int(max(1, period // 4) if local is None else local), \
        int(max(1, workers // 2) if group is None else group)


class _Counter:
    """Wraps `torch.distributed.all_reduce` for one peer run: counted and delivered by the emulated link. On a
    two-tier network (`Islands`) an all-reduce is charged on its group's path (inside one island, or the thin link)
    on that link's queue, and the bytes this rank sends over the thin link (its ring neighbour in another island)
    are counted apart, as the Transport does."""

    def __init__(self, rank: int, link):
        self.link, self.rank = link, rank
        self.islands = link if isinstance(link, Islands) else None
        self.clocks: dict = {}
        self.bytes_sent = self.emulated_s = self.wait_s = self.bytes_across = 0.0
        self.ops = 0
        self._orig = dist.all_reduce
        self._lock = threading.Lock()
        self._sleepers = 0           # buckets' callbacks may sleep concurrently: count their union once
        self._since = 0.0

    def install(self) -> None:
        dist.all_reduce = self.all_reduce

    def uninstall(self) -> None:
        dist.all_reduce = self._orig

    def charge(self, n: int, nbytes: int, members=None, me: int | None = None):
        """Count one ring all-reduce of `nbytes` over `n` ranks (as the Transport does): its (cost, link), to
        deliver. `members`: the group's global ranks in ring order and `me` this rank's index there (default: the
        first n ranks, this rank's own)."""
        path = self.link
        members = list(range(n)) if members is None else members
        me = self.rank if me is None else me
        if self.islands is not None:
            path = self.islands.path(members)
        cost = ring_allreduce(path.handshaking(), n, nbytes)
        self.bytes_sent += cost.sent
        if self.islands is not None and self.islands.ring_crossing(members, me):
            self.bytes_across += cost.sent
        self.ops += 1
        return cost, path

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        members = dist.get_process_group_ranks(group) if group is not None else None
        me = members.index(dist.get_rank()) if members is not None else None
        cost = self.charge(dist.get_world_size(group), tensor.numel() * tensor.element_size(), members, me)
        work = self._orig(tensor, op=op, group=group, async_op=True)
        if not async_op:
            work.wait()
            self.deliver(cost)
            return None
        return _Work(self, work, cost)

    def clock(self, link) -> LinkClock:
        """This rank's queue on `link` (one per link of a two-tier network)."""
        if link.name not in self.clocks:
            self.clocks[link.name] = LinkClock(link, self.rank, default_seed())
        return self.clocks[link.name]

    def deliver(self, charged) -> None:
        cost, link = charged
        t = _now()
        deadline = self.clock(link).schedule(t, cost)
        if deadline <= t:
            return
        with self._lock:
            self.emulated_s += deadline - t
            if self._sleepers == 0:
                self._since = t
            self._sleepers += 1
        time.sleep(deadline - t)
        with self._lock:
            self._sleepers -= 1
            if self._sleepers == 0:
                self.wait_s += _now() - self._since  # time spent waiting on the link, overlaps counted once

    def totals(self) -> dict:
        return {"ops": self.ops, "bytes_sent": self.bytes_sent, "emulated_s": self.emulated_s, "wait_s": self.wait_s,
                "bytes_across": self.bytes_across}


class _Work(dist._Work):
    """The real work, completing (wait, future) only once the emulated link delivered it (a `dist._Work`, as
    torchft's process group must return)."""

    def __init__(self, counter: _Counter, work, cost):
        super().__init__()
        self.counter, self.work, self.cost = counter, work, cost
        self._delivered = False

    def _deliver_once(self):
        if not self._delivered:
            self._delivered = True
            self.counter.deliver(self.cost)

    def wait(self, timeout=None):
        self.work.wait()
        self._deliver_once()
        return True

    def is_completed(self):
        return self._delivered

    def get_future(self):
        def done(fut):
            self._deliver_once()
            return fut.value()
        return self.work.get_future().then(done)


def _build(cfg, wl, model, workers: int):
    """(DDP model, optimizer, description of the configuration) for the DDP peer `cfg.algorithm`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    name, p = cfg.algorithm, cfg.params
    opt = make_optimizer(cfg, wl, model)   # DDP's parameters are the model's
    dev = next(model.parameters()).device
    on = {"device_ids": [dev]} if dev.type == "cuda" else {}   # a model on a GPU: DDP on that one device
    hooks = {"ddp": (default_hooks.allreduce_hook, "allreduce_hook (fp32)"),
             "ddp-fp16": (default_hooks.fp16_compress_hook, "fp16_compress_hook")}
    if name == "ddp-powersgd":
        model_mb = sum(t.numel() * t.element_size() for t in model.parameters()) / 2 ** 20
        bucket = max(25.0, 2 * model_mb + 1)  # one bucket: gloo fails with several (FACTS.md)
        ddp = DDP(model, bucket_cap_mb=bucket, **on)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(p.get("rank", 4)),
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                   random_seed=cfg.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        desc = f"powerSGD_hook rank {state.matrix_approximation_rank}, one bucket (bucket_cap_mb={bucket:.0f})"
        return ddp, opt, desc
    ddp = DDP(model, **on)
    if name in hooks:
        hook, desc = hooks[name]
        ddp.register_comm_hook(None, hook)
        return ddp, opt, desc
    # ddp-postlocalsgd and ddp-hierarchical: post-local SGD, then a model averager
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.optim import PostLocalSGDOptimizer
    warmup = int(p.get("warmup", 8))
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    if name == "ddp-postlocalsgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        period = int(p.get("period", 8))
        averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
        desc = f"post_localSGD_hook + PeriodicModelAverager, period {period}, warm-up {warmup} steps"
    else:
        from collections import OrderedDict

        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import \
            HierarchicalModelAverager
        period, local, group = _hierarchy(p, workers)
        averager = HierarchicalModelAverager(OrderedDict([(local, group), (period, workers)]), warmup_steps=warmup)
        desc = (f"post_localSGD_hook + HierarchicalModelAverager: groups of {group} every {local} steps, "
                f"all {workers} every {period}, warm-up {warmup} steps")
    return ddp, PostLocalSGDOptimizer(optim=opt, averager=averager), desc


class PeerStepper(Stepper):
    """What the peers share: `step()` is `self.optimizer`'s step after the NaN/Inf check (a peer applies no
    non-finite gradient), and its traffic is what `self.counter` (a `_Counter`) saw since the last one.
    A subclass sets `counter`, `optimizer`, `desc` and, last in its `__init__`, calls `_start_counting()`."""

    def _start_counting(self) -> None:
        self.steps, self._before = 0, self.counter.totals()

    def step(self) -> dict:
        self.steps += 1
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):  # one host read
            raise nonfinite_stop(self.worker_rank, self.steps)
        self.optimizer.step()
        now = self.counter.totals()
        out = {k: now[k] - self._before[k] for k in ("bytes_sent", "emulated_s", "wait_s")}
        self._before = now
        return out

    def counted(self, before) -> tuple[dict, dict]:
        """The peer's traffic over the whole run: on resume (`ddp`), what the checkpoint counted plus this
        segment's."""
        total = self.counter.totals()
        if before:
            old = before["meter"]["total"]
            total = {k: v + old.get(k, 0) for k, v in total.items()}
        return {"total": total, "by_kind": {}}, {"peer": self.desc}


class DDPStepper(PeerStepper):
    """A PyTorch DDP peer: DDP's comm hook all-reduces during backward; `step()` is the optimizer's step (and,
    for post-local SGD, its model averager's)."""

    def __init__(self, cfg, wl, rank: int, world_size: int):
        self.algorithm = cfg.algorithm
        self.counter = _Counter(rank, parse_network(cfg.network))
        self.counter.install()
        module = wl.model(cfg.seed).to(model_device(cfg))
        ddp, self.optimizer, self.desc = _build(cfg, wl, module, world_size)
        super().__init__(ddp, module, rank)
        self._start_counting()

    def state_dict(self) -> dict:
        """Plain `ddp` checkpoints (model and optimizer; DDP's buffers are the module's): torchrun's restart from
        the last checkpoint, the stop-the-world recovery `thinwire bench churn` measures."""
        self._stateless()
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self._stateless()
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def _stateless(self) -> None:
        if self.algorithm != "ddp":
            raise UserError(f"{self.algorithm} keeps state in its hook or averager that a checkpoint would not "
                            f"hold; of the peers, ddp writes checkpoints")

    def shutdown(self) -> None:
        self.counter.uninstall()
        self.model = None  # DDP's reducer goes with it
