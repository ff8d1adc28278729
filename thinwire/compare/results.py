"""The records of a race: one entry per (contestant, network) from its seeds' rows, and their ranking (what the
report and the plots read)."""
from __future__ import annotations

import math
import statistics


def metric_name(r: dict) -> str:
    """The metric of a row or summary entry as its fields name it (`best_accuracy`, `best_loss`)."""
    return "accuracy" if r.get("metric", "accuracy") == "accuracy" else "loss"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def place(network: str, speeds: str | None = None) -> str:
    """A (network, worker speeds) of the matrix as its rows name it: the network, and the speeds profile
    (`thinwire.speeds`) where one is set."""
    return network if not speeds else f"{network}, speeds {speeds}"


def places(matrix: dict) -> list[tuple[str, str, str | None]]:
    """(name, network, speeds) of every place of a matrix (`asdict(CompareConfig)`), in its order: every network
    under the first speeds profile, then under the next."""
    return [(place(n, s), n, s) for s in (matrix.get("speeds") or [None]) for n in matrix["networks"]]


def aggregate(rows: list[dict], networks: list[str]) -> list[dict]:
    """One entry per (contestant, network): the seeds' median and range of time to target (a seed that missed
    it counts as +∞), how many reached it, medians of the other figures, and each contestant's ratio to the best
    one's time to target seed by seed (`paired_ratios`: the same seed is the same data and initialization for
    every contestant); the best one's lead over it is real only where every seed's ratio is above 1 beyond the
    readings' precision (`lead_real`), else it is within noise of the best."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["label"], r["network"]), []).append(r)
    out = []
    for (label, network), rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        first = (ok or rs)[0]
        name = metric_name(first)
        ttt = [r.get("time_to_target_s") if r.get("time_to_target_s") is not None else math.inf for r in ok]
        entry = {"label": label, "network": network, "peer": first.get("peer"),
                 "algorithm": (first.get("cell") or {}).get("algorithm"), "metric": first.get("metric"),
                 "target": first.get("target"), "seeds": len(rs), "ok": len(ok),
                 "reached": sum(1 for t in ttt if t < math.inf),
                 "ttt_median": _median(ttt), "ttt_min": min(ttt, default=None), "ttt_max": max(ttt, default=None),
                 "ran_with": first.get("ran_with"), "why": first.get("why", []),
                 "status": "ok" if ok else first.get("status"), "error": None if ok else first.get("error")}
        for k in ("best_" + name, "final_" + name, "step_time_s", "bytes_sent_per_worker_per_step",
                  "compression_ratio", "exposed_comm_s", "scalability", "predicted_step_time_s",
                  "predicted_time_to_target_s", "train_s", "steps", "predicted_sync_s", "measured_sync_s",
                  "planned_time_to_target_s", "bytes_across_per_worker", "bytes_sent_per_worker", "mean_step_s",
                  "exposed_in_steps_s", "drain_s"):
            entry[k] = _median(r.get(k) for r in ok)
        entry["ttt_by_seed"] = {r.get("seed"): (r.get("time_to_target_s") or math.inf,
                                                r.get("time_to_target_resolution_s") or 0.0) for r in ok}
        entry["stop_reasons"] = sorted({r.get("stop_reason") for r in ok if r.get("stop_reason")})
        entry["ttt_resolution"] = _median(r["time_to_target_resolution_s"] / r["time_to_target_s"] for r in ok
                                          if r.get("time_to_target_resolution_s") is not None
                                          and r.get("time_to_target_s"))
        out.append(entry)
    order = {n: i for i, n in enumerate(networks)}
    out.sort(key=lambda e: order.get(e["network"], 99))
    for n in {e["network"] for e in out}:
        here = rank([e for e in out if e["network"] == n])
        best = here[0]
        if best["status"] != "ok":
            continue
        for e in here:  # defined when the best reached the target
            if not best["reached"] or e is best or e["status"] != "ok":
                e["within_noise_of_best"] = None if not best["reached"] else False
                continue
            e["paired_ratios"], e["lead_real"] = paired(best, e)
            e["within_noise_of_best"] = not e["lead_real"]
    return out


def paired(best: dict, e: dict) -> tuple[list[float], bool]:
    """`e`'s time to target over `best`'s, seed by seed (+∞ where only `e` missed it), and whether `best` leads in
    every seed beyond the readings' precision (a time to target is read between two evaluations: the true
    crossing lies up to its resolution earlier) — a seed that either missed, or one `best` lacks, is no lead."""
    ratios, real = [], True
    for seed, (t, res_t) in sorted(e["ttt_by_seed"].items(), key=lambda kv: str(kv[0])):
        b, res_b = best["ttt_by_seed"].get(seed, (math.inf, 0.0))
        ratios.append(t / b if b < math.inf else math.nan)
        real = real and b < math.inf and t - res_t > b
    return ratios, real and bool(ratios)


def rank(entries: list[dict]) -> list[dict]:
    """Contestants that reached the target in most seeds first, by median time to target; then the rest by their
    median best metric; failures last."""
    def key(e):
        if e.get("status") != "ok":
            return (2, math.inf, 0.0)
        up = metric_name(e) == "accuracy"
        best = e.get("best_" + metric_name(e)) or 0.0
        if e["reached"] * 2 > e["ok"] and e["ttt_median"] is not None:
            return (0, e["ttt_median"], -best if up else best)
        return (1, -best if up else best, e.get("train_s") or 0.0)
    return sorted(entries, key=key)
