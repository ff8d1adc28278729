"""DiLoCo planned so that its sync is hidden: the settings a `diloco` cell that names none of them runs with.

For a model of N parameters, a measured compute time τ_c per inner step, W workers and the network, the planner
chooses the outer sync (its compressor with error feedback, its all-reduce algorithm), the fragments F, the period
H and how the sync is hidden behind inner steps:

- **One fragment's sync** costs C_F: compressing N/F elements (δ_F, the compressor's cost table) and the
  collective its payload travels on — the all-reduce algorithm's α-β cost (`thinwire.net.cost`; gloo's own ring
  pays a round trip per step, `Link.handshaking`; thinwire's point-to-point algorithms one latency per message), or
  gloo's ring all-gather for a payload that is gathered (fp4). On a two-tier network with islands of m workers
  (`replicas="island"`, hierarchical DiLoCo) each worker sends its N/(F m) shard over the thin link among the A
  islands, and the island gathers the shards over its fast link; with islands of different sizes m is the
  smallest island's (its workers carry the largest shards), and an inner step waits for the largest island's
  gradient all-reduce.
- **The τ rule** (Streaming DiLoCo's overlap, Douillard et al. 2025, arXiv 2501.18512 §2.3): τ = ⌈C_F / τ_c⌉
  inner steps hide the sync, so the fragment's pseudo-gradient is taken τ steps before it is needed; τ must stay
  below K = H/F (one fragment in flight) and at most K/2 (the merge mixes the fragment's last τ local steps with the
  global parameters, α = 0.5 as the paper overlaps: a longer overlap loses more progress). Where no such τ exists the sync is hidden
  behind a whole period by **eager updates** (Kale, Douillard, Donchev 2025, arXiv 2502.12996; F = 1, the
  paper's setting), if it fits in H steps.
- **The link's occupancy**: one fragment's transfer per K steps must fit in K inner steps, whatever hides the
  latency; the predicted step is τ_c + what is not hidden / K, at least that transfer / K.
- **Choice**, among the configurations whose predicted scalability τ_c / step reaches the target (0.95: exposed
  communication ≤ 5 % of the time): streaming over eager updates (measured on stdlib-lm: eager updates at H = 16
  and 32 did not reach the loss plain DiLoCo reached at H = 16 and 64 in 240 steps, BENCHMARKS.md), the smallest
  H of PERIODS, the least share τ/K of a fragment's window overlapped (its local steps are replaced at the merge),
  the fewest fragments, the most bits (fp32, then int8, then fp4, each lower one with error feedback) and gloo's
  own all-reduce over a point-to-point one — the least convergence risk that the network allows. If nothing
  reaches the target, the highest scalability.
- **Workers of different speeds** (`Scenario.speeds`; docs/planner.md): synchronous DiLoCo steps at its slowest
  worker's pace; with dynamic local updates (`dynamic=True`) a round is H steps of the fastest worker and
  H s_i / s_max of worker i, so the workers run at the sum of their speeds (Liu et al. 2024, "Asynchronous
  Local-SGD Training for Language Modeling", arXiv 2401.09135, §4.2); `async-diloco` pushes each worker's
  pseudo-gradient to the servers and waits for none (Delayed Nesterov, Liu et al. 2024 §4.1), or, with a quorum
  K, for the K fastest (Douillard et al. 2026, "Decoupled DiLoCo", arXiv 2604.21428), the others' work merging a
  round later. Among the variants that reach the target the least stale is chosen: synchronous, dynamic, quorum,
  asynchronous (a pseudo-gradient applied on arrival was computed from a model up to n − 1 updates old). At equal
  speeds only synchronous DiLoCo is weighed; under straggler episodes alone, synchronous and dynamic (see
  `variants_of`).
Latency dominates on a far link (`world`: gloo's ring all-reduce of 4 workers pays 6 round trips of 300 ms before a
byte of bandwidth counts), and there recursive doubling (2 rounds of one latency) is picked; bytes dominate on a
thin one (`home`), and there the 4-bit payload is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import product

from ..algorithms.diloco_outer import outer_defaults
from ..compress import compressors
from ..exchange.choose import wire_bits
from ..net import Cost, Islands
from ..net import cost as netcost
from .costmodel import Scenario, exchange, predict
from .families import push_pull

# H from 32: on stdlib-lm (4 workers, loss 2.5, `lan`) plain DiLoCo took 160 steps at H = 16, 136 at H = 32 and
# 144 at H = 64 (BENCHMARKS.md, "Predict, then race"): below 32 more syncs bought no convergence here
PERIODS = (32, 40, 50, 64, 80, 100, 128, 200, 256)
OUTER = (("none", None, 32), ("int8", "residual", 8), ("fp4", "residual", 4))
ALGORITHMS = ("gloo", "recursive_doubling", "double_binary_tree", "ring")
FRAGMENTS = (1, 2, 4)
TARGET = 0.95
# with overlap, the merge keeps half of the fragment's local steps meanwhile: θ ← ½ θ_local + ½ θ̃ (Streaming DiLoCo
# §2.3 mixes with α = 0.5 when it overlaps). Measured on stdlib-lm (H = 32, τ = 7, fp4; 4 workers, loss 2.5): 144
# steps with α = 0.5 against 160 with α = 0, and 136 without overlap (BENCHMARKS.md, "Predict, then race")
OVERLAP_ALPHA = 0.5
# DiLoCo's ways with workers of different speeds, least stale first (the choice's order; see the module doc)
VARIANTS = ("sync", "dynamic", "quorum", "async")


@dataclass
class Plan:
    """The planned DiLoCo: its parameters and what the planner predicts for it."""
    period: int
    fragments: int
    overlap: int
    eager: bool
    compressor: str
    memory: str | None
    allreduce: str
    replicas: str
    bits: int
    iteration_s: float       # predicted mean step
    sync_s: float            # predicted time of one fragment's sync (compression included)
    transfer_s: float        # of which the link is busy
    bytes_per_sync: float    # one worker, one fragment sync (over the thin link, on a two-tier network)
    compute_s: float         # the no-communication reference's mean step (at the workers' speeds)
    variant: str = field(default="sync", repr=False)   # of VARIANTS
    quorum: int = field(default=0, repr=False)         # the quorum K of `async-diloco` (variant "quorum")

    @property
    def scalability(self) -> float:
        return self.compute_s / self.iteration_s

    @property
    def algorithm(self) -> str:
        """What the cell runs: `diloco` (synchronous, or dynamic local updates) or `async-diloco` (servers)."""
        return "async-diloco" if self.variant in ("quorum", "async") else "diloco"

    def params(self, inner: str | None = None) -> dict:
        """The cell's parameters (the compressor and memory go on the cell itself); with `inner`, the inner
        optimizer's name, DiLoCo's outer SGD settings for it at this period (`outer_defaults`: the rule DiLoCo
        applies to the outer settings a run leaves unset)."""
        out = {"period": self.period}
        if self.algorithm == "async-diloco":
            return {**out, **({"overlap": self.overlap} if self.overlap else {}),
                    **({"quorum": self.quorum} if self.quorum else {})}
        if inner is not None:
            out.update({k: v for k, v in outer_defaults(self.period, inner).items() if k != "nesterov"})
        if self.fragments > 1:
            out["fragments"] = self.fragments
        if self.overlap:
            out["overlap"] = self.overlap
            out["alpha"] = OVERLAP_ALPHA
        if self.eager:
            out["eager"] = True
        if self.allreduce != "gloo":
            out["allreduce"] = self.allreduce
        if self.replicas != "worker":
            out["replicas"] = self.replicas
        if self.variant == "dynamic":
            out["dynamic"] = True
        return out

    def describe(self) -> str:
        hide = (f"eager updates (the sync hidden behind the whole period of {self.period} steps)" if self.eager else
                f"overlap τ = {self.overlap} steps (τ·step ≥ the sync)" if self.overlap else "no overlap")
        bits = "fp32" if self.compressor == "none" else f"{self.compressor} + {self.memory}"
        where = ", one replica per island (data parallel inside)" if self.replicas == "island" else ""
        how = {"sync": "", "dynamic": "dynamic local updates, ", "async": "asynchronous (async-diloco), ",
               "quorum": f"a quorum of {self.quorum} (async-diloco), "}[self.variant]
        if self.algorithm == "async-diloco":
            return (f"{how}H={self.period}, {hide}, {bits} pushes to the servers ({self.sync_s * 1e3:.0f} ms a push "
                    f"and pull): predicted step "
                    f"{self.iteration_s * 1e3:.0f} ms, scalability {self.scalability:.2f}")
        return (f"{how}H={self.period}, F={self.fragments}, {hide}, {bits} outer gradients on "
                f"{'gloo' if self.allreduce == 'gloo' else self.allreduce} ({self.sync_s * 1e3:.0f} ms a sync"
                f"{where}): predicted step {self.iteration_s * 1e3:.0f} ms, scalability {self.scalability:.2f}")


def fragment_sync(s: Scenario, compressor: str, allreduce: str, fragments: int,
                  islands: Islands | None = None) -> tuple[float, Cost]:
    """(compression time, collective cost) of one fragment's outer sync for one worker."""
    n, link, numel = s.workers, s.link, s.params / fragments
    if islands is not None and islands.size > 1:     # the shard of a worker of the smallest island
        n, link, numel = islands.islands, islands.across, numel / min(islands.sizes)
    delta = 0.0 if compressor == "none" else replace(s, params=numel).compress_s(compressor)
    if compressor == "none":
        coll, payload = "allreduce", numel * s.bytes_per_param
    else:
        coll, bits = wire_bits(compressors.get(compressor), int(numel), n, allreduce,
                               link.handshaking() if allreduce == "gloo" else link)
        payload = bits * numel / 8
    if n <= 1:
        return delta, netcost.ZERO
    if coll in ("allreduce", "custom"):
        cost = (netcost.ring_allreduce(link.handshaking(), n, payload) if allreduce == "gloo" else
                netcost.ALLREDUCE[allreduce](link, n, payload))
    else:                    # gathered (fp4, fp8): gloo's ring all-gather
        cost = netcost.ring_allgather(link.handshaking(), n, payload)
    return delta, cost


