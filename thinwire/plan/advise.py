"""`thinwire advise`: rank algorithm + compressor configurations for a model, a compute time and a network."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from ..compress import compressors
from ..errors import UserError
from ..exchange.sparse import SPARSE_COLLECTIVES
from .costmodel import Prediction, Scenario, cost_of, predict
from .diloco import quorum_of

# what each sparse collective changes for convergence (thinwire/exchange/sparse.py), appended to the row's note
SPARSE_NOTES = {"allgather": "", "gtopk": "; gTop-k: the global top k of the sum, the rest back to residuals",
                "shared": "; shared-index: one leader's k indices per step", "hierarchical":
                "; hierarchical: dense reduce in groups, top-k of group sums"}

# (label, algorithm, compressor, params, convergence note drawn from the papers' results). The notes cite short:
#   Tang et al. 2020: Tang, Shi, Chu, Wang, Li, "Communication-Efficient Distributed Deep Learning: A Comprehensive
#     Survey", arXiv 2003.06307;
#   Alistarh et al. 2017: "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding", arXiv 1610.02132;
#   Stich et al. 2018: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", arXiv 1809.07599;
#   Lin et al. 2018: "Deep Gradient Compression", arXiv 1712.01887;
#   Shi et al. 2019: Shi, Chu, Cheung, See, "Understanding Top-k Sparsification in Distributed Deep Learning",
#     arXiv 1911.08772;
#   Vogels et al. 2019: "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
#     arXiv 1905.13727;
#   Yu et al. 2021: Yu, Dong, Xu, Ouyang, Liao, "CD-SGD: Distributed Stochastic Gradient Descent with Compression
#     and Delay Compensation", arXiv 2106.10796;
#   Zhu et al. 2019: Zhu, Lu, Lin, Han, "Distributed Training Across the World" (DTS).
CANDIDATES = [
    ("bsp", "bsp", "none", {}, "exact synchronous SGD: the accuracy reference (Tang et al. 2020, §III-A)"),
    ("bsp + WFBP overlap", "bsp", "none", {"overlap": True}, "same trajectory as bsp; hides comm behind backward"),
    ("bsp + fp16", "bsp", "fp16", {}, "half precision: negligible accuracy loss in practice"),
    ("bsp + qsgd(s=16)", "bsp", "qsgd", {"levels": 16}, "unbiased, bounded variance: converges like SGD with more noise (Alistarh et al. 2017)"),
    ("bsp + topk(1%) + EF", "bsp", "topk", {"ratio": 0.01}, "biased, 100x compression: needs error feedback; EF keeps SGD's rate (Stich et al. 2018)"),
    ("bsp + dgc(0.1%) + EF", "bsp", "dgc", {"ratio": 0.001}, "sampled-threshold top-k; with momentum correction and warm-up DGC reports 270-600x (Lin et al. 2018)"),
    ("bsp + gaussiank(1%) + EF", "bsp", "gaussiank", {"ratio": 0.01}, "Gaussian-threshold top-k: about k kept, cheaper to select (Shi et al. 2019)"),
    ("bsp + randomk(1%) + EF", "bsp", "randomk", {"ratio": 0.01}, "random k, shared seed: one all-reduce of k values; needs memory (Stich et al. 2018)"),
    ("bsp + powersgd(r=4) + EF", "bsp", "powersgd", {"rank": 4}, "biased low-rank with EF: near-SGD accuracy at rank 2-4 (Vogels et al. 2019)"),
    ("bitsgd (2-bit)", "bitsgd", "none", {}, "2-bit threshold + residual: small accuracy loss (Yu et al. 2021, Table 2)"),
    ("odsgd (local update)", "odsgd", "none", {}, "one-step delayed update: compensated by the local step (Yu et al. 2021, eq. 4)"),
    ("cdsgd k=5", "cdsgd", "none", {"k": 5}, "within 0.1-0.5 pp of S-SGD in Yu et al. 2021's experiments"),
    ("localsgd H=4", "localsgd", "none", {"period": 4}, "model averaging every 4 steps: mild drift between workers"),
    ("localsgd H=16", "localsgd", "none", {"period": 16}, "more drift; may need more steps to the same accuracy"),
    ("dts t=4 p=4", "dts", "none", {"delay": 4, "period": 4}, "no accuracy loss in Zhu et al. 2019; here (t-1)p=12 stale steps cost 2-7 pp under momentum 0.9 (docs/dts.md)"),
    ("dts t=20 p=4", "dts", "none", {"delay": 20, "period": 4}, "tolerates latency up to ~20 windows of compute (Zhu et al. 2019, §3); 76 stale steps: use small lr or no momentum"),
    ("asp (1 server)", "asp", "none", {}, "stale gradients: often converges worse (Tang et al. 2020, §III-C)"),
    ("ssp", "ssp", "none", {}, "bounded staleness: converges at O(1/sqrt T) (Tang et al. 2020, §III-B)"),
    ("dpsgd ring", "dpsgd", "none", {"degree": 2}, "decentralized: consensus error shrinks with the spectral gap"),
    ("diloco H=50", "diloco", "none", {"period": 50}, "DiLoCo (outer Nesterov on the averaged pseudo-gradient): near-synchronous quality at H 50-500 on LMs, drift grows with H (Douillard et al. 2023)"),
    ("diloco H=100 + fp8", "diloco", "fp8", {"period": 100}, "8-bit outer gradients, fp32 accumulation: no measurable loss in Streaming DiLoCo (2025)"),
    ("diloco H=100 F=4 τ=1 fp4", "diloco", "fp4", {"period": 100, "fragments": 4, "overlap": 1}, "Streaming DiLoCo: 1/4 of the model per sync, each hidden behind one inner step; 4-bit e3m0 outer gradients as in the paper"),
]

# with workers of different speeds, also (the quorum's K from the speeds, `diloco.quorum_of`):
#   Liu et al. 2024: Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous Local-SGD Training
#     for Language Modeling", arXiv 2401.09135; Douillard et al. 2026: "Decoupled DiLoCo", arXiv 2604.21428.
SPEED_CANDIDATES = [
    ("diloco H=50 dynamic", "diloco", "none", {"period": 50, "dynamic": True}, "dynamic local updates: each worker's inner steps per round follow its speed, merged weighted by samples (Liu et al. 2024, §4.2)"),
    ("async-diloco H=50 quorum", "async-diloco", "none", {"period": 50, "quorum": None}, "the first K pushes merge, weighted by samples; a late one merges a round later (Douillard et al. 2026)"),
    ("async-diloco H=50", "async-diloco", "none", {"period": 50}, "each pseudo-gradient applied on arrival with Delayed Nesterov (Liu et al. 2024, §4.1): up to n-1 updates stale"),
]

# what `recommend_diloco` searches: periods (ascending), outer-gradient bits, fragments, overlap
DILOCO_PERIODS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 80, 100, 128, 200, 250, 500, 1000)
DILOCO_BITS = (("none", 32), ("fp8", 8), ("fp4", 4))
DILOCO_FRAGMENTS = (1, 2, 4, 8)
DILOCO_OVERLAP = (0, 1, 2)


@dataclass
class Advice:
    label: str
    prediction: Prediction
    note: str

    def row(self) -> dict:
        p = self.prediction
        return {"config": self.label, "algorithm": p.name, "collective": p.collective, "iteration_s": p.iteration_s,
                "scalability": p.scalability, "bytes_per_step": p.bytes_per_step,
                **({"bytes_per_sync": p.bytes_per_sync} if p.bytes_per_sync else {}), "note": self.note}


def _variants(comp: str, params: dict) -> list:
    """A sparsifying compressor runs on each sparse collective (all-gather, gTop-k, shared-index, hierarchical);
    every other configuration on the one collective its algebra allows."""
    try:
        own = {k: v for k, v in params.items() if comp == "none" or compressors.accepts(comp, k)}
        sparse = comp != "none" and compressors.get(comp, **own).is_sparse   # (not the algorithm's: diloco's period)
    except (KeyError, UserError):
        return []
    return list(SPARSE_COLLECTIVES) if sparse else [None]


def check_scenario(s: Scenario) -> None:
    """A scenario the cost model can rank: finite, positive sizes and times (NaN would sort arbitrarily)."""
    if not 0 < s.params < math.inf:
        raise UserError(f"params must be a finite number > 0, got {s.params}")
    if not 0 <= s.compute_s < math.inf:
        raise UserError(f"compute time must be a finite number of seconds >= 0, got {s.compute_s}")
    if isinstance(s.workers, bool) or not isinstance(s.workers, int) or s.workers < 1:
        raise UserError(f"workers must be an integer >= 1, got {s.workers!r}")
    if isinstance(s.servers, bool) or not isinstance(s.servers, int) or s.servers < 0:
        raise UserError(f"servers must be an integer >= 0, got {s.servers!r}")
    if s.speeds is not None and (len(s.speeds) != s.workers or not all(0 < f <= 1 for f in s.speeds)):
        raise UserError(f"speeds must give one factor in (0, 1] per worker ({s.workers}), got {s.speeds!r}")


def advise(s: Scenario) -> list[Advice]:
    """Every candidate configuration (each sparse collective of a sparsifier a row of its own), fastest first."""
    check_scenario(s)
    out = []
    for label, alg, comp, params, note in CANDIDATES + (SPEED_CANDIDATES if s.unequal else []):
        if params.get("quorum", 0) is None:     # the quorum these speeds call for, if any
            params = {**params, "quorum": quorum_of(s.speeds)}
            if not params["quorum"]:
                continue
            label = label.replace("quorum", f"quorum {params['quorum']}")
        for collective in _variants(comp, params):
            p = dict(params)
            overlap = p.pop("overlap", False)
            if collective is not None:
                p["sparse_collective"] = collective
            try:
                pred = predict(s, alg, comp, overlap=overlap, **p)
            except (KeyError, UserError):  # a compressor or algorithm this build does not register
                continue
            if cost_of(alg).family in ("parameter_server", "async") and s.servers < 1:
                continue
            out.append(Advice(label, pred, note + SPARSE_NOTES.get(collective or "", "")))
    out.sort(key=lambda a: a.prediction.iteration_s)
    return out


def recommend_diloco(s: Scenario, target: float = 0.9) -> dict:
    """H, fragments, overlap and bits of the DiLoCo family for this network: the smallest period H whose predicted
    scalability reaches `target` (the DiLoCo paper's quality falls as H grows, so H is kept as small as the
    network allows), then the most bits (quantization is the next risk), the fewest fragments and the least
    overlap (staleness). Streaming (fragments, overlap) wins where hiding a fragment's sync behind inner steps
    lets a smaller H reach the target. Returns the choice with its prediction, whether the target was reached,
    and the best option per (bits, fragments, overlap)."""
    check_scenario(s)
    if not 0 < target <= 1:
        raise UserError(f"target scalability must be in (0, 1], got {target}")
    options = []
    for (comp, bits), f, lag in product(DILOCO_BITS, DILOCO_FRAGMENTS, DILOCO_OVERLAP):
        periods = [h for h in DILOCO_PERIODS if h % f == 0 and lag < h // f]
        for h in periods:   # stops at the first period reaching the target, else at the longest
            pred = predict(s, "diloco", comp, period=h, fragments=f, overlap=lag)
            if pred.scalability >= target:
                break
        if periods:
            options.append({"period": h, "fragments": f, "overlap": lag, "compressor": comp, "bits": bits,
                            "reached": pred.scalability >= target, "iteration_s": pred.iteration_s,
                            "scalability": pred.scalability, "bytes_per_sync": pred.bytes_per_sync,
                            "bytes_per_step": pred.bytes_per_step})
    reached = [o for o in options if o["reached"]]
    choice = (min(reached, key=lambda o: (o["period"], -o["bits"], o["fragments"], o["overlap"])) if reached else
              max(options, key=lambda o: (o["scalability"], o["bits"], -o["fragments"])))
    plain = predict(s, "diloco", "none", period=choice["period"])
    return {"target": target, **choice, "plain_bytes_per_sync": plain.bytes_per_sync, "options": options}


def format_diloco(rec: dict) -> str:
    mb = 1e6
    bits = "32-bit" if rec["compressor"] == "none" else f"{rec['compressor']} ({rec['bits']}-bit)"
    stream = (f"{rec['fragments']} fragments" if rec["fragments"] > 1 else "no fragments") + (
        f", overlap {rec['overlap']}" if rec["overlap"] else "")
    head = (f"DiLoCo family: period H={rec['period']}, {stream}, {bits} outer gradients -> scalability "
            f"{rec['scalability']:.3f}" + ("" if rec["reached"] else f" (target {rec['target']} not reached)"))
    return (head + f"\n  {rec['bytes_per_sync'] / mb:.3f} MB per sync (plain DiLoCo at H={rec['period']}: "
            f"{rec['plain_bytes_per_sync'] / mb:.3f} MB), {rec['bytes_per_step'] / mb:.4f} MB per step; "
            f"`--algorithm diloco --period {rec['period']}"
            + (f" --fragments {rec['fragments']}" if rec["fragments"] > 1 else "")
            + (f" --overlap {rec['overlap']}" if rec["overlap"] else "")
            + ("" if rec["compressor"] == "none" else f" --compressor {rec['compressor']}") + "`")


def format_table(rows: list[Advice], s: Scenario) -> str:
    lines = [f"{s.params / 1e6:.1f} M params, compute {s.compute_s * 1e3:.0f} ms/iteration, {s.workers} workers, "
             f"network {s.link.name} ({'unlimited' if s.link.bandwidth is None else f'{s.link.bandwidth / 1e6:.0f} Mbit/s'}, "
             f"{s.link.latency * 1e3:.1f} ms one-way)" + (
                 f"; speeds {', '.join(f'{f:g}' for f in s.speeds)}" + (f" (a lockstep step at {s.slowest:.3g})"
                                                                        if s.lockstep_speed else "")
                 + ": scalability against the same workers without communication" if s.unequal else ""),
             f"{'rank':>4}  {'configuration':<26} {'collective':<12} {'iteration':>10} {'scalability':>11} "
             f"{'MB/step':>9}  convergence risk"]
    for i, a in enumerate(rows, 1):
        p = a.prediction
        lines.append(f"{i:>4}  {a.label:<26} {p.collective:<12} {p.iteration_s * 1e3:>8.1f}ms {p.scalability:>11.3f} "
                     f"{p.bytes_per_step / 1e6:>9.2f}  {a.note}")
    return "\n".join(lines)


# -- defaults that suit the network ---------------------------------------------------------------------------
# The parameters the planner picks for an algorithm named without them: each with its candidates, least stale first
# (`CostFamily.tunable`). Staleness is what costs accuracy: steps between a gradient and its global application
# ((t-1)p + p for DTS, the period of model averaging, CD-SGD's k steps between full-precision corrections); the
# algorithm declares the most the planner may give it under momentum SGD and under plain SGD
# (`CostFamily.max_staleness`, with its measurements).
WITHIN = 0.25   # the least stale setting whose predicted step is within 25 % of the fastest candidate's


def staleness_bound(momentum: float, algorithm: str = "dts") -> int | None:
    """The most staleness `tune` gives `algorithm` under SGD with this momentum ((t − 1)·p for DTS and delayed
    update, k for CD-SGD); None for an algorithm without a bound."""
    bounds = cost_of(algorithm).max_staleness
    return None if bounds is None else bounds[0 if momentum > 0 else 1]


def _unapplied(family: str, p: dict) -> int:
    """The quantity a staleness bound bounds: (t − 1)·p, the steps a window's average waits after its launch (DTS,
    delayed update; Zhu, Lu, Lin, Han 2019, "Distributed Training Across the World" (DTS), §3), or CD-SGD's k."""
    if family == "delay_compensated":
        return int(p.get("k", 1))
    return (int(p.get("delay", 1)) - 1) * int(p.get("period", 1))


