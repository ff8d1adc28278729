"""The cost families: how an algorithm's schedule turns compute τ, compression δ and its exchanges into an
iteration time, one formula per family. An algorithm declares its family and that formula's parameters
(`thinwire.algorithms.cost.CostFamily`); `costmodel.predict` calls the family's formula with what one prediction
knows (`Inputs`) and the parameters (the caller's over the declared ones over the constructor's defaults).

A formula returns a `Step`: the iteration time, the bytes one worker sends per step, the bytes of one sync where
they come in bursts (DiLoCo), and what carries the exchange where that is not the exchange's own collective (the
parameter server, gossip, nothing). A family's `every_step` says whether every step's gradient is averaged (the
steps to a target are SGD's) rather than the models every few steps.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, NamedTuple

from ..algorithms.desloc import periods
from ..net import COLLECTIVE_SLOTS, Cost, Link
from ..net import cdsgd as cd
from ..net import cost as netcost


class Inputs(NamedTuple):
    """What a formula knows of one prediction."""
    s: Any                        # the scenario (`costmodel.Scenario`)
    compressor: str
    overlap: Any                  # WFBP's flag; DiLoCo's τ_o inner steps (an int)
    comm: Cost                    # one exchange of the whole gradient through `compressor`
    delta: float                  # its compression time δ (0 without a compressor)
    exchange: Callable            # (scenario, name=None) -> (collective, Cost) of one exchange there: through
    #                               `compressor` as predicted (its parameters, sparse collective), or `name`'s defaults


class Step(NamedTuple):
    iteration_s: float
    bytes_per_step: float
    bytes_per_sync: float = 0.0
    collective: str | None = None   # None: the exchange's own


def every_step(x: Inputs, p: dict) -> Step:
    """bsp: τ + δ + C (no overlap), τ + δ + max(0, C − τ_b) with WFBP."""
    s, tau = x.s, x.s.compute_s
    t = tau + x.delta + (max(0.0, x.comm.time - s.backward_fraction * tau) if x.overlap else x.comm.time)
    return Step(t, x.comm.sent)


# Yu, Dong, Xu, Ouyang, Liao 2021, "CD-SGD: Distributed Stochastic Gradient Descent with Compression and Delay
# Compensation", arXiv 2106.10796, eqs. 4–7 (`thinwire.net.cdsgd`), with its 2-bit quantizer
def quantized(x: Inputs, p: dict) -> Step:
    """BIT-SGD: T^bit = τ + δ + ψ (Yu et al. eq. 5), ψ the 2-bit quantizer's exchange."""
    collective, c2 = x.exchange(x.s, "threshold2bit")
    return Step(cd.bitsgd(x.s.compute_s, c2.time, x.s.compress_s("threshold2bit")), c2.sent, collective=collective)


def local_update(x: Inputs, p: dict) -> Step:
    """OD-SGD: T^loc = max(τ, φ) (Yu et al. eq. 4)."""
    return Step(cd.local_update(x.s.compute_s, x.comm.time), x.comm.sent)


def delay_compensated(x: Inputs, p: dict) -> Step:
    """CD-SGD (`k`): every k-th iteration a full-precision correction, the others through the quantizer (the
    compressor, else the 2-bit one). Yu et al. eq. 7 keeps one exchange in flight: T^cd = max(τ, φ^cd). Here
    iteration t+1's exchange starts from the scheduler while t's is still on the link (t's average is applied at
    the end of t+1) and gloo runs two collectives at once, so two iterations share one latency but not the link's
    bandwidth: T = max(τ, φ^cd / slots, transfer). Measured on `wan`: 204 ms; eq. 7 alone predicted 361 ms."""
    s, tau, k = x.s, x.s.compute_s, int(p["k"])
    full = s.allreduce(s.nbytes)
    qc = x.compressor if x.compressor != "none" else "threshold2bit"   # the quantizer of compressed iterations
    quant, dq = x.exchange(s, qc)[1], s.compress_s(qc)
    period = max(1, k)
    on_link = [(dq + quant.time, quant.transfer) if cd.compressed(i, k) else (full.time, full.transfer)
               for i in range(period)]
    t = sum(max(tau, c / COLLECTIVE_SLOTS, transfer) for c, transfer in on_link) / period
    return Step(t, ((period - 1) * quant.sent + full.sent) / period)


