"""The cost model: predicted iteration time of every algorithm from compute τ, the link and the payload.

Collectives cost what `thinwire.net.cost` says (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed
Deep Learning: A Comprehensive Survey", arXiv 2003.06307, Table III and §IV-B); a compressor costs the bits
its exchange really sends at the scenario's world size (`thinwire.exchange.choose.wire_bits`: all-gather of packed codes or
all-reduce of widened levels, whichever the exchange picks) and its compression time (a multiple of one memcpy of the
tensor: measured by `thinwire bench compressors` / `thinwire advise --calibrate`, else the compressor's declaration
`Compressor.x_memcpy`, measured on our machine); an algorithm's iteration time combines them as its schedule does.
Scalability is the throughput relative to the same workers with no communication: τ / iteration time (Zhu, Lu,
Lin, Han 2019, "Distributed Training Across the World" (DTS)'s definition, measured against the no-communication
limit).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..compress import Compressor, compressors
from ..exchange.choose import wire_bits
from ..net import COLLECTIVE_SLOTS, Cost, Link
from ..net import cost as netcost
from ..net import cdsgd as cd

MEMCPY_BYTES_PER_S = 9.0e9  # one fp32 memcpy moves 4 bytes per element (measured ~7 ms for 2^24 elements)


def ps_push_pull(link: Link, n: int, up: float, down: float, servers: int = 1) -> Cost:
    """Parameter server with k servers, parameters sharded evenly: each worker pushes N_up/k to each server and
    pulls N_down/k back; a server's link receives n·N_up/k (incast) and sends n·N_down/k, so one round costs
    2α + (n N_up + n N_down)/k β on the servers' links (Tang et al. §IV-A, Table IV)."""
    k = max(1, servers)
    return Cost(2 * link.alpha, (n * up + n * down) / k * link.beta, up, down)


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
             **params) -> tuple[str, Cost]:
    """One exchange of the whole gradient through `compressor`: the collective its algebra allows (the all-reduce
    algorithm, allgather, or for a top-k-family compressor `sparse_collective`, default the all-gather) and its
    cost."""
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


def predict(s: Scenario, algorithm: str, compressor: str = "none", overlap: bool = False, **p) -> Prediction:
    """Iteration time of `algorithm` (with `compressor`) in scenario `s`.

    bsp: τ + δ + C (no overlap), τ + max(0, C − τ_b) with WFBP; bitsgd / odsgd / cdsgd: Yu, Dong, Xu, Ouyang, Liao
    2021, "CD-SGD: Distributed Stochastic Gradient Descent with Compression and Delay Compensation", arXiv
    2106.10796, eqs. 4–7;
    localsgd: τ + C/H; ssp/asp: each worker τ + its push/pull, bounded below by the servers' link (incast);
    dpsgd / gossip: τ + α + dNβ; dts / delayed / tsparse (Zhu et al. §3): a window of p steps launches one
    exchange, waited t−1 steps later: τ + max(0, C − (t−1)τ)/p, bounded below by C/(2p) (gloo runs two
    collectives at a time) and by the link's occupancy C_β/p. diloco (`period` H, `fragments` F, `overlap`
    τ_o): every K = H/F steps one fragment of N/F parameters is averaged (its exchange C_F, compression δ_F),
    started τ_o steps before it is waited for: τ + max(0, δ_F + C_F − τ_o τ)/K; F = 1, τ_o = 0 is localsgd's
    τ + (δ + C)/H (`overlap=τ_o`, an int, for diloco). Its peak, the bytes of one sync, is `bytes_per_sync`
    (1/F of DiLoCo's). `sparse_collective=` (a top-k-family compressor)
    picks the sparse collective of its exchange; the prediction's `collective` names what carries it.
    """
    cp = {k: v for k, v in p.items() if k in COMPRESSOR_PARAMS}
    collective, comm = exchange(s, compressor, p.get("sparse_collective"), **cp)
    pred = _predict(s, algorithm, compressor, overlap, comm, cp, p)
    pred.collective = ("ps" if algorithm in ("asp", "ssp", "backup") else
                       "gossip" if algorithm in ("dpsgd", "choco", "sgp", "adpsgd") else
                       "none" if algorithm == "local" else
                       exchange(s, "threshold2bit", p.get("sparse_collective"), **cp)[0] if algorithm == "bitsgd" else
                       collective)
    return pred


