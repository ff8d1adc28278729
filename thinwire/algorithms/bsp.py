"""`bsp`: bulk-synchronous parallel SGD (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep
Learning: A Comprehensive Survey", arXiv 2003.06307, §III-A, eq. 6): every step, the mean gradient of all workers.

Each bucket's exchange starts as soon as backward hands the bucket over (WFBP, fusion, MG-WFBP or priority, the
scheduler's choice) and `step()` waits for all of them, then applies the optimizer to the averaged gradients.
The parameter-server form is `bsp` with `architecture="ps"` (`thinwire.algorithms.ps_sync`), the gossip form D-PSGD
(`architecture="gossip"`, `thinwire.algorithms.dpsgd`).
"""
from __future__ import annotations

from ._registry import register
from .base import Algorithm
from .cost import CostFamily


def wait_buckets(pending: dict, buckets) -> None:
    """Wait for each bucket's exchange (`pending`: bucket index -> its future, popped; a bucket not there has
    landed already); its result in place in the bucket, i.e. in every p.grad (a bucket all-reduced in place is
    there already)."""
    for bucket in buckets:
        fut = pending.pop(bucket.index, None)
        if fut is None:
            continue
        res = fut.wait()
        if res.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(res.reshape(-1))


@register("bsp")
class BSP(Algorithm):
    """Synchronous SGD: x_{t+1} = x_t - γ (1/n) Σ_i G_i(x_t) (eq. 6)."""

    schedules = ("none", "wfbp", "fusion", "mgwfbp", "priority")
    checks_finite = True      # each bucket is checked (Exchange._check_finite) before it is sent
    exchanges_gradients = True
    survives_failures = True  # the mean over fewer workers is still the mean gradient
    lands_in_backward = True  # as DDP: the loop may clip or unscale the mean gradient between backward and step
    cost = CostFamily("every_step")

    def setup(self):
        self.exchange = self.make_exchange()
        self.pending: dict[int, object] = {}

    def on_bucket(self, bucket):
        """The mean of the bucket's gradients over workers starts (a future); the bucket itself is all-reduced in
        place when nothing is compressed (as DDP does)."""
        self.pending[bucket.index] = self.exchange.start(bucket.buffer, bucket.key, shapes=bucket.shapes, inplace=True)

    def average_gradients(self) -> None:
        """Wait for every bucket's exchange; the averaged gradients in place in every p.grad."""
        wait_buckets(self.pending, self.scheduler.buckets)

    land = average_gradients

    def recover(self):
        self.pending.clear()

    def join_boundary(self, step):
        return True                         # every step's all-reduce is complete when it ends

    def step(self):
        if self.scheduler.defers_update:   # priority: the next forward applies the update, layer by layer
            self.scheduler.finish_step()
            return
        self.scheduler.flush()
        self.average_gradients()
        self.optimizer_step()
        self.scheduler.end_step()

    def close(self):
        if not self.scheduler.defers_update and self.scheduler.began:
            self.scheduler.flush()         # a backward without its step: its exchanges finish, nothing applied
            self.average_gradients()
            self.scheduler.end_step()
        super().close()                    # (priority's close finishes its deferred update)

    def state_dict(self):
        if self.scheduler.defers_update:
            self.scheduler.flush()
        return {"exchange": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.exchange.load_state_dict(state["exchange"])
