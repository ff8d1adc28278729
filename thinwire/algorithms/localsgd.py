"""`localsgd`: local SGD / model averaging / PR-SGD (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient
Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §III-D).

Every worker takes local optimizer steps; every H steps the models are averaged:
    x_{i,t+1} = x_{i,t} - γ G_{i,t}(x_{i,t})                       if t+1 ∉ I_T
    x_{i,t+1} = (1/n) Σ_j (x_{j,t} - γ G_{j,t}(x_{j,t}))           if t+1 ∈ I_T = {H, 2H, ...}
(Tang et al.'s eq. 9 as printed averages gradients and never the models; this is the corrected form of Stich 2019,
"Local SGD Converges Fast and Communicates Little", arXiv 1805.09767.) The average travels through an `Exchange` as
the model *delta* since the last average, x = x_anchor + mean_j(C(x_j - x_anchor)), so a compressor applies to the
deltas and a memory gives error feedback on them: local SGD with compressed model deltas (Qsparse-local-SGD, Basu et
al. 2019, arXiv 1906.02367).

Momentum local SGD (Yu, Jin, Yang 2019, "On the Linear Speedup Analysis of Communication Efficient
Momentum SGD for Distributed Non-Convex Optimization", arXiv 1905.03817): with an optimizer that has momentum, each
worker keeps its own buffer u_i ← βu_i + G_i, x_i ← x_i - γu_i (the default); `average_momentum=true` also averages
the momentum buffers at every synchronisation (the paper's variant with global momentum; costs a second exchange).
With H = 1 and no compressor, local SGD is exactly synchronous SGD (bsp), momentum included.
`close()` averages the models once more if steps were taken since the last average: every worker ends with
the same model.

On the step that ends a period each bucket's local optimizer step is taken as soon as backward hands the bucket
over (its gradients are final and no later backward work reads its parameters), and its delta starts averaging
at once, overlapped with the rest of backward.
"""
from __future__ import annotations

import torch

from ..comm.elastic import broadcast_state
from ..tensors import copy_each, copy_flat
from ._registry import register
from .base import Periodic, int_at_least
from .bsp import BSP
from .cost import CostFamily
from .ps_sync import PSMixin


@register("localsgd")
class LocalSGD(Periodic, BSP):
    """Local SGD: H local steps, then average the models (the deltas go through the compressor)."""

    schedules = ("none", "wfbp", "fusion", "mgwfbp")
    checks_finite = False
    exchanges_gradients = False   # model deltas
    keeps_local_work = True       # a survivor's local steps go into the next average
    lands_in_backward = False     # a sync's local step is taken in backward (on_bucket)
    cost = CostFamily("periodic", tunable={"period": (1, 2, 4, 8, 16, 32, 64, 128)})

    def __init__(self, period: int = 4, average_momentum: bool = False, architecture: str | None = None):
        super().__init__(architecture)
        self._period_init(period, "; H = 1 is synchronous SGD (bsp)")
        self.average_momentum = bool(average_momentum)

    def setup(self):
        super().setup()
        self.anchor = [p.detach().clone() for p in self.params]   # the last averaged model
        self._momentum_exchange = self.make_exchange("none", "none") if self.average_momentum else None
        self._momenta: dict[int, object] = {}
        self._averaged = False    # the last step averaged the models (a synchronization boundary)

    # -- local steps and averaging ---------------------------------------------------------------------------
    def on_bucket(self, bucket):
        if not self.syncing():
            return
        # the bucket's local step now (its parameters' gradients are final), then its delta x - x_anchor
        # starts averaging while backward goes on with the earlier layers
        self.optimizer_step(bucket.params)
        self._start_average(bucket)
        if self._momentum_exchange is not None:
            bufs = [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in bucket.params]
            if all(b is not None for b in bufs):
                self._momenta[bucket.index] = (bufs, self._momentum_exchange.start(bucket.flat(bufs),
                                                                                  key=bucket.key))

    def recover(self):
        """A worker was lost. Where the survivors keep their own models (the loss met at the same average), they
        take rank 0's anchor where theirs differ (an average completed on some survivors only leaves them apart)
        and their work since it goes into the next average; else they restart from the new rank 0's model."""
        super().recover()
        self._momenta.clear()
        if self.ctx.failures[-1]["kept"]:
            if not self.ctx.failures[-1]["alike"]:
                copy_each(self.anchor, broadcast_state(self.transport, {"anchor": self.anchor}, 0)["anchor"])
        else:
            copy_each(self.anchor, self.params)
        self.local_steps = 0

    def replicated(self):
        return self.anchor

    def join_boundary(self, step):
        """A step that averaged the models (the anchor is every member's model)."""
        return self._averaged

    def join_after(self, step):
        return step + self.period

    def join_next(self, step):
        """The step that ends this period (its average is issued during it)."""
        return step + self.period - self.local_steps

    def newcomer_state(self):
        return {"anchor": self.anchor, "syncs": self.syncs}

    def take_newcomer_state(self, state):
        copy_each(self.anchor, state["anchor"])
        copy_each(self.params, state["anchor"])
        self.local_steps, self.syncs = 0, int(state["syncs"])

    def _start_average(self, bucket) -> None:
        with torch.no_grad():
            delta = bucket.flat([p - self.anchor[i] for p, i in zip(bucket.params, bucket.members)])
        self.pending[bucket.index] = self.exchange.start(delta, key=bucket.key)

    def average(self) -> None:
        """x ← x_anchor + mean_j C(x_j - x_anchor), bucket by bucket; the new anchor is the averaged model."""
        with self.tracer.span("average models", "communicate"), torch.no_grad():
            for bucket in self.scheduler.buckets:
                result = self.pending.pop(bucket.index).wait()
                for p, i, m in zip(bucket.params, bucket.members, bucket.split(result)):
                    self._merge(self.anchor[i], m)
                    p.copy_(self.anchor[i])
                if bucket.index in self._momenta:
                    bufs, fut = self._momenta.pop(bucket.index)
                    copy_flat(bufs, fut.wait())
        self.local_steps = 0
        self.syncs += 1
        self._averaged = True

    def _merge(self, anchor: torch.Tensor, mean: torch.Tensor) -> None:
        anchor.add_(mean)           # x_anchor + mean_j C(x_j - x_anchor)

    def communicates(self):
        return self.syncing()

    def step(self):
        self._averaged = False
        if self.syncing():
            self.scheduler.flush()
            self.average()          # the local step of every bucket was taken when backward handed it over
            self.scheduler.end_step()
        else:
            self.local_steps += 1
            self.local_update()

    def close(self):
        if self.local_steps:        # steps since the last average: one more average, no further local step
            for bucket in self.scheduler.buckets:
                self._start_average(bucket)
            self.average()
        self.scheduler.close()

    def state_dict(self):
        return {**super().state_dict(), "anchor": [a.clone() for a in self.anchor]}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.anchor = [a.clone() for a in state["anchor"]]


