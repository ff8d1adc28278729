"""PyTorch's own options as peers: each trains in the one loop (`thinwire.run.loop`) with thinwire's workload, seed,
shards, batch, optimizer settings, evaluations and race rules (`thinwire train --algorithm ddp` runs one alone).

| peer | what runs |
| --- | --- |
| `ddp` | `DistributedDataParallel`, gradients all-reduced in fp32 (`allreduce_hook`, the same as DDP's built-in) |
| `ddp-fp16` | DDP + `fp16_compress_hook` (gradients cast to fp16 for the all-reduce) |
| `ddp-powersgd` | DDP + `powerSGD_hook` (rank 4, error feedback, warm start, compression from step 2). gloo crashes with it when DDP has several buckets, so `bucket_cap_mb` is set large enough for a single bucket |
| `ddp-postlocalsgd` | DDP + `post_localSGD_hook` + `PostLocalSGDOptimizer` with a `PeriodicModelAverager` (`period` 8, after `warmup` 8 synchronous steps) |
| `ddp-hierarchical` | the same with PyTorch's `HierarchicalModelAverager`: groups of `group` workers average every `local_period` steps, all workers every `period` |
"""
from __future__ import annotations

from collections import OrderedDict

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import UserError
from ...net import parse_network
from ...registry import Param, at_least
from ...run.stepper import make_optimizer, model_device
from .counter import AllReduceCounter, PeerStepper
from .registry import Peer, register


def _hierarchy(params: dict, workers: int) -> tuple[int, int, int]:
    period = int(params.get("period", 8))
    local, group = params.get("local_period"), params.get("group")
    return period, int(max(1, period // 4) if local is None else local), \
        int(max(1, workers // 2) if group is None else group)


def _build(cfg, wl, model, workers: int):
    """(DDP model, optimizer, description of the configuration) for the DDP peer `cfg.algorithm`."""
    name, p = cfg.algorithm, cfg.params
    opt = make_optimizer(cfg, wl, model)   # DDP's parameters are the model's
    dev = next(model.parameters()).device
    on = {"device_ids": [dev]} if dev.type == "cuda" else {}   # a model on a GPU: DDP on that one device
    hooks = {"ddp": (default_hooks.allreduce_hook, "allreduce_hook (fp32)"),
             "ddp-fp16": (default_hooks.fp16_compress_hook, "fp16_compress_hook")}
    if name == "ddp-powersgd":
        model_mb = sum(t.numel() * t.element_size() for t in model.parameters()) / 2 ** 20
        bucket = max(25.0, 2 * model_mb + 1)  # one bucket: gloo fails with several (above)
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
    from torch.distributed.optim import PostLocalSGDOptimizer     # (lazy: 1.7 s to import)
    warmup = int(p.get("warmup", 8))
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    if name == "ddp-postlocalsgd":
        period = int(p.get("period", 8))
        averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
        desc = f"post_localSGD_hook + PeriodicModelAverager, period {period}, warm-up {warmup} steps"
    else:
        period, local, group = _hierarchy(p, workers)
        averager = HierarchicalModelAverager(OrderedDict([(local, group), (period, workers)]), warmup_steps=warmup)
        desc = (f"post_localSGD_hook + HierarchicalModelAverager: groups of {group} every {local} steps, "
                f"all {workers} every {period}, warm-up {warmup} steps")
    return ddp, PostLocalSGDOptimizer(optim=opt, averager=averager), desc


class DDPStepper(PeerStepper):
    """A PyTorch DDP peer: DDP's comm hook all-reduces during backward; `step()` is the optimizer's step (and,
    for post-local SGD, its model averager's)."""

    def __init__(self, cfg, wl, rank: int, world_size: int):
        self.algorithm, self.checkpoints = cfg.algorithm, cfg.peer.checkpoints
        self.counter = AllReduceCounter(rank, parse_network(cfg.network))
        self.counter.install()
        module = wl.model(cfg.seed).to(model_device(cfg))
        ddp, self.optimizer, self.desc = _build(cfg, wl, module, world_size)
        super().__init__(ddp, module, rank)
        self.start_counting()

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
        if not self.checkpoints:
            raise UserError(f"{self.algorithm} keeps state in its hook or averager that a checkpoint would not "
                            f"hold; of the peers, ddp writes checkpoints")

    def shutdown(self) -> None:
        self.counter.uninstall()
        self.model = None  # DDP's reducer goes with it


def _check_hierarchy(params: dict, workers: int) -> None:
    period, local, group = _hierarchy(params, workers)
    if not (local < period and period % local == 0):
        raise UserError(f"ddp-hierarchical: local_period ({local}) must divide period ({period}) and be smaller")
    if workers % group or group >= workers:
        raise UserError(f"ddp-hierarchical: group ({group}) must divide the {workers} workers and be smaller "
                        f"(HierarchicalModelAverager's subgroups)")


PERIOD, WARMUP = Param("period", (int,), 8, at_least(1)), Param("warmup", (int,), 8, at_least(0))
AVERAGING = {"period": None}     # the planner sees model averaging every `period` steps (thinwire's localsgd)
register(Peer("ddp", DDPStepper, ("bsp", "none"), title="PyTorch DDP", checkpoints=True))
register(Peer("ddp-fp16", DDPStepper, ("bsp", "fp16")))
register(Peer("ddp-powersgd", DDPStepper, ("bsp", "powersgd"), {"rank": Param("rank", (int,), 4, at_least(1))},
              plan_params={"rank": 4}))
register(Peer("ddp-postlocalsgd", DDPStepper, ("localsgd", "none"), {"period": PERIOD, "warmup": WARMUP},
              plan_params=AVERAGING))
# local_period: period / 4, group: half the workers (None: derived in `_hierarchy`)
register(Peer("ddp-hierarchical", DDPStepper, ("localsgd", "none"),
              {"period": PERIOD, "local_period": Param("local_period", (int, type(None)), None, at_least(1)),
               "group": Param("group", (int, type(None)), None, at_least(1)), "warmup": WARMUP},
              plan_params=AVERAGING, checks=_check_hierarchy))
