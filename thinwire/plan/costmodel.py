"""The cost model: predicted iteration time of every algorithm from compute τ, the link and the payload.

Collectives cost what `thinwire.net.cost` says (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed
Deep Learning: A Comprehensive Survey", arXiv 2003.06307, Table III and §IV-B); a compressor costs the bits
its exchange really sends at the scenario's world size (`thinwire.exchange.choose.wire_bits`: all-gather of packed codes or
all-reduce of widened levels, whichever the exchange picks) and its compression time (a multiple of one memcpy of the
tensor: measured by `thinwire bench compressors` / `thinwire advise --calibrate`, else the compressor's declaration
`Compressor.x_memcpy`, measured on our machine); an algorithm's iteration time combines them as its schedule does
(the cost family it declares, `thinwire.plan.families`). Scalability is the throughput relative to the same workers
with no communication: τ / iteration time (Zhu, Lu, Lin, Han 2019, "Distributed Training Across the World" (DTS)'s
definition, measured against the no-communication limit).

Workers of different speeds (`Scenario.speeds`, factors of the fastest worker's speed; docs/planner.md): worker i
computes a step in τ/s_i, and the algorithm's declared pace (`CostFamily.pace`) says who waits for whom — a
synchronous algorithm steps at its slowest worker's pace, an asynchronous one at the sum of the speeds (`paced`).
The reference is then the same workers without communication, each at its own speed: a mean step of nτ / Σ s_i.
Without speeds (or all 1) every prediction is the equal-speed one, exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .. import algorithms
from ..compress import Compressor, compressors
from ..errors import UserError
from ..exchange.choose import wire_bits
from ..net import Cost, Link
from ..net import cost as netcost
from .families import FAMILIES, Inputs

MEMCPY_BYTES_PER_S = 9.0e9  # one fp32 memcpy moves 4 bytes per element (measured ~7 ms for 2^24 elements)


COLLECTIVES = dict(netcost.ALLREDUCE)   # every one of them runs: thinwire.comm.collectives, --allreduce NAME


@dataclass
class Scenario:
    """What is being planned: model size, compute per iteration, the link, worker and server counts."""

    params: float
    compute_s: float
    link: Link
    workers: int
    servers: int = 1
    bytes_per_param: int = 4
    backward_fraction: float = 2.0 / 3.0   # share of τ spent in backward (what WFBP can hide behind)
    collective: str = "ring"
    x_memcpy: dict = field(default_factory=dict)
    handshake: bool = False   # gloo: every collective step starts with a round trip (Link.handshaking)
    speeds: tuple | None = None   # each worker's speed, a factor of the fastest's (None: every worker at 1)
    lockstep_speed: float | None = None   # the speed a step that waits for every worker runs at (None: the least)
    stragglers: tuple | None = None       # (p, factor, steps) of straggler episodes (`thinwire.speeds`), or None

    @property
    def unequal(self) -> bool:
        """Whether the workers' speeds differ from the equal-speed scenario's (all 1)."""
        return self.speeds is not None and (any(f != 1 for f in self.speeds) or
                                            self.lockstep_speed not in (None, 1))

    @property
    def slowest(self) -> float:
        """The speed of a step that waits for every worker: the least factor, or `lockstep_speed` where episodes
        of slowness (stragglers) make the per-step slowest slower than any worker's mean."""
        return self.lockstep_speed if self.lockstep_speed is not None else min(self.speeds or (1.0,))

    @property
    def reference_s(self) -> float:
        """The no-communication reference's mean step at these speeds: every worker at its own, nτ / Σ s_i."""
        return self.compute_s * len(self.speeds) / sum(self.speeds) if self.unequal else self.compute_s

    def at_speed(self, f: float) -> "Scenario":
        """One worker at speed f: its step's compute τ/f, of which the backward still takes what it did (the
        slowness comes before it, as a slow worker's gradients leave late: `thinwire.speeds`)."""
        return replace(self, compute_s=self.compute_s / f, backward_fraction=self.backward_fraction * f,
                       speeds=None, lockstep_speed=None, stragglers=None)

    def round_factor(self, period: int, waits_for: int | None = None) -> float:
        """How much longer a round of `period` steps that waits for every worker's round is than the workers' mean
        round, under straggler episodes (1 without): worker i spends E_i of its H steps in episodes, E[E_i] = Hq,
        and the round lasts as long as the most: (H + (1/f − 1) E[max_i E_i]) / (H + (1/f − 1) Hq). The episodes
        that overlap a worker's round are counted as Poisson, N_i ~ Poisson(μ), μ = (H + L − 1) p (1 − q) (an
        episode starts at a step outside one with probability p), each c = Hq/μ of its steps inside the round, so
        E[max_i E_i] = Σ_k min(c, H − kc)⁺ (1 − F(k)^n), F the Poisson CDF (at H = 1 about the lockstep step's
        1 − (1 − q)^n). `waits_for`: a round that waits for m of the n workers' rounds (a quorum of K: the K-th
        fastest, bounded here by the slowest of m = n − K + 1)."""
        if not self.stragglers:
            return 1.0
        p, slow, steps = self.stragglers
        h, q = max(1, int(period)), p * steps / (1 + p * steps)
        mu = (h + steps - 1) * p * (1 - q)
        if mu <= 0:
            return 1.0
        c, n = h * q / mu, waits_for or len(self.speeds)
        most, k, cdf, pk = 0.0, 0, 0.0, math.exp(-mu)
        while k * c < h:
            cdf += pk
            tail = 1 - cdf ** n
            most += min(c, h - k * c) * tail
            if tail < 1e-12:
                break
            k += 1
            pk *= mu / k
        return (h + (1 / slow - 1) * most) / (h + (1 / slow - 1) * h * q)

    @property
    def collective_link(self) -> Link:
        return self.link.handshaking() if self.handshake else self.link

    @property
    def nbytes(self) -> float:
        return self.params * self.bytes_per_param

    def allreduce(self, nbytes: float) -> Cost:
        return COLLECTIVES[self.collective](self.collective_link, self.workers, nbytes)

    def compress_s(self, compressor: str) -> float:
        """Compress + decompress time of the whole model through `compressor` (a name): its multiple of a memcpy
        from the calibration file (`x_memcpy`) where that measured it, else the compressor's own declaration."""
        x = self.x_memcpy.get(compressor)
        x = getattr(compressors.lookup(compressor), "x_memcpy", Compressor.x_memcpy) if x is None else x   # a+coder: 8
        return x * self.params * 4 / MEMCPY_BYTES_PER_S


