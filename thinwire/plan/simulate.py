"""A discrete-event simulator of N workers (up to thousands): stragglers, per-link latency, the schedules.

Each worker's compute time per step is drawn from a distribution (log-normal spread plus stragglers); workers
are placed in regions with a latency matrix (e.g. four regions across the world) and share a bandwidth per
link. Events — a worker finishing its compute, an exchange launched, an exchange delivered, a server applying
an update — are processed in time order: synchronous schedules as per-step recurrences over all workers
(vectorised), the parameter server's arrivals through an event queue. The collective's time is the cost model's
(`thinwire.net.cost`, Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A
Comprehensive Survey", arXiv 2003.06307, Table III) with the latency of the slowest hop it crosses.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..net import COLLECTIVE_SLOTS, Cost, Link
from ..net import cost as netcost
from .costmodel import COLLECTIVES

# One-way latencies (s) of an illustrative four-region deployment like Zhu, Lu, Lin, Han 2019, "Distributed Training
# Across the World" (DTS)'s (Tokyo, London, Oregon, Ohio). These values are our assumption of typical inter-region
# delays, not figures read off the paper.
WORLD_LATENCY = np.array([[0.0, 0.110, 0.050, 0.075],
                          [0.110, 0.0, 0.070, 0.040],
                          [0.050, 0.070, 0.0, 0.025],
                          [0.075, 0.040, 0.025, 0.0]])


@dataclass
class SimConfig:
    workers: int = 4
    params: float = 1e6
    compute_s: float = 0.1
    compute_cv: float = 0.05           # log-normal spread of compute times
    straggler_prob: float = 0.0        # chance a worker's step is slowed down ...
    straggler_factor: float = 3.0      # ... by this factor
    bandwidth: float | None = 1e9      # bits/s per worker link
    latency: float = 0.0               # one-way latency between any two workers (no regions)
    regions: np.ndarray | None = None  # latency matrix between regions; workers are split evenly across them
    intra_latency: float = 50e-6       # latency inside a region
    algorithm: str = "bsp"
    collective: str = "auto"           # ring, tree, recursive_doubling, double_binary_tree, hierarchical, auto
    delay: int = 4
    period: int = 4
    k: int = 5
    staleness: int = 2
    servers: int = 1
    steps: int = 50
    seed: int = 0
    bytes_per_param: int = 4
    compression: float = 1.0           # payload / uncompressed size (for compressed schedules)
    fragments: int = 1                 # diloco: fragments synced in turn, one every period/fragments steps
    overlap: int = 0                   # diloco: inner steps a fragment's sync overlaps before it is waited for

    def validate(self) -> None:
        if self.workers < 1 or self.steps < 1:
            raise UserError("workers and steps must be >= 1")
        if self.algorithm not in SCHEDULES:
            raise UserError(f"unknown schedule {self.algorithm!r}; valid: {', '.join(sorted(SCHEDULES))}")
        if self.collective != "auto" and self.collective not in COLLECTIVES:
            raise UserError(f"unknown collective {self.collective!r}; valid: auto, {', '.join(sorted(COLLECTIVES))}")
        if self.delay < 1 or self.period < 1 or self.k < 1 or self.staleness < 0:
            raise UserError("delay, period and k must be >= 1, staleness >= 0")
        if self.fragments < 1 or self.period % self.fragments or not 0 <= self.overlap < self.period // self.fragments:
            raise UserError(f"diloco needs fragments >= 1 dividing period and 0 <= overlap < period/fragments; got "
                            f"period={self.period}, fragments={self.fragments}, overlap={self.overlap}")


def _collective_cost(cfg: SimConfig, nbytes: float) -> Cost:
    """The all-reduce time across the deployment: intra-region hops at `intra_latency`, inter-region hops at
    the matrix's latencies; a lock-step algorithm waits for the slowest hop of each round."""
    n = cfg.workers
    if cfg.regions is None:
        link = Link(bandwidth=cfg.bandwidth, latency=cfg.latency)
        names = [cfg.collective] if cfg.collective != "auto" else ["ring", "double_binary_tree"]
        return min((COLLECTIVES[c](link, n, nbytes) for c in names), key=lambda c: c.time)
    lat = np.asarray(cfg.regions)
    used = sorted(set(((np.arange(n) * len(lat)) // n).tolist()))   # the regions workers are split evenly into
    ring_hops = [lat[used[i], used[(i + 1) % len(used)]] for i in range(len(used))] if len(used) > 1 else [0.0]
    worst_ring = max(max(ring_hops), cfg.intra_latency)
    worst_any = max(lat[np.ix_(used, used)].max(), cfg.intra_latency)
    options = {c: COLLECTIVES[c](Link(cfg.bandwidth, worst_ring if c == "ring" else worst_any), n, nbytes)
               for c in ("ring", "tree", "recursive_doubling", "double_binary_tree")}
    m = max(1, n // max(1, len(used)))   # hierarchical: groups are the regions
    options["hierarchical"] = (netcost.tree_allreduce(Link(cfg.bandwidth, cfg.intra_latency), m, nbytes)
                               + netcost.ring_allreduce(Link(cfg.bandwidth, worst_ring), len(used), nbytes))
    if cfg.collective == "auto":
        return min(options.values(), key=lambda c: c.time)
    if cfg.collective not in options:   # recursive_halving, torus: every hop at the slowest pair's latency
        return COLLECTIVES[cfg.collective](Link(cfg.bandwidth, worst_any), n, nbytes)
    return options[cfg.collective]


def _compute_times(cfg: SimConfig, rng: np.random.Generator) -> np.ndarray:
    sigma = math.sqrt(math.log(1 + cfg.compute_cv ** 2))
    c = cfg.compute_s * rng.lognormal(-sigma ** 2 / 2, sigma, size=(cfg.steps, cfg.workers))
    if cfg.straggler_prob > 0:
        c = np.where(rng.random(c.shape) < cfg.straggler_prob, c * cfg.straggler_factor, c)
    return c


# -- schedules: each returns the time at which all workers finished `steps` steps --------------------------
def _local(c, cfg, comm):
    return c.sum(axis=0).max()


def _bsp(c, cfg, comm):
    return float((c.max(axis=1) + comm.time).sum())  # every step waits for the slowest worker, then exchanges


def _dts(c, cfg, comm, delay=None, period=None):
    """Zhu et al. 2019 (DTS), §3: the window of `period` steps is launched when its last step ends and applied
    `delay`−1 windows later; at most two exchanges run at once (gloo's threads) and their transfers share the link."""
    t, p = delay or cfg.delay, period or cfg.period
    f = np.zeros(cfg.workers)
    link_free, running = 0.0, []
    due: dict[int, float] = {}
    for s in range(cfg.steps):
        f += c[s]
        if (s + 1) % p == 0 or s == cfg.steps - 1:
            start = max(f.max(), link_free)          # the collective starts when the last worker joins,
            if len(running) >= COLLECTIVE_SLOTS:      # when one of gloo's threads is free
                start = max(start, running[-COLLECTIVE_SLOTS])
            link_free = start + comm.transfer        # and its transfer queues behind the previous one
            running = (running + [start + comm.time])[-COLLECTIVE_SLOTS:]
            due[min(s + (t - 1) * p, cfg.steps - 1)] = start + comm.time   # applied t−1 windows later
        if s in due:
            f = np.maximum(f, due.pop(s))
    return f.max()


def _diloco(c, cfg, comm, k=None, lag=None):
    """DiLoCo / Streaming DiLoCo: every K = period/fragments steps one fragment (`comm` is its exchange) starts
    when the last worker has taken its pseudo-gradient and is waited for `overlap` steps later; one fragment
    in flight at a time, the transfers queued on the link. Local SGD: the whole model every period (K = H, lag 0)."""
    k, lag = k or cfg.period // cfg.fragments, cfg.overlap if lag is None else lag
    f = np.zeros(cfg.workers)
    link_free, due = 0.0, {}
    for s in range(cfg.steps):
        f += c[s]
        if (s + 1 + lag) % k == 0:
            start = max(f.max(), link_free)
            link_free = start + comm.transfer
            due[s + lag] = start + comm.time
        if s in due:
            f = np.maximum(f, due.pop(s))
    return f.max()


def _cdsgd(c, cfg, comm, full, k=None):
    """Yu et al. 2021 (CD-SGD, arXiv 2106.10796), eqs. 6–7: iteration i+1 computes while iteration i communicates;
    the local update of iteration i needs W_i, i.e. the exchange of iteration i−1. Every k-th exchange is `full` (full precision)."""
    k = k or cfg.k
    f = np.zeros(cfg.workers)
    prev_arrival = 0.0
    for s in range(cfg.steps):
        f = np.maximum(f + c[s], prev_arrival)
        x = full if s % k == 0 else comm
        prev_arrival = f.max() + x.time
    return max(f.max(), prev_arrival)


def _ps(c, cfg, comm, staleness=None):
    """Parameter server (asp, or ssp with a staleness bound): each worker pushes its gradient and pulls the
    model; the servers' links serialise the n workers' transfers (incast). Event queue in time order."""
    n, steps = cfg.workers, cfg.steps
    k = max(1, cfg.servers)
    up = cfg.params * cfg.bytes_per_param * cfg.compression / k
    down = cfg.params * cfg.bytes_per_param / k
    beta = Link(cfg.bandwidth).beta
    alpha = cfg.latency if cfg.regions is None else float(np.asarray(cfg.regions).max())
    clock = np.zeros(n, dtype=int)
    server_free = 0.0
    events = [(c[0, i], i) for i in range(n)]   # (time a worker's gradient is ready, worker)
    heapq.heapify(events)
    blocked: list[tuple[int, float]] = []
    done = 0.0
    while events:
        t, i = heapq.heappop(events)
        start = max(t + alpha, server_free)        # push arrives, queued behind other pushes
        server_free = start + (up + down) * beta   # the server's link carries the push and the reply
        ready = server_free + alpha                # the reply (new model) arrives
        clock[i] += 1
        done = max(done, ready)
        if clock[i] >= steps:
            continue
        nxt = ready + c[clock[i], i]
        if staleness is not None and clock[i] - clock.min() > staleness:
            blocked.append((i, nxt))
        else:
            heapq.heappush(events, (nxt, i))
        if blocked:
            still = []
            for j, tj in blocked:
                if clock[j] - clock.min() <= staleness:
                    heapq.heappush(events, (max(tj, ready), j))
                else:
                    still.append((j, tj))
            blocked = still
    return done


SCHEDULES = {
    "local": _local, "bsp": _bsp, "dts": _dts,
    "localsgd": lambda c, cfg, comm: _diloco(c, cfg, comm, k=cfg.period, lag=0),
    "delayed": lambda c, cfg, comm: _dts(c, cfg, comm, period=1),
    "tsparse": lambda c, cfg, comm: _dts(c, cfg, comm, delay=1),
    "cdsgd": lambda c, cfg, comm: _cdsgd(c, cfg, comm, _collective_cost(cfg, cfg.params * cfg.bytes_per_param)),
    "odsgd": lambda c, cfg, comm: _cdsgd(c, cfg, comm, comm, k=1), "diloco": _diloco,
    "asp": _ps, "ssp": lambda c, cfg, comm: _ps(c, cfg, comm, cfg.staleness),
}


@dataclass
class SimResult:
    algorithm: str
    workers: int
    total_s: float
    iteration_s: float
    scalability: float
    collective_s: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def simulate(cfg: SimConfig) -> SimResult:
    cfg.validate()
    c = _compute_times(cfg, np.random.default_rng(cfg.seed))
    nbytes = cfg.params * cfg.bytes_per_param
    comm = _collective_cost(cfg, nbytes * cfg.compression / (cfg.fragments if cfg.algorithm == "diloco" else 1))
    total = SCHEDULES[cfg.algorithm](c, cfg, comm)
    alone = _local(c, cfg, comm)
    return SimResult(cfg.algorithm, cfg.workers, float(total), float(total) / cfg.steps, float(alone / total),
                     comm.time)