def inside_step_s(s: Scenario, islands: Islands | None) -> float:
    """The island's gradient all-reduce an inner step of hierarchical DiLoCo waits for (gloo's ring, inside; the
    largest island's, the slowest)."""
    if islands is None or islands.size <= 1:
        return 0.0
    return netcost.ring_allreduce(islands.inside.handshaking(), islands.size, s.nbytes).time


def predict_diloco(s: Scenario, compressor: str, allreduce: str, fragments: int, period: int, overlap: int,
                   eager: bool, islands: Islands | None = None) -> tuple[float, float, Cost]:
    """(predicted mean step, one fragment's sync time, its collective cost) of this DiLoCo."""
    tau = s.compute_s + inside_step_s(s, islands)
    delta, cost = fragment_sync(s, compressor, allreduce, fragments, islands)
    sync = delta + cost.time
    k = period // fragments
    hidden = period * tau if eager else overlap * tau
    step = tau + max(0.0, sync - hidden) / k
    return max(step, cost.transfer / k), sync, cost      # the link carries one fragment's transfer per K steps


def quorum_of(speeds) -> int:
    """The quorum K for workers of these speeds: of the K that keep the most of the speeds' sum (the K fastest run
    at the K-th fastest's pace, the others at their own), the largest (the most replicas merged at once); 0 for
    fewer than 3 workers (a quorum of 1 is asynchronous)."""
    v = sorted(speeds, reverse=True)
    kept = {k: k * v[k - 1] + sum(v[k:]) for k in range(2, len(v))}
    best = max(kept.values(), default=0.0)
    return max((k for k, x in kept.items() if x >= best * (1 - 1e-9)), default=0)