def sparse_exchange_cost(s: Scenario, comp, name: str) -> Cost:
    """One exchange of a top-k-family compressor's k-sparse gradient through sparse collective `name` other than
    the all-gather, which `exchange` costs from the compressor's wire bits (net/cost.py; Tang et al. §VI-B: the
    all-gather's n·k build-up vs gTop-k's 2α log n + 4kβ log n). gTop-k and shared-index move the raw contribution
    (int32 index + a value of `bytes_per_param`), the hierarchical leaders the compressor's own payload. gTop-k's
    rounds are point-to-point (no collective handshake); the others are collectives."""
    numel = int(s.params)
    payload = comp.nominal_bits(numel) * numel / 8
    ratio = getattr(comp, "ratio", None)
    pair = 4 + s.bytes_per_param
    k = max(1, min(numel, int(ratio * numel))) if ratio else max(1.0, payload / pair)
    link, n = s.collective_link, s.workers
    if name == "gtopk":
        return netcost.gtopk_allreduce(s.link, n, k, pair)
    if name == "shared":
        return netcost.shared_topk_allreduce(link, n, k, 4, s.bytes_per_param)
    if name == "hierarchical":
        return netcost.hierarchical_topk(link, n, k, numel, pair=payload / k, value_bytes=s.bytes_per_param)
    raise KeyError(name)


def exchange(s: Scenario, compressor: str = "none", sparse_collective: str | None = None,
             aggregate: str | None = None, **params) -> tuple[str, Cost]:
    """One exchange of the whole gradient through `compressor`: the collective its algebra allows (the all-reduce
    algorithm, allgather, or for a top-k-family compressor `sparse_collective`, default the all-gather) and its
    cost. A robust `aggregate` (median, trimmed, clip: `thinwire.exchange.robust`) gathers every rank's payload."""
    if aggregate not in (None, "mean"):
        bits = 32.0 if compressor == "none" else compressors.get(compressor, **params).nominal_bits(int(s.params))
        payload = bits * s.params / 8 if compressor != "none" else s.nbytes
        return "allgather", netcost.ring_allgather(s.collective_link, s.workers, payload)
    if compressor == "none":
        return s.collective, s.allreduce(s.nbytes)
    comp = compressors.get(compressor, **params)
    if sparse_collective and sparse_collective != "allgather" and comp.is_sparse:
        return sparse_collective, sparse_exchange_cost(s, comp, sparse_collective)
    coll, bits = wire_bits(comp, int(s.params), s.workers, s.collective, s.collective_link)   # what the exchange sends
    payload = bits * s.params / 8
    if coll in ("allreduce", "custom"):
        return s.collective, s.allreduce(payload)
    return "allgather", netcost.ring_allgather(s.collective_link, s.workers, payload)   # allgather and majority vote


