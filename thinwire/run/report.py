"""`report.md` of a `thinwire compare` matrix: a ranked table per network, the winner named, a short verdict."""
from __future__ import annotations

import math

from ..net import parse_network


def _metric(r: dict) -> tuple[str, bool]:
    """(name of the metric, higher is better)."""
    return ("accuracy", True) if r.get("metric", "accuracy") == "accuracy" else ("loss", False)


def rank(rows: list[dict]) -> list[dict]:
    """Cells that reached the target first, fastest first; then the rest by best metric; failures last."""
    def key(r):
        if r.get("status") != "ok":
            return (2, math.inf, 0.0)
        name, up = _metric(r)
        best = r.get(f"best_{name}") or 0.0
        if r.get("time_to_target_s") is not None:
            return (0, r["time_to_target_s"], -best if up else best)
        return (1, -best if up else best, r.get("train_s") or 0.0)
    return sorted(rows, key=key)


def _fmt(v, spec, none="—"):
    return none if v is None else format(v, spec)


def _link(network: str) -> str:
    link = parse_network(network)
    if not link.emulated:
        return f"`{network}` (loopback, no emulation)"
    bw = "unlimited" if link.bandwidth is None else f"{link.bandwidth / 1e6:g} Mbit/s"
    return f"`{network}` ({bw}, {link.latency * 1e3:g} ms one-way)"


def table(rows: list[dict]) -> list[str]:
    name, _ = _metric(rows[0])
    lines = [f"| rank | contestant | kind | time to target (s) | final {name} | best {name} | step (ms) | "
             f"MB sent / worker / step | fp32 ÷ sent | exposed comm (s) | scalability | predicted step (ms) |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rank(rows), 1):
        kind = "PyTorch peer" if r.get("peer") else "thinwire"
        if r.get("status") != "ok":
            lines.append(f"| — | `{r['label']}` | {kind} | {r['status']}: {r.get('error', '')} "
                         f"| | | | | | | | |")
            continue
        ttt = _fmt(r.get("time_to_target_s"), ".1f", "not reached")
        ratio = r.get("compression_ratio")
        lines.append(
            f"| {i} | `{r['label']}` | {kind} | {ttt} | {_fmt(r.get('final_' + name), '.3f')} | "
            f"{_fmt(r.get('best_' + name), '.3f')} | {_fmt(r['step_time_s'] * 1e3, '.0f')} | "
            f"{r['bytes_sent_per_worker_per_step'] / 1e6:.3f} | {_fmt(ratio, '.1f')}× | "
            f"{_fmt(r.get('exposed_comm_s'), '.1f')} | {_fmt(r.get('scalability'), '.2f')} | "
            f"{_fmt(None if r.get('predicted_step_time_s') is None else r['predicted_step_time_s'] * 1e3, '.0f')} |")
    return lines


def verdict(rows: list[dict]) -> str:
    ok = [r for r in rank(rows) if r.get("status") == "ok"]
    if not ok:
        return "No contestant finished on this network."
    name, _ = _metric(ok[0])
    w = ok[0]
    target = w.get("target")
    if w.get("time_to_target_s") is None:
        return (f"**No contestant reached the target {name} {target}** within its training budget; "
                f"`{w['label']}` came closest (best {name} {w['best_' + name]:.3f}). "
                f"Train longer (`--epochs`) or lower the target (`--target`).")
    parts = [f"**Winner: `{w['label']}`**, {name} {target} after {w['time_to_target_s']:.1f} s of training "
             f"({w['bytes_sent_per_worker_per_step'] / 1e6:.3f} MB sent per worker per step)."]

    def vs(other, what):
        if other is None or other is w:
            return
        if other.get("time_to_target_s") is None:
            parts.append(f"{what} (`{other['label']}`) did not reach it in {other['train_s']:.1f} s "
                         f"(best {name} {other['best_' + name]:.3f}).")
        else:
            parts.append(f"That is {other['time_to_target_s'] / w['time_to_target_s']:.1f}× faster than "
                         f"{what[0].lower() + what[1:]} (`{other['label']}`, {other['time_to_target_s']:.1f} s).")
    vs(next((r for r in ok if r["label"] == "bsp"), None), "Synchronous SGD")
    vs(next((r for r in ok if r.get("peer")), None), "The best PyTorch option")
    missed = [r["label"] for r in ok if r.get("time_to_target_s") is None]
    if missed:
        parts.append(f"Not reaching the target: {', '.join(f'`{m}`' for m in missed)}.")
    return " ".join(parts)


def write_report(results: dict, path: str) -> None:
    m = results["matrix"]
    rows = results["cells"]
    nets = [n for n in m["networks"] if any(r["network"] == n for r in rows)]
    base = results.get("baseline") or {}
    lines = [f"# thinwire compare: {m['workload']}, {m['workers']} workers", ""]
    mode = ("real network: each worker in its own network namespace, rate shaped by `tbf`, delay by thinwire's "
            "user-space forwarder (`--netem`)" if m.get("netem") else
            "in-process emulation: every transfer completes no earlier than the emulated link delivers it")
    lines += [f"Networks: {', '.join(_link(n) for n in nets)}. Network mode: {mode}."
              + (f" Preset `{m['preset']}`." if m.get("preset") else ""), ""]
    for n in nets:
        here = [r for r in rows if r["network"] == n]
        lines += [f"## {_link(n)}", "", verdict(here), ""] + table(here) + [""]
    plots = results.get("plots") or {}
    if plots:
        lines += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    lines += [
        "## How to read this", "",
        "- Every row is its own training run: same workload, seed, data shards, batch size and learning rate.",
        "- **time to target**: training time (evaluations excluded) until the mean test metric of the workers first "
        "reached the target; rows are ranked by it, then by best metric.",
        "- **MB sent / worker / step**: bytes each worker actually put on the wire per step; **fp32 ÷ sent**: how "
        "many times fewer bytes than an uncompressed fp32 ring all-reduce of the gradients every step.",
        "- **exposed comm**: time the workers waited for communication (not hidden behind compute).",
        "- **scalability**: throughput divided by the throughput of the same workers with no communication at all "
        f"({_fmt(base.get('throughput_samples_s'), '.0f')} samples/s here, {base.get('how', 'not measured')}); "
        "1.0 means communication costs nothing.",
        "- **predicted step**: thinwire's planner's prediction, where it has one.",
        "- PyTorch peers run PyTorch's own DDP hooks / post-local SGD; their all-reduces face the same emulated link "
        "and are counted with the same ring all-reduce accounting (see `thinwire/run/peers.py`). "
        "`ddp-powersgd` runs with a single DDP bucket (bucket_cap_mb above the model size): with several buckets "
        "PyTorch's powerSGD_hook fails on gloo.",
    ]
    peers = {r["label"]: r.get("algorithm_metrics", {}).get("peer") for r in rows if r.get("peer")}
    if any(peers.values()):
        lines += ["", "Peer configurations: " + "; ".join(f"`{k}`: {v}" for k, v in peers.items() if v) + "."]
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    wall = results.get("matrix_wall_s")
    if wall:
        lines += ["", f"Matrix wall time: {wall:.0f} s (start-up and evaluations included)."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
