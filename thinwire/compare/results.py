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


def aggregate(rows: list[dict], networks: list[str]) -> list[dict]:
    """One entry per (contestant, network): the seeds' median and range of time to target (a seed that missed
    it counts as +∞), how many reached it, medians of the other figures, and which contestants are within noise
    of the best one (ranges overlap, each widened by its readings' precision: `_span`)."""
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
        for e in here:  # defined when the best reached the target: do the ranges of time to target overlap?
            e["within_noise_of_best"] = (None if not best["reached"] else
                                         e is not best and e["status"] == "ok" and e["ttt_min"] is not None
                                         and max(_span(e)[0], _span(best)[0]) <= min(_span(e)[1], _span(best)[1]))
    return out


def _span(e: dict) -> tuple[float, float]:
    """The seeds' range of time to target, widened by the precision of a reading (`ttt_resolution`: the time to
    target is read between two evaluations, known to within that fraction): with one seed, a point and its
    reading's error bar."""
    res = e.get("ttt_resolution") or 0.0
    return e["ttt_min"] * (1 - res), e["ttt_max"] * (1 + res)


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