def _staleness(family: str, p: dict) -> float:
    if family == "delayed":
        return _unapplied(family, p) + int(p.get("period", 1))
    return float(p.get("period", p.get("k", 1)))


def tune(algorithm: str, s: Scenario, given: dict | None = None, compressor: str = "none",
         momentum: float = 0.9) -> tuple[dict, str]:
    """Parameters of `algorithm` that suit scenario `s`, for the tunable ones `given` leaves out, and why in a
    few words ({} and "" when there is nothing to pick).

    Rule: among the candidate settings (`CostFamily.tunable`), the least stale one whose predicted step time
    (`costmodel.predict`) is within WITHIN of the fastest candidate's: as fast as the network allows, with as
    little staleness (hence accuracy risk) as that speed needs. For DTS and delayed update only settings within
    the accuracy bound for SGD with `momentum` are candidates ((t − 1)·p, resp. CD-SGD's k, ≤
    `staleness_bound(momentum, algorithm)`; if the parameters given leave none, the least stale)."""
    given = dict(given or {})
    declared = cost_of(algorithm)
    family, grid = declared.family, declared.tunable
    free = {k: v for k, v in grid.items() if k not in given}
    if not free:
        return {}, ""
    check_scenario(s)
    fixed = {k: v for k, v in given.items() if k in ("delay", "period", "k", "ratio", "rank", "levels", "threshold")}
    combos = [dict(zip(free, values)) for values in product(*free.values())]
    if family == "delayed":
        combos = [c for c in combos if (c.get("delay", fixed.get("delay")), c.get("period", fixed.get("period")))
                  != (1, 1)] or combos  # t = p = 1 is bsp
    bound = staleness_bound(momentum, algorithm)
    if bound is not None:
        stale = lambda c: _unapplied(family, {**fixed, **c})
        combos = [c for c in combos if stale(c) <= bound] or [min(combos, key=stale)]
    scored = []
    for c in combos:
        try:
            pred = predict(s, algorithm, compressor, **{**fixed, **c})
        except (KeyError, UserError, TypeError, ValueError):
            continue
        scored.append((pred.iteration_s, _staleness(family, {**fixed, **c}), c))
    if not scored:
        return {}, ""
    fastest = min(t for t, _, _ in scored)
    step, _, pick = min((x for x in scored if x[0] <= fastest * (1 + WITHIN)), key=lambda x: (x[1], x[0]))
    link = s.link
    bw = "unlimited" if link.bandwidth is None else f"{link.bandwidth / 1e6:g} Mbit/s"
    why = (f"planner: {link.name} ({bw}, {link.latency * 1e3:g} ms), {s.params / 1e6:.2g} M params, compute "
           f"{s.compute_s * 1e3:.0f} ms/step; least stale within {WITHIN:.0%} of the fastest predicted step "
           f"({step * 1e3:.0f} ms)")
    if bound is not None:
        what = "k" if family == "delay_compensated" else "(t-1)p"
        why += f"; {what} <= {bound}, the accuracy bound at momentum {momentum:g}"
    return pick, why
