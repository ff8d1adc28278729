"""PyTorch's own options, run as peers in the same matrix: what a user would pick instead of thinwire.

| peer | what runs |
| --- | --- |
| `ddp` | `DistributedDataParallel`, gradients all-reduced in fp32 (`allreduce_hook`, the same as DDP's built-in) |
| `ddp-fp16` | DDP + `fp16_compress_hook` (gradients cast to fp16 for the all-reduce) |
| `ddp-powersgd` | DDP + `powerSGD_hook` (rank 4, error feedback, warm start, compression from step 2). gloo crashes with it when DDP has several buckets, so `bucket_cap_mb` is set large enough for a single bucket |
| `ddp-postlocalsgd` | DDP + `post_localSGD_hook` + `PostLocalSGDOptimizer` with a `PeriodicModelAverager` (period 8, after `warmup` synchronous steps) |

Every peer trains the same workload with the same seed, the same data shards, batch size, learning rate and
momentum as thinwire's cells, and returns the same records as `thinwire.run.train.train_worker`, so the summary
has the same fields.

**Same network, accounted the same way.** Peers do not use thinwire's Transport, so inside the peer's worker
`torch.distributed.all_reduce` (which all four of PyTorch's hooks and its model averager call) is wrapped for the
run: the real all-reduce runs on the gloo group, then completes no earlier than the emulated link delivers it —
the same α-β ring all-reduce cost and the same per-rank link queue (`LinkClock`) the Transport charges. Bytes are
counted from each all-reduced tensor (its elements × element size, i.e. the model size under the known algorithm:
fp32, fp16, PowerSGD's P and Q factors plus its uncompressed vectors, the averaged parameters) with the ring
all-reduce's bytes sent per worker, as the Transport counts its own. Under `--netem` the link is the real (shaped)
network and the wrapper only counts.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ..comm import LinkClock, default_network
from ..comm.context import default_seed
from ..net import ring_allreduce
from . import workloads

_now = time.perf_counter

PEER_PARAMS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "ddp-fp16": (),
    "ddp-powersgd": ("rank",),
    "ddp-postlocalsgd": ("period", "warmup"),
}


class _Counter:
    """Wraps `torch.distributed.all_reduce` for one peer run: counted and delivered by the emulated link."""

    def __init__(self, rank: int):
        self.link = default_network()
        self.clock = LinkClock(self.link, rank, default_seed())
        self.bytes_sent = 0.0
        self.emulated_s = 0.0
        self.wait_s = 0.0
        self.ops = 0
        self._orig = dist.all_reduce
        self._lock = threading.Lock()
        self._sleepers = 0           # buckets' callbacks may sleep concurrently: count their union once
        self._since = 0.0

    def __enter__(self):
        dist.all_reduce = self.all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = dist.get_world_size(group)
        cost = ring_allreduce(self.link.handshaking(), n, tensor.numel() * tensor.element_size())  # as the Transport
        self.bytes_sent += cost.sent
        self.ops += 1
        work = self._orig(tensor, op=op, group=group, async_op=True)
        if not async_op:
            work.wait()
            self.deliver(cost)
            return None
        return _Work(self, work, cost)

    def deliver(self, cost) -> None:
        t = _now()
        deadline = self.clock.schedule(t, cost)
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
        return {"ops": self.ops, "bytes_sent": self.bytes_sent, "emulated_s": self.emulated_s, "wait_s": self.wait_s}


class _Work:
    """The real work, completing (wait, future) only once the emulated link delivered it."""

    def __init__(self, counter: _Counter, work, cost):
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


def _build(cfg, wl, model):
    """(DDP model, optimizer, description of the configuration) for the peer `cfg.algorithm`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    name, p = cfg.algorithm, cfg.params
    model_mb = sum(t.numel() * t.element_size() for t in model.parameters()) / 2 ** 20
    if name == "ddp-powersgd":
        bucket = max(25.0, 2 * model_mb + 1)  # one bucket: gloo fails with several (FACTS.md)
        ddp = DDP(model, bucket_cap_mb=bucket)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(p.get("rank", 4)),
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                   random_seed=cfg.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        desc = f"powerSGD_hook rank {state.matrix_approximation_rank}, one bucket (bucket_cap_mb={bucket:.0f})"
    else:
        ddp = DDP(model)
        if name == "ddp":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            desc = "allreduce_hook (fp32)"
        elif name == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            desc = "fp16_compress_hook"
        elif name == "ddp-postlocalsgd":
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                      post_localSGD_hook)
            warmup = int(p.get("warmup", 8))
            state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                                      post_local_gradient_allreduce=False)
            ddp.register_comm_hook(state, post_localSGD_hook)
            desc = f"post_localSGD_hook, period {int(p.get('period', 8))}, warm-up {warmup} steps"
        else:
            raise ValueError(f"unknown peer {name!r}")
    opt = wl.make_optimizer(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if name == "ddp-postlocalsgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        averager = PeriodicModelAverager(period=int(p.get("period", 8)), warmup_steps=int(p.get("warmup", 8)))
        opt = PostLocalSGDOptimizer(optim=opt, averager=averager)
    return ddp, opt, desc


def peer_worker(rank: int, world_size: int, cfg) -> dict:
    """One PyTorch peer run in a worker (cfg: a `TrainConfig` whose `algorithm` is a peer name); returns the
    records `train_worker` returns."""
    wl = workloads.get(cfg.workload)
    torch.manual_seed(cfg.seed)
    model = wl.model(cfg.seed)
    x, y = wl.shard(rank, world_size)
    loader = workloads.ShardLoader(x, y, cfg.batch_size or wl.batch_size, seed=cfg.seed, rank=rank)
    total = cfg.total_steps(wl)
    eval_every = cfg.eval_every or max(1, wl.steps_per_epoch(world_size, cfg.batch_size) // 2)
    with _Counter(rank) as counter:
        ddp, opt, desc = _build(cfg, wl, model)
        steps, evals, clock = [], [], 0.0
        evals.append({"step": 0, "t": 0.0, "value": wl.evaluate(model)})
        before = counter.totals()
        for step in range(1, total + 1):
            t0 = _now()
            xb, yb = loader.next()
            loss = wl.loss(ddp(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            dt = _now() - t0
            clock += dt
            now = counter.totals()
            steps.append({"step": step, "loss": loss.item(), "t": clock, "step_s": dt,
                          "bytes_sent": now["bytes_sent"] - before["bytes_sent"],
                          "emulated_s": now["emulated_s"] - before["emulated_s"],
                          "wait_s": now["wait_s"] - before["wait_s"]})
            before = now
            if step % eval_every == 0 or step == total:
                evals.append({"step": step, "t": clock, "value": wl.evaluate(model)})
        totals = counter.totals()
    del ddp
    return {"rank": rank, "role": "worker", "steps": steps, "evals": evals, "final": evals[-1]["value"],
            "meter": {"total": totals}, "metrics": {"peer": desc}, "trace": [],
            "num_params": sum(p.numel() for p in model.parameters()),
            "dtype_bytes": next(model.parameters()).element_size(), "train_s": clock}