def variants_of(s: Scenario, replicas: str, given: dict) -> list[str]:
    """The variants weighed (VARIANTS): synchronous only at equal speeds or on islands; dynamic where `given`
    names it."""
    if given.get("dynamic"):
        return ["dynamic"]
    if not s.unequal or replicas != "worker" or "dynamic" in given:
        return ["sync"]
    sync_only = given.get("fragments", 1) != 1 or given.get("eager") or given.get("allreduce", "gloo") != "gloo"
    # Straggler episodes alone (no lasting difference in speed): the servers' variants are not weighed. On the LM
    # with 4 workers on `world` (each worker, each step, 2 % chance of 10 steps at a quarter speed; 3 seeds),
    # asynchronous DiLoCo ran at 0.80-0.89 of the reference's throughput but reached loss 2.5 in one seed of three,
    # where synchronous and dynamic DiLoCo reached it in all three (34-48 s): the staleness it pays in steps is
    # larger than this model charges, and episodes of a few steps are what a round of H steps absorbs anyway.
    episodes_only = s.stragglers is not None and len(set(s.speeds)) == 1
    out = ["sync"] + ([] if given.get("eager") else ["dynamic"])
    return out + ([] if sync_only or episodes_only else
                  (["quorum"] if quorum_of(s.speeds) else []) + ["async"])


def on_servers(s: Scenario, given: dict, variant: str) -> list[Plan]:
    """`async-diloco`'s configurations (no fragments, no eager updates): each period and outer compressor, the
    push hidden behind τ = ⌈push / τ_c⌉ inner steps of the fastest worker where τ <= H/2."""
    outer = [o for o in OUTER if given.get("compressor", o[0]) == o[0]] or [(given["compressor"], None, 32)]
    periods = [given["period"]] if "period" in given else list(PERIODS)
    k = quorum_of(s.speeds) if variant == "quorum" else 0
    tau = s.compute_s / max(s.speeds)
    out = []
    for (comp, mem, bits), h in product(outer, periods):
        up = exchange(s, comp)[1].sent if comp != "none" else s.nbytes
        sync, ps = push_pull(s, up, s.compress_s(comp) if comp != "none" else 0.0)
        lag = math.ceil(sync / tau - 1e-9) if tau > 0 else 0
        lag = int(given["overlap"]) if "overlap" in given else lag if lag <= h // 2 and lag < h else 0
        pred = predict(s, "async-diloco", comp, overlap=lag, period=h, quorum=k)
        out.append(Plan(h, 1, lag, False, comp, given.get("memory", mem), "gloo", "worker", bits, pred.iteration_s,
                        sync, ps.transfer, ps.sent, pred.compute_s, variant, k))
    return out