def periodic(x: Inputs, p: dict) -> Step:
    """Local SGD (`period` H): τ + (δ + C)/H."""
    h = int(p["period"])
    return Step(x.s.compute_s + (x.delta + x.comm.time) / h, x.comm.sent / h)


def diloco(x: Inputs, p: dict) -> Step:
    """DiLoCo (`period` H, `fragments` F, `overlap` τ_o): every K = H/F steps one fragment of N/F parameters is
    averaged (its exchange C_F, compression δ_F), started τ_o steps before it is waited for:
    τ + max(0, δ_F + C_F − τ_o τ)/K; F = 1, τ_o = 0 is local SGD's τ + (δ + C)/H. Its peak, the bytes of one sync,
    is `bytes_per_sync` (1/F of DiLoCo's). τ_o arrives as predict's `overlap` (WFBP's flag for the others: DiLoCo's
    exchange starts during backward only on its sync steps, which τ_o covers)."""
    s, tau = x.s, x.s.compute_s
    h, f, lag = int(p["period"]), int(p["fragments"]), int(x.overlap)
    k = max(1, h // f)
    sf = replace(s, params=s.params / f)    # one fragment: 1/F of the model, through the same exchange
    _, cf = x.exchange(sf)
    exposed = max(0.0, sf.compress_s(x.compressor) + cf.time - lag * tau)   # hidden by τ_o further inner steps
    return Step(tau + exposed / k, cf.sent / k, bytes_per_sync=cf.sent)


def desynced(x: Inputs, p: dict) -> Step:
    """DES-LOC (`period` K_x, `period_u` K_u, `period_v` K_v; Iacob et al. 2025, "DES-LOC: Desynced Low
    Communication Adaptive Optimizers for Training Foundation Models", arXiv 2505.22549): the parameters' deltas
    through the compressor every K_x steps, the two moments in full precision every K_u and K_v:
    τ + (δ + C)/K_x + C_32/K_u + C_32/K_v, bytes per step N/K_x + N/K_u + N/K_v (N: one exchange of the model)."""
    kx, ku, kv = periods(int(p["period"]), p.get("period_u"), p.get("period_v"))
    full = x.comm if x.compressor == "none" else x.exchange(x.s, "none")[1]
    return Step(x.s.compute_s + (x.delta + x.comm.time) / kx + full.time / ku + full.time / kv,
                x.comm.sent / kx + full.sent / ku + full.sent / kv)


def ps_push_pull(link: Link, n: int, up: float, down: float, servers: int = 1) -> Cost:
    """Parameter server with k servers, parameters sharded evenly: each worker pushes N_up/k to each server and
    pulls N_down/k back; a server's link receives n·N_up/k (incast) and sends n·N_down/k, so one round costs
    2α + (n N_up + n N_down)/k β on the servers' links (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient
    Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §IV-A, Table IV)."""
    k = max(1, servers)
    return Cost(2 * link.alpha, (n * up + n * down) / k * link.beta, up, down)


def parameter_server(x: Inputs, p: dict) -> Step:
    """ssp / asp: each worker τ + δ + its push/pull, bounded below by the servers' link (incast)."""
    s = x.s
    ps = ps_push_pull(s.link, s.workers, x.comm.sent if x.compressor != "none" else s.nbytes, s.nbytes, s.servers)
    own = s.compute_s + x.delta + 2 * s.link.alpha + (ps.sent + ps.received) * s.link.beta
    return Step(max(own, ps.transfer), ps.sent, collective="ps")


def push_pull(s, up: float, delta: float) -> tuple[float, Cost]:
    """(one worker's push of `up` bytes and pull of the model, δ + 2α + (N_up + N_down)β; the servers' cost of
    every worker's, `ps_push_pull`)."""
    ps = ps_push_pull(s.link, s.workers, up, s.nbytes, s.servers)
    return delta + 2 * s.link.alpha + (ps.sent + ps.received) * s.link.beta, ps


def asynchronous(x: Inputs, p: dict) -> Step:
    """Asynchronous DiLoCo (`period` H, `overlap` τ_o): every H inner steps each worker pushes its pseudo-gradient
    to the servers and pulls the model, waiting for no other worker: τ + max(0, δ + 2α + (N_up + N_down)β −
    τ_o τ)/H, bounded below by the servers' link, which carries every worker's push and pull once per H steps
    (`ps_push_pull`)."""
    tau, h, lag = x.s.compute_s, int(p["period"]), int(x.overlap)
    own, ps = push_pull(x.s, x.comm.sent if x.compressor != "none" else x.s.nbytes, x.delta)
    return Step(max(tau + max(0.0, own - lag * tau) / h, ps.transfer / h), ps.sent / h, bytes_per_sync=ps.sent,
                collective="ps")


def gossip(x: Inputs, p: dict) -> Step:
    """D-PSGD and its kin (`degree` d): τ + δ + α + dNβ, to d neighbours and theirs back."""
    s = x.s
    payload = s.nbytes if x.compressor == "none" else x.comm.sent / max(1e-12, 2 * (s.workers - 1) / s.workers)
    g = netcost.p2p(s.link, int(p["degree"]) * payload)
    return Step(s.compute_s + x.delta + g.time, g.sent, collective="gossip")


def delayed(x: Inputs, p: dict) -> Step:
    """DTS (`delay` t, `period` p; Zhu, Lu, Lin, Han 2019, "Distributed Training Across the World" (DTS), §3): a
    window of p steps launches one exchange, waited t−1 steps later: τ + max(0, C − (t−1)τ)/p, bounded below by
    C/(2p) (gloo runs two collectives at a time) and by the link's occupancy C_β/p."""
    tau, comm = x.s.compute_s, x.comm
    t_delay, period = int(p["delay"]), int(p["period"])
    exchange_s = x.delta + comm.time
    if t_delay == 1:   # the window's average is waited for at once (t = p = 1 is bsp)
        return Step(tau + exchange_s / period, comm.sent / period)
    # the average of the window launched at step kp is applied at step (k+t−1)p: in steady state a window
    # lasts at least 1/(t−1) of an exchange, and at least 1/2 of one as gloo runs two collectives at a time;
    # the transfers share the link
    window = max(period * tau, exchange_s / min(t_delay - 1, COLLECTIVE_SLOTS), comm.transfer)
    return Step(window / period, comm.sent / period)


def compressed_momentum(x: Inputs, p: dict) -> Step:
    """1-bit Adam and 0/1 Adam after the warm-up, a sync every `period` H steps (0/1 Adam's local steps; default 1):
    the compressed all-reduce with two-sided error feedback (`thinwire.exchange.twosided`). Each rank sends its n − 1
    chunks of the compressed tensor P (P/n each) point to point, then all-gathers the owners' compressed chunks:
    τ + ((1 + 1/n)δ + α + (n − 1)P/n β + ring all-gather of P/n)/H, 2(n − 1)P/n bytes per sync."""
    s, n, h = x.s, x.s.workers, int(p.get("period", 1))
    chunk = x.exchange(replace(s, workers=2))[1].sent / n    # (2 ranks: one rank's bytes are the payload P)
    comm = (netcost.p2p(s.link, (n - 1) * chunk) if n > 1 else netcost.ZERO) + \
        netcost.ring_allgather(s.collective_link, n, chunk)
    return Step(s.compute_s + ((1 + 1 / n) * x.delta + comm.time) / h, comm.sent / h, collective="two-sided")


def no_communication(x: Inputs, p: dict) -> Step:
    """local: τ, nothing sent."""
    return Step(x.s.compute_s, 0.0, collective="none")


class Family(NamedTuple):
    formula: Callable[[Inputs, dict], Step]
    every_step: bool


FAMILIES = {"every_step": Family(every_step, True), "quantized": Family(quantized, True),
            "local_update": Family(local_update, True), "delay_compensated": Family(delay_compensated, True),
            "periodic": Family(periodic, False), "diloco": Family(diloco, False), "desynced": Family(desynced, False),
            "parameter_server": Family(parameter_server, True), "gossip": Family(gossip, True),
            "delayed": Family(delayed, True), "async": Family(asynchronous, False),
            "compressed_momentum": Family(compressed_momentum, True),
            "none": Family(no_communication, False)}
