"""`backup`: synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz 2016, "Revisiting Distributed
Synchronous SGD", arXiv 1604.00981; Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep
Learning: A Comprehensive Survey", arXiv 2003.06307, §III-B), on the parameter server."""
from __future__ import annotations

from ..errors import UserError
from ._registry import register
from .base import int_at_least
from .ps_sync import PSBSP


@register("backup")
class Backup(PSBSP):
    """Of the n + n_b workers (`--workers` counts all of them, `backups` is n_b), the server averages the first
    n fresh pushes of each bucket's round, x_{t+1} = x_t - γ (1/n) Σ_{i∈A_t} G_i(x_t) (Chen et al. 2016), and answers
    those n at once; a push computed on an older model arrives late and is dropped (its worker gets the current
    model). Rounds are per bucket (as BytePS's keys): A_t is the first n arrivals of that bucket. Dropped pushes
    of the first bucket are counted (`dropped` in the metrics)."""

    rule = "backup"

    def __init__(self, architecture: str | None = None, backups: int = 1, servers: int = 1,
                 downlink_compressor: str = "none", downlink_params: dict | None = None):
        super().__init__(architecture, servers, downlink_compressor, downlink_params)
        self.backups = int_at_least("backup backups (n_b)", backups, 0)

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        workers = world_size - self.servers
        if workers >= 1 and self.backups >= workers:
            raise UserError(f"backups={self.backups} leaves no gradient to wait for with {workers} workers; "
                            f"valid: 0..{workers - 1}")

    def setup(self):
        self.check_run(self.world_size)
        super().setup()