@register("postlocalsgd")
class PostLocalSGD(LocalSGD):
    """Post-local SGD (Lin, Stich, Patel, Jaggi 2020, "Don't Use Large Mini-Batches, Use Local SGD",
    arXiv 1808.07217): synchronous SGD until step `switch`, then local SGD."""

    def __init__(self, switch: int = 100, period: int = 4, average_momentum: bool = False,
                 architecture: str | None = None):
        super().__init__(period, average_momentum, architecture)
        self.switch = int_at_least(f"{self.name} switch", switch, 0)
        self.steps = 0

    def synchronous(self) -> bool:
        return self.steps < self.switch

    @property
    def keeps_local_work(self) -> bool:
        """In phase 1 every step averages gradients (bsp's): a survivor's model is rank 0's to take."""
        return not self.synchronous()

    def join_next(self, step):
        return None if self.steps + 1 < self.switch else super().join_next(step)

    def communicates(self):
        return self.synchronous() or self.syncing()

    def on_bucket(self, bucket):
        if self.synchronous():      # phase 1: mini-batch SGD on the mean gradient (Tang et al. eq. 6)
            self.pending[bucket.index] = self.grad_exchange.start(bucket.buffer, bucket.key, shapes=bucket.shapes)
        else:
            super().on_bucket(bucket)

    def setup(self):
        super().setup()
        self.grad_exchange = self.make_exchange("none", "none")

    def step(self):
        if self.synchronous():
            BSP.step(self)          # phase 1: bsp's step, and the anchor follows the model
            copy_each(self.anchor, self.params)
        else:
            super().step()
        self.steps += 1

    def metrics(self):
        return {**super().metrics(), "switch": self.switch}

    def state_dict(self):
        return {**super().state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.steps = state["steps"]


@register("localsgd", variant="ps")
class PSLocalSGD(PSMixin, LocalSGD):
    """Local SGD on the parameter server (Tang et al. Table II, PS / Local SGD): H local steps on every worker, then
    each worker pushes its model delta x_i - x (bucket by bucket, as backward hands the bucket over, through the
    compressor and memory) and the server averages them, x <- x + (1/n) Σ_i C(x_i - x) (Tang et al.'s eq. 9,
    corrected as above), and answers x, which every worker continues from. Momentum stays local."""

    keeps_local_work = False

    def join_next(self, step):
        return None

    def __init__(self, period: int = 4, architecture: str | None = None, servers: int = 1,
                 downlink_compressor: str = "none", downlink_params: dict | None = None):
        LocalSGD.__init__(self, period, False, architecture)
        self._ps_init(servers, downlink_compressor, downlink_params)

    def server_setup(self) -> None:
        """(server) Averaging needs no optimizer."""

    def server_update(self, b, param, mean, info) -> None:
        with torch.no_grad():
            param.add_(mean)          # x <- x + mean_i C(x_i - x)

    def pushes_at(self, step: int) -> int:
        return step // self.period

    def _merge(self, anchor: torch.Tensor, answer: torch.Tensor) -> None:
        anchor.copy_(answer)        # every worker continues from the server's average (its answer)

    def average(self) -> None:
        super().average()
        self.worker.commit()