def candidates(s: Scenario, islands: Islands | None = None, given: dict | None = None) -> list[Plan]:
    """Every configuration the planner weighs (`given` fixes any of compressor, memory, period, fragments, overlap,
    eager, allreduce, replicas, dynamic), each with the least overlap that hides its sync (the τ rule) or eager
    updates; with workers of different speeds, each variant of VARIANTS that applies."""
    given = dict(given or {})
    two_tier = islands is not None and islands.size > 1
    replicas = given.get("replicas", "island" if two_tier else "worker")
    out = []
    for variant in variants_of(s, replicas, given):
        if variant in ("quorum", "async"):
            out += on_servers(s, given, variant)
            continue
        if not s.unequal:
            out += [p if variant == "sync" else replace(p, variant=variant)
                    for p in synchronous(s, islands, given, replicas)]
            continue
        fast = max(s.speeds)     # a round waits at each sync (every K = H/F steps) for the worker caught the most
        at = s.at_speed(fast if variant == "dynamic" else min(s.speeds) if s.stragglers else s.slowest)
        scale = 1.0 if variant == "sync" else len(s.speeds) * fast / sum(s.speeds)
        out += [replace(p, iteration_s=p.iteration_s * scale * s.round_factor(p.period // p.fragments),
                        compute_s=s.reference_s, variant=variant)
                for p in synchronous(at, islands, given, replicas) if not (variant == "dynamic" and p.eager)]
    return out


def synchronous(s: Scenario, islands: Islands | None, given: dict, replicas: str) -> list[Plan]:
    """Synchronous DiLoCo's configurations for workers all at scenario `s`'s compute time."""
    isl = islands if replicas == "island" else None
    outer = [o for o in OUTER if given.get("compressor", o[0]) == o[0]]
    if "compressor" in given and not outer:
        outer = [(given["compressor"], given.get("memory"), 32)]
    # hierarchical DiLoCo's inner all-reduces share the engine with the outer sync: gloo's own collectives only
    algos = [a for a in (("gloo",) if isl is not None and isl.size > 1 else ALGORITHMS)
             if given.get("allreduce", a) == a]
    frags = [f for f in FRAGMENTS if given.get("fragments", f) == f] or [given["fragments"]]
    periods = [given["period"]] if "period" in given else list(PERIODS)
    tau = s.compute_s + inside_step_s(s, isl)
    out = []
    for (comp, mem, bits), algo, f, h in product(outer, algos, frags, periods):
        if h % f:
            continue
        k = h // f
        delta, cost = fragment_sync(s, comp, algo, f, isl)
        sync = delta + cost.time
        lag = math.ceil(sync / tau - 1e-9) if tau > 0 else 0
        if "overlap" in given or "eager" in given:
            lag, eager = int(given.get("overlap", 0)), bool(given.get("eager", False))
        else:       # the τ rule, else eager updates (F = 1), else nothing hides the sync
            lag, eager = (lag, False) if lag <= k // 2 and lag < k else (0, f == 1)
        step, sync, cost = predict_diloco(s, comp, algo, f, h, lag, eager, isl)
        out.append(Plan(h, f, lag, eager, comp, given.get("memory", mem), algo, replicas, bits, step, sync,
                        cost.transfer, cost.sent, s.compute_s))
    return out


def plan_diloco(s: Scenario, islands: Islands | None = None, given: dict | None = None,
                target: float = TARGET) -> Plan:
    """The planned DiLoCo for scenario `s` (see the module's doc)."""
    plans = candidates(s, islands, given)
    reached = [p for p in plans if p.scalability >= target]
    if reached:
        return min(reached, key=lambda p: (VARIANTS.index(p.variant), p.eager, p.period,
                                           p.overlap * p.fragments / p.period, p.fragments, -p.bits,
                                           p.allreduce != "gloo", p.iteration_s))
    return max(plans, key=lambda p: (round(p.scalability, 3), -VARIANTS.index(p.variant), p.bits, -p.period,
                                     -p.fragments))
