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
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    step = FAMILIES[declared.family].formula(x, {**algorithms.registry.parameters(algorithm), **declared.params, **p})
    return Prediction(algorithm, step.iteration_s, s.compute_s, step.bytes_per_step,
                      collective=step.collective or collective, bytes_per_sync=step.bytes_per_sync)