def _predict(s: Scenario, algorithm: str, compressor: str, overlap, comm: Cost, cp: dict, p: dict) -> Prediction:
    """predict's iteration time and bytes; `comm`: the exchange of the whole gradient through `compressor`."""
    tau = s.compute_s
    delta = s.compress_s(compressor) if compressor != "none" else 0.0
    sent = comm.sent
    if algorithm in ("bsp", "ssgd"):
        t = tau + delta + (max(0.0, comm.time - s.backward_fraction * tau) if overlap else comm.time)
        return Prediction(algorithm, t, tau, sent)
    if algorithm == "bitsgd":
        _, c2 = exchange(s, "threshold2bit")
        return Prediction(algorithm, cd.bitsgd(tau, c2.time, s.compress_s("threshold2bit")), tau, c2.sent)
    if algorithm == "odsgd":
        return Prediction(algorithm, cd.local_update(tau, comm.time), tau, sent)
    if algorithm == "cdsgd":
        k = int(p.get("k", 5))
        full = s.allreduce(s.nbytes)
        qc = compressor if compressor != "none" else "threshold2bit"   # the quantizer of compressed iterations
        quant, dq = exchange(s, qc)[1], s.compress_s(qc)
        # Yu et al. eq. 7 keeps one exchange in flight: T^cd = max(τ, φ^cd). Here iteration t+1's exchange starts
        # from the scheduler while t's is still on the link (t's average is applied at the end of t+1) and gloo
        # runs two collectives at once, so two iterations share one latency but not the link's bandwidth:
        # T = max(τ, φ^cd / slots, transfer). Measured on `wan`: 204 ms; eq. 7 alone predicted 361 ms.
        period = max(1, k)
        on_link = [(dq + quant.time, quant.transfer) if cd.compressed(i, k) else (full.time, full.transfer)
                   for i in range(period)]
        t = sum(max(tau, c / COLLECTIVE_SLOTS, transfer) for c, transfer in on_link) / period
        per = ((period - 1) * quant.sent + full.sent) / period
        return Prediction(algorithm, t, tau, per)
    if algorithm in ("localsgd", "postlocalsgd"):
        h = int(p.get("period", p.get("H", 4)))
        return Prediction(algorithm, tau + (delta + comm.time) / h, tau, sent / h)
    if algorithm == "diloco":
        # diloco's own `overlap` (τ_o inner steps, an int) arrives as predict's `overlap` argument (WFBP's flag
        # for the others: diloco's exchange starts during backward only on its sync steps, which τ_o covers)
        h, f, lag = int(p.get("period", 50)), int(p.get("fragments", 1)), int(overlap)
        k = max(1, h // f)
        sf = replace(s, params=s.params / f)    # one fragment: 1/F of the model, through the same exchange
        _, cf = exchange(sf, compressor, p.get("sparse_collective"), **cp)
        exposed = max(0.0, sf.compress_s(compressor) + cf.time - lag * tau)   # hidden by τ_o further inner steps
        return Prediction(algorithm, tau + exposed / k, tau, cf.sent / k, bytes_per_sync=cf.sent)
    if algorithm in ("asp", "ssp", "backup"):
        ps = ps_push_pull(s.link, s.workers, comm.sent if compressor != "none" else s.nbytes, s.nbytes, s.servers)
        own = tau + delta + 2 * s.link.alpha + (ps.sent + ps.received) * s.link.beta
        return Prediction(algorithm, max(own, ps.transfer), tau, ps.sent)
    if algorithm in ("dpsgd", "choco", "sgp", "adpsgd"):
        degree = int(p.get("degree", 2 if algorithm != "adpsgd" else 1))
        payload = s.nbytes if compressor == "none" else comm.sent / max(1e-12, 2 * (s.workers - 1) / s.workers)
        g = netcost.p2p(s.link, degree * payload)   # to `degree` neighbours and theirs back: α + d N β
        return Prediction(algorithm, tau + delta + g.time, tau, g.sent)
    if algorithm in ("dts", "delayed", "tsparse"):
        t_delay = int(p.get("delay", 1 if algorithm == "tsparse" else 4))
        period = int(p.get("period", 1 if algorithm == "delayed" else 4))
        exchange_s = delta + comm.time
        if t_delay == 1:   # the window's average is waited for at once (t = p = 1 is bsp)
            return Prediction(algorithm, tau + exchange_s / period, tau, sent / period)
        # the average of the window launched at step kp is applied at step (k+t−1)p: in steady state a window
        # lasts at least 1/(t−1) of an exchange, and at least 1/2 of one as gloo runs two collectives at a time;
        # the transfers share the link
        window = max(period * tau, exchange_s / min(t_delay - 1, COLLECTIVE_SLOTS), comm.transfer)
        return Prediction(algorithm, window / period, tau, sent / period)
    if algorithm == "local":
        return Prediction(algorithm, tau, tau, 0.0)
    raise KeyError(algorithm)