COMPRESSOR_PARAMS = ("ratio", "rank", "levels", "threshold", "bucket")   # of predict's parameters, the compressor's


@dataclass
class Prediction:
    name: str
    iteration_s: float
    compute_s: float
    bytes_per_step: float
    note: str = ""
    collective: str = ""   # what carries the exchange: ring|tree|... all-reduce, allgather, gtopk, ..., ps, gossip
    bytes_per_sync: float = 0.0   # the DiLoCo family: bytes one worker sends per (fragment) sync, the peak burst

    @property
    def scalability(self) -> float:
        return self.compute_s / self.iteration_s if self.iteration_s > 0 else 0.0


def cost_of(algorithm: str) -> algorithms.CostFamily:
    """What `algorithm` declares to the planner (its class's `cost`); a UserError where it declares nothing."""
    declared = algorithms.registry.lookup(algorithm).cost
    if declared is None or declared.family not in FAMILIES:
        valid = ", ".join(FAMILIES)
        raise UserError(f"the planner has no model of algorithm {algorithm!r}: it declares no cost family "
                        f"(`cost = CostFamily(...)`; valid families: {valid})")
    return declared


def scenario_speeds(profile, workers: int) -> dict:
    """`Scenario`'s speeds for a `thinwire.speeds.Profile` (its first segment) of `workers` workers: each worker's
    long-run factor (`Profile.mean_factors`) and, where straggler episodes come and go, the expected speed of a
    step that waits for every worker: 1 / E[max_i 1/s_i,t], worker i at f_i outside an episode and at f_i·slow
    within one (a share q = pL / (1 + pL) of its steps), independently. {} for None (equal speeds)."""
    if profile is None:
        return {}
    profile.check_workers(workers)
    factors, seg = profile.mean_factors(workers), profile.segments[0][1]
    if seg.stragglers is None:
        return {"speeds": tuple(factors)}
    p, slow, steps = seg.stragglers
    q = p * steps / (1 + p * steps)
    fixed = [seg.factor(r, workers) for r in range(workers)]
    # E[max] over 2 values per worker: ascending, P(max <= v) = Π_i P(T_i <= v) kept as a product of the workers
    # whose both values are <= v (1) and those with only the short one (1 - q)
    points = sorted([(1 / f, i, 1 - q) for i, f in enumerate(fixed)] + [(1 / (f * slow), i, 1.0)
                                                                       for i, f in enumerate(fixed)])
    below, mean, last = [0.0] * workers, 0.0, 0.0
    zeros, logp = workers, 0.0
    for v, i, cdf in points:
        if below[i] == 0.0:
            zeros -= 1
        else:
            logp -= math.log(below[i])
        below[i] = cdf
        logp += math.log(cdf) if cdf > 0 else -math.inf
        now = math.exp(logp) if zeros == 0 else 0.0
        mean += v * (now - last)
        last = now
    return {"speeds": tuple(factors), "lockstep_speed": 1.0 / mean, "stragglers": seg.stragglers}


def pace_of(declared: algorithms.CostFamily, params: dict) -> str:
    """The pace an algorithm with these parameters runs at (`CostFamily.pace`, changed by `pace_with`)."""
    for name, pace in declared.pace_with:
        if params.get(name):
            return pace
    return declared.pace


