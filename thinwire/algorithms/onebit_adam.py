"""`onebit-adam`: 1-bit Adam (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He 2021, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed", arXiv 2102.02888, Algorithm 1), on the user's own
Adam/AdamW (`adam_state`).

Error feedback on the gradient does not carry over to Adam: its update divides by a running variance of the
gradient, whose compression error does not cancel (§3). Adam's variance becomes stable early, so:
- warm-up, the first `warmup` steps: the user's optimizer on the full-precision mean gradient (bsp with Adam);
- then the variance v is frozen (and its bias correction with it) and every step, on worker i,
      m_i ← β1 m + (1 − β1) g_i                                   (this worker's gradient; m is the same everywhere)
      m ← TwoSided(m_i)                                           (the compressed all-reduce with error feedback on the
                                                                   worker and on the chunk owner, `TwoSidedExchange`)
      x ← x − γ/(1 − β1^t) · m / (√v_frozen + ε)                  (AdamW's decoupled weight decay before it)
  as momentum SGD preconditioned by the frozen variance (√v_frozen: v's bias correction frozen with it). Every
  worker keeps the exchanged m as its own, so the models stay identical; m is 0 where v is exactly 0 (`AdamState.mask`).
The momentum travels through the training's compressor and memory (default `onebit` with `residual` error feedback:
the 1 bit with its scales); any compressor whose payload decodes alone stands in for it (`TwoSidedExchange`), one
that applies a momentum of its own (signum) or a memory that does (or replaces it: demo, sparseloco) is refused, and
so are the compressors measured not to train here (`_MISSES`).
`warmup`: the paper's BERT runs warm up for 15–25 % of their steps (DeepSpeed's tutorial: 16 000–23 000 of BERT's
pre-training, 400 for SQuAD); 100 steps is that share of this repository's LM races (400–700 steps). On each step
the momentum of a bucket starts its exchange as soon as backward hands the bucket over, as bsp's gradients do.
"""
from __future__ import annotations

from ..errors import UserError
from ..exchange import Exchange
from ..exchange.twosided import TwoSidedExchange, check_compressor
from ._registry import register
from .adam_state import AdamState, check_adam
from .base import Algorithm, int_at_least
from .cost import CostFamily


def check_momentum_free(name: str, compressor, memory) -> None:
    """A UserError where the momentum's compressed all-reduce cannot take `compressor` and `memory`: multi-round
    compressors, and a compressor or memory that applies (or replaces) a momentum of its own over Adam's."""
    check_compressor(compressor, name)
    if compressor.takes_momentum:
        raise UserError(f"{name} exchanges Adam's momentum, and {compressor.name!r} applies a momentum of its own: "
                        f"use onebit, signsgd or efsignsgd")
    if memory.replaces_momentum or (memory.takes_momentum and memory.momentum):
        raise UserError(f"{name} exchanges Adam's momentum, and memory {memory.name!r} keeps a momentum of its own: "
                        f"use memory residual (or none)")


@register("onebit-adam")
class OneBitAdam(Algorithm):
    """1-bit Adam (Tang et al. 2021, Alg. 1): `warmup` steps of the user's Adam on the mean gradient, then the
    variance frozen and the momentum exchanged compressed with two-sided error feedback."""

    architectures = ("allreduce",)
    schedules = ("none", "wfbp", "fusion")     # (a re-plan would move the chunks the owners' errors belong to)
    default_compressor = "onebit"
    default_memory = "residual"
    exchange_class = TwoSidedExchange
    adam_only = True
    cost = CostFamily("compressed_momentum")

    @staticmethod
    def full_precision_steps(params, steps):
        return min(int(params["warmup"]), steps)

    def __init__(self, warmup: int = 100, architecture: str | None = None):
        super().__init__(architecture)
        self.warmup = int_at_least(f"{self.name or 'onebit-adam'} warmup", warmup, 1,
                                   " (the frozen variance is the warm-up's)")

    # measured on digits-mlp with AdamW, 330 steps at 4 workers (docs/matrix.md): compressors that do not train here,
    # name -> (why, whether error feedback (a memory) makes it train)
    _MISSES = {"randomk": ("unbiased random-k's variance, compressed twice (worker and owner), goes straight into "
                           "Adam's step m/√v (digits-mlp: 0.68 with 1-bit Adam, 0.89 with 0/1 Adam)", False)}

    def check_components(self, compressor, memory):
        super().check_components(compressor, memory)
        check_momentum_free(self.name, compressor, memory)
        why, memory_helps = self._MISSES.get(compressor.name, (None, False))
        if why and not (memory_helps and memory.name != "none"):
            raise UserError(f"{self.name} does not train with compressor {compressor.name!r}: {why}; use onebit, "
                            f"signsgd, topk (memory residual) or qsgd")

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        check_adam(optimizer, self.name)

    def setup(self):
        check_adam(self.optimizer, self.name)
        self.adam = AdamState(self.optimizer, self.params)
        self.plain = self.ctx.exchange(Exchange, "none", "none")   # the full-precision mean gradient
        self.exchange = self.make_exchange()                         # the momentum, compressed
        self.pending: dict[int, object] = {}
        self.steps = 0
        self.variance_steps = 0      # the updates the frozen v received (its bias correction)

    def compressing(self) -> bool:
        return self.steps >= self.warmup

    # -- the step --------------------------------------------------------------------------------------
    def on_bucket(self, bucket):
        if not self.compressing():
            self.pending[bucket.index] = self.plain.start(bucket.buffer, bucket.key, inplace=True)
            return
        momenta = [self.adam.moment(i, g) for i, g in zip(bucket.members, bucket.views)]
        self.pending[bucket.index] = self.exchange.start(bucket.flat(momenta), bucket.key, bucket.shapes)

    def arrived(self):
        """(bucket, result) of every bucket's exchange of this step, in bucket order."""
        for bucket in self.scheduler.buckets:
            yield bucket, self.pending.pop(bucket.index).wait()

    def step(self):
        self.scheduler.flush()
        if self.compressing():
            for bucket, mean in self.arrived():
                for i, m in zip(bucket.members, bucket.split(mean)):
                    self.adam.state(i)["exp_avg"].copy_(self.adam.mask(i, m))
            for i in range(len(self.params)):
                self.adam.update(i, self.variance_steps)
        else:
            for bucket, mean in self.arrived():
                if mean.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(mean.reshape(-1))
            self.optimizer_step()
            if self.steps + 1 == self.warmup:       # v is frozen from here on
                self.variance_steps = int(self.adam.state(0)["step"])
        self.steps += 1
        self.scheduler.end_step()

    def finish_began(self) -> None:
        """A backward without its step: its exchanges finish, nothing applied."""
        if self.scheduler.began:
            self.scheduler.flush()
            for _ in self.arrived():
                pass
            self.scheduler.end_step()

    def close(self):
        self.finish_began()
        super().close()

    # -- state -----------------------------------------------------------------------------------------
    def metrics(self):
        return {**super().metrics(), "warmup": self.warmup, "compressed_steps": max(0, self.steps - self.warmup)}

    def state_dict(self):
        return {"steps": self.steps, "variance_steps": self.variance_steps, "plain": self.plain.state_dict(),
                "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.steps, self.variance_steps = int(state["steps"]), int(state["variance_steps"])
        self.plain.load_state_dict(state["plain"])
        self.exchange.load_state_dict(state["exchange"])