def paced(s: Scenario, pace: str, params: dict, at: "callable") -> tuple[float, object]:
    """(mean step, the step of one worker) of workers at speeds `s.speeds` under `pace`; `at(scenario)` is the
    family's step for one worker's scenario (`Scenario.at_speed`). The mean step is n over the steps per second
    of all the workers together (asynchronous local SGD runs at the sum of the speeds: Liu, Chhaparia, Douillard,
    Kale, Rusu, Shen, Szlam, Ranzato 2024, "Asynchronous Local-SGD Training for Language Modeling", arXiv
    2401.09135, §4.2):
    - "slowest": every step waits for the slowest worker: T(τ/s_min); one that syncs every K steps waits at each
      sync, under straggler episodes T(τ/s_min) × `Scenario.round_factor(K)` (a bounded-staleness algorithm too: its
      fastest worker runs at most s clocks ahead of its slowest, Ho et al. 2013, so a lasting difference of speed
      leaves it at the slowest's pace);
    - "own": worker i steps in T_i = T(τ/s_i), waiting for none: n / Σ 1/T_i;
    - "rounds": a round is H steps of the fastest worker, H s_i/s_max of worker i (dynamic local updates, Liu et
      al. 2024 §4.2): T(τ/s_max) · n s_max / Σ s_i, × `Scenario.round_factor(H)` under straggler episodes (the
      round waits for the worker its episodes caught the most);
    - "quorum": the K fastest wait for the K-th fastest, the others at their own pace (their work merges a round
      later): n / (K / T(τ/s_(K)) + Σ_{j>K} 1/T_j), T(τ/s_(K)) × `round_factor(H, n − K + 1)` under episodes."""
    speeds = sorted(s.speeds, reverse=True)
    n = len(speeds)
    every = max(1, int(params.get("period") or 1) // max(1, int(params.get("fragments") or 1)))   # steps a sync
    if pace == "own" or (pace == "quorum" and not params.get("quorum")):
        steps = [at(s.at_speed(f)) for f in speeds]
        return n / sum(1.0 / st.iteration_s for st in steps), steps[-1]
    if pace == "rounds":
        step = at(s.at_speed(speeds[0]))
        return step.iteration_s * n * speeds[0] / sum(speeds) * s.round_factor(every), step
    if pace == "quorum":
        k = min(n, int(params["quorum"]))
        steps = [at(s.at_speed(f)) for f in [speeds[k - 1]] + speeds[k:]]
        quorum_s = steps[0].iteration_s * s.round_factor(every, n - k + 1)
        return n / (k / quorum_s + sum(1.0 / st.iteration_s for st in steps[1:])), steps[0]
    if s.stragglers and every > 1:   # a sync every K steps waits for the worker its episodes caught the most
        step = at(s.at_speed(speeds[-1]))
        return step.iteration_s * s.round_factor(every), step
    step = at(s.at_speed(s.slowest))
    return step.iteration_s, step


def predict(s: Scenario, algorithm: str, compressor: str = "none", overlap: bool = False, **p) -> Prediction:
    """Iteration time of `algorithm` (with `compressor`) in scenario `s`: the formula of the cost family the
    algorithm declares (`thinwire.plan.families`), its parameters `p` over the declared ones over the algorithm's
    constructor defaults. `overlap`: WFBP's flag, or DiLoCo's τ_o (an int). `sparse_collective=` (a
    top-k-family compressor) picks the sparse collective of its exchange, `aggregate=` a robust rule its gather;
    the prediction's `collective` names what carries it."""
    cp, sparse = {k: v for k, v in p.items() if k in COMPRESSOR_PARAMS}, p.get("sparse_collective")
    agg = p.get("aggregate")        # a robust rule: the exchange gathers (`exchange`)
    collective, comm = exchange(s, compressor, sparse, agg, **cp)
    declared = cost_of(algorithm)
    delta = s.compress_s(compressor) if compressor != "none" else 0.0
    again = lambda sc, name=None: exchange(sc, compressor, sparse, agg, **cp) if name is None else exchange(sc, name)
    x = Inputs(s, compressor, overlap, comm, delta, again)
    params, formula = {**algorithms.registry.parameters(algorithm), **declared.params, **p}, \
        FAMILIES[declared.family].formula
    if s.unequal:     # workers of different speeds: each at its own, as the algorithm's pace lets it
        iteration_s, step = paced(s, pace_of(declared, params), params, lambda sc: formula(x._replace(s=sc), params))
        return Prediction(algorithm, iteration_s, s.reference_s, step.bytes_per_step,
                          collective=step.collective or collective, bytes_per_sync=step.bytes_per_sync)
    step = formula(x, params)
    return Prediction(algorithm, step.iteration_s, s.compute_s, step.bytes_per_step,
                      collective=step.collective or collective, bytes_per_sync=step.bytes_per_sync)
