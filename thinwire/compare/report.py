"""`report.md` of a `thinwire compare` matrix: a ranked table per network (median and range over seeds), the
winner named with what is within noise of it, the parameters each contestant ran with and why."""
from __future__ import annotations

import math
import statistics

from ..net import Islands, parse_network
from . import peers
from .results import metric_name, places, rank


def _fmt(v, spec, scale=1, div=1):
    return "—" if v is None else format(v * scale / div, spec)


def _secs(v) -> str:
    return "∞" if v is None or math.isinf(v) else f"{v:.3g}"


def _link(network: str, torchrun: bool = False) -> str:
    link = parse_network(network)
    if not link.emulated:
        return f"`{network}` ({'the network between the processes' if torchrun else 'loopback'}, no emulation)"
    bw = "unlimited" if link.bandwidth is None else f"{link.bandwidth / 1e6:g} Mbit/s"
    return f"`{network}` ({bw}, {link.latency * 1e3:g} ms one-way)"


def _peer(e: dict) -> peers.Peer | None:
    """The registered peer a contestant ran, or None (thinwire's, or a peer not registered now)."""
    return peers.find(e.get("algorithm")) if e.get("peer") else None


def _ttt(e: dict, seeds: int) -> str:
    """Time to target of a contestant: median [range] and seeds that reached it; or why it has none."""
    if e["reached"] == 0:
        pred = e.get("predicted_time_to_target_s")
        why = "/".join(e.get("stop_reasons") or []) or "stopped"
        return f"not reached ({why})" + (f"; predicted {pred:.0f}" if pred is not None else "")
    return _secs(e["ttt_median"]) + ("" if seeds == 1 else
                                     f" [{_secs(e['ttt_min'])}–{_secs(e['ttt_max'])}] {e['reached']}/{e['ok']}")


def _pair(a, b, scale=1e3) -> str:
    """`predicted / measured` (ms), or what there is."""
    return "—" if a is None and b is None else f"{_fmt(a, '.0f', scale)} / {_fmt(b, '.0f', scale)}"


def table(entries: list[dict], seeds: int, two_tier: bool = False) -> list[str]:
    name = metric_name(entries[0])
    across = " MB over the thin link / worker (of all sent) |" if two_tier else ""
    lines = [f"| rank | contestant | kind | ran with | time to target (s) | read within | best {name} | final {name} | "
             f"step (ms) | MB sent / worker / step | fp32 ÷ sent | exposed comm (s) | scalability | mean step: predicted / "
             f"measured (ms) | sync: predicted / measured (ms) | planned time to target (s) |{across}",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             + (" ---: |" if two_tier else "")]
    for i, e in enumerate(rank(entries), 1):
        kind = "thinwire" if not e.get("peer") else _peer(e).kind if _peer(e) else "peer"
        if e.get("status") != "ok":
            lines.append(f"| — | `{e['label']}` | {kind} | {e.get('ran_with') or ''} | {e['status']}: "
                         f"{e.get('error', '')} | | | | | | | | | | | |" + (" |" if two_tier else ""))
            continue
        noise = " ≈" if e.get("within_noise_of_best") else ""
        within, mb = e.get("ttt_resolution"), e.get("bytes_sent_per_worker_per_step")
        lines.append(
            f"| {i}{noise} | `{e['label']}` | {kind} | {e.get('ran_with') or ''} | {_ttt(e, seeds)} | "
            f"{_fmt(within, '.1f', 100)}{'' if within is None else ' %'} | "
            f"{_fmt(e.get('best_' + name), '.3f')} | {_fmt(e.get('final_' + name), '.3f')} | "
            f"{_fmt(e.get('step_time_s') or None, '.0f', 1e3)} | {_fmt(mb, '.3f', div=1e6)} | "
            f"{_fmt(e.get('compression_ratio'), '.1f')}× | {_exposed(e)} | "
            f"{_fmt(e.get('scalability'), '.2f')} | {_pair(e.get('predicted_step_time_s'), e.get('mean_step_s'))} | "
            f"{_pair(e.get('predicted_sync_s'), e.get('measured_sync_s'))} | "
            f"{_fmt(e.get('planned_time_to_target_s'), '.3g')} |"
            + (f" {_fmt(e.get('bytes_across_per_worker'), '.1f', div=1e6)} "
               f"({_fmt(e.get('bytes_sent_per_worker'), '.1f', div=1e6)}) |" if two_tier else ""))
    return lines


def _exposed(e: dict) -> str:
    """Waited within steps, and the drain after the race stopped (a sync in flight then) where there was one."""
    if e.get("exposed_in_steps_s") is None:
        return _fmt(e.get("exposed_comm_s"), ".1f")
    drain = e.get("drain_s") or 0.0
    return _fmt(e["exposed_in_steps_s"], ".1f") + (f" (+{drain:.1f} drain)" if drain >= 0.05 else "")


def prediction(results: dict, network: str, entries: list[dict]) -> str:
    """The planner's race, recorded before the cells ran, against the measurement."""
    p = (results.get("predictions") or {}).get(network) or {}
    winner = p.get("winner")
    if winner is None and p.get("note"):
        return f"The planner made no prediction of the winner here: {p['note']}."
    if winner is None:
        return ("The planner made no prediction of the winner here (the no-communication reference did not reach "
                "the target, so it had no steps to target to start from).")
    ttt = p["cells"][winner]["time_to_target_s"]
    tied = p.get("tied") or []
    ties = f", tied in the model with {' and '.join(f'`{t}`' for t in tied)}" if tied else ""
    base = results.get("baseline") or {}
    how = (f" (from the reference's {base['steps_to_target']:.0f} steps to target, extrapolated from its trend: it ran "
           f"out of budget first)" if base.get("steps_extrapolated") else "")
    ok = [e for e in rank(entries) if e.get("status") == "ok"]
    measured = ok[0] if ok and ok[0]["reached"] else None
    if measured is None:
        return f"**Predicted before the race**: `{winner}` ({ttt:.3g} s{ties}){how}; no cell reached the target."
    agreed = measured["label"] in [winner, *tied]
    within = next((e for e in ok if e["label"] == winner), None)
    tie = within is not None and within.get("within_noise_of_best")
    return (f"**Predicted before the race**: `{winner}` ({ttt:.3g} s to target{ties}{how}); measured winner "
            f"`{measured['label']}` "
            f"({measured['ttt_median']:.3g} s): " + ("**agreed**." if agreed else
                                                     f"a tie (`{winner}` took {within['ttt_median']:.3g} s: within "
                                                     f"the noise of the readings, so not ranked apart)." if tie
                                                     else "disagreed."))


def verdict(entries: list[dict], seeds: int, budget) -> str:
    ok = [e for e in rank(entries) if e.get("status") == "ok"]
    if not ok:
        return "No contestant finished on this network."
    w = ok[0]
    name, target = metric_name(w), w.get("target")
    if not w["reached"]:
        spent = f"within its budget of {budget:g} s of training" if budget else "within its steps"
        return (f"**No contestant reached the target {name} {target}** {spent}; `{w['label']}` came closest "
                f"(best {name} {w['best_' + name]:.3f}). Give a larger `--budget`, or a looser `--target`.")
    over = f" (median over {seeds} seeds, range {_secs(w['ttt_min'])}–{_secs(w['ttt_max'])} s)" if seeds > 1 else ""
    parts = [f"**Winner: `{w['label']}`**, {name} {target} after {w['ttt_median']:.3g} s of training{over} "
             f"({w['bytes_sent_per_worker_per_step'] / 1e6:.3f} MB sent per worker per step; ran with "
             f"{w.get('ran_with') or 'defaults'})."]
    if seeds > 1:
        close = [e["label"] for e in ok if e.get("within_noise_of_best")]
        parts.append(f"Within noise of it (not behind it in every seed, seed by seed, beyond a reading's precision):"
                     f" {', '.join(f'`{c}`' for c in close)}." if close else
                     "It is ahead of every other contestant in every seed (times to target compared seed by seed, "
                     "beyond a reading's precision).")
    else:
        parts.append("One seed: the margins are not tested against seed noise (`--seeds 3` does).")

    def vs(other, what):
        if other is None or other is w:
            return
        if not other["reached"]:
            pred = other.get("predicted_time_to_target_s")
            tail = f"; predicted {pred:.0f} s, {pred / w['ttt_median']:.1f}× the winner's" if pred else ""
            parts.append(f"{what[0].upper() + what[1:]} (`{other['label']}`) did not reach it in {other['train_s']:.1f} s "
                         f"(best {name} {other['best_' + name]:.3f}{tail}).")
        elif seeds > 1 and other.get("paired_ratios"):
            ratios = other["paired_ratios"]
            mid = statistics.median(r for r in ratios if not math.isnan(r))
            missed = sum(1 for r in ratios if r == math.inf)
            lead = "ahead in every seed" if other["lead_real"] else "not ahead in every seed"
            each = ", ".join(f"{r:.2f}" for r in ratios)
            parts.append(f"That is {mid:.2f}× faster than {what} (`{other['label']}`: median of the per-seed "
                         f"ratios {each}; {lead})." if mid < math.inf else
                         f"{what[0].upper() + what[1:]} (`{other['label']}`) missed the target in {missed} of "
                         f"{len(ratios)} seeds (per-seed ratios {each}; {lead}).")
        else:
            parts.append(f"That is {other['ttt_median'] / w['ttt_median']:.1f}× faster than "
                         f"{what} (`{other['label']}`, {other['ttt_median']:.1f} s).")
    vs(next((e for e in ok if e["label"] == "bsp"), None), "synchronous SGD")
    # the peer whose plain cell the winner is compared with by name (`Peer.title`: "PyTorch DDP")
    named = next((e for e in ok if _peer(e) and _peer(e).title and e["label"] == e.get("algorithm")), None)
    vs(named, named and _peer(named).title)
    vs(next((e for e in ok if e.get("peer") and e is not named), None), "the best other peer")
    missed = [e["label"] for e in ok if not e["reached"]]
    if missed:
        parts.append(f"Not reaching the target: {', '.join(f'`{m}`' for m in missed)}.")
    return " ".join(parts)


def write_report(results: dict, path: str) -> None:
    m = results["matrix"]
    seeds = m.get("seeds", 1)
    entries = results.get("summary") or []
    where = [(name, n, sp) for name, n, sp in places(m) if any(e["network"] == name for e in entries)]
    nets = list(dict.fromkeys(n for _, n, _ in where))
    lines = [f"# thinwire compare: {m['workload']}, {m['workers']} workers", ""]
    mode = ("real network: each worker in its own network namespace, rate shaped by `tbf`, delay by thinwire's "
            "user-space forwarder (`--netem`)" if m.get("netem") else
            "real network: every worker one of the processes torchrun started, on your machines; any network but "
            "`lan` emulated in-process on top of it (under torchrun)" if m.get("torchrun") else
            "in-process emulation: every transfer completes no earlier than the emulated link delivers it")
    budget = m.get("budget_s")
    race = (f"every cell had the same budget of {budget:g} s of training time (evaluations excluded)" if budget else
            "no time budget: every cell ran to the target or its step bound")
    seeds_txt = f"{seeds} seeds each (seed {m['seed']}–{m['seed'] + seeds - 1})" if seeds > 1 else f"seed {m['seed']}"
    link = lambda n: _link(n, m.get("torchrun"))    # noqa: E731
    lines += [f"Networks: {', '.join(link(n) for n in nets)}. Network mode: {mode}. The race: {race}, stopping at "
              f"the target; {seeds_txt}." + (f" Preset `{m['preset']}`." if m.get("preset") else "")
              + (f" Batch {m['batch_size']} per worker." if m.get("batch_size") else ""), ""]
    for name, n, sp in where:
        here = [e for e in entries if e["network"] == name]
        two_tier = isinstance(parse_network(n), Islands)
        title = link(n) + (f", worker speeds `{sp}`" if sp else "")
        lines += [f"## {title}", "", verdict(here, seeds, budget), "", prediction(results, name, here), ""]
        lines += table(here, seeds, two_tier) + [""]
    baselines = results.get("baselines") or {"equal": results.get("baseline") or {}}
    for sp, base in baselines.items():
        if not base.get("runs"):
            continue
        reached = base.get("time_to_target_s")
        lines += [f"No-communication reference (`local`, the same workers, data and process layout"
                  + (f", worker speeds `{sp}`" if len(baselines) > 1 or sp != "equal" else "") + "): "
                  f"{_fmt(base['throughput_samples_s'], '.0f')} samples/s (range {_fmt(base['throughput_min'], '.0f')}–"
                  f"{_fmt(base['throughput_max'], '.0f')} over {len(base['runs'])} run(s): spread "
                  f"{base['spread'] * 100:.1f} %), median step {base['step_time_s'] * 1e3:.0f} ms"
                  + (f", target after {reached:.3g} s ({base['steps_to_target']:.0f} steps): the time to target with "
                     f"communication free" if reached else ", target not reached in the budget") + ".", ""]
    lines += ["## Parameters and why", ""]
    for e in entries:
        why = "; ".join(e.get("why") or []) or "as given (or the algorithm's defaults)"
        lines.append(f"- `{e['label']}` on `{e['network']}`: {e.get('ran_with') or 'defaults'} — {why}")
    preds = [r for r in results["cells"] if r.get("prediction_basis")]
    if preds:
        lines += ["", "## Predicted times to target", ""]
        lines += [f"- `{r['key']}`: {r['predicted_time_to_target_s']:.0f} s, predicted from {r['prediction_basis']}"
                  for r in preds]
    plots = results.get("plots") or {}
    if plots:
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()]
    lines += [
        "", "## How to read this", "",
        "- Every row is a contestant: its own training runs (one per seed), with the same workload, data shards, "
        "batch size and learning rate as every other row.",
        "- **time to target**: training time (evaluations excluded) until the mean test metric of the workers first "
        "reached the target, read at the evaluation that first saw it; evaluations close in on the crossing and come "
        "every 2–5 % of the training clock near it (`thinwire/run/loop.py`). **read within**: the interval before that "
        "evaluation, as a share of the time to target — the true crossing lies in it (median over seeds). "
        "With several seeds: median [min–max] and seeds that reached it; a seed that missed counts as "
        "never. Rows rank by it, then by best metric. **≈** marks a contestant within noise of the winner: not "
        "behind it in every seed (times to target compared seed by seed, beyond a reading's precision).",
        "- **not reached**: the cell spent its budget (`budget`) or its steps (`steps`) first; *predicted* is the "
        "steps to target of the same trajectory elsewhere in this matrix times this cell's step time (see above).",
        "- **ran with**: the parameters the cell ran with; those a cell did not give were picked by the planner "
        "for this network (see *Parameters and why*).",
        "- **MB sent / worker / step**: bytes each worker actually put on the wire per step; **fp32 ÷ sent**: how "
        "many times fewer bytes than an uncompressed fp32 ring all-reduce of the gradients every step.",
        "- **exposed comm**: time the workers waited for communication within their steps (not hidden behind "
        "compute); *(+x drain)*: the wait after the race stopped for a sync still in flight (an overlapped DiLoCo's: "
        "its steps would have hidden it), on the training clock but not in the throughput below.",
        "- **scalability**: throughput (samples over the training clock, the drain after the stop excluded) divided "
        "by the throughput of the same workers with no communication at all "
        f"({_fmt(base.get('throughput_samples_s'), '.0f')} samples/s here, {base.get('how', 'not measured')}); "
        "1.0 means communication costs nothing (a reading above 1, the noise of measuring the machine's speed at "
        "the cell and at the reference, is shown as 1; results.json keeps it as `scalability_measured`).",
        "- **mean step: predicted / measured** (training time ÷ steps, syncs included; **step** is the median), "
        "**sync: predicted / measured**, **planned time to target**: the planner's "
        "predictions, made before any cell ran, from the model size, the network and the reference's median step "
        "(and, for the time to target, the reference's steps to target times 0.72 for a cell that averages every "
        "step, 0.88-1.0 for DiLoCo (by its overlap), 0.575 + 0.048 log2 H for model averaging every H steps, as "
        "measured on the LM); measured sync: DiLoCo's own clock from a fragment's first piece out to its last "
        "delivered (hidden or not), else the exposed time per sync.",
        "- **MB over the thin link** (two-tier networks): what each worker sent between islands over the run, beside "
        "all it sent — what a user pays for between sites.",
        "- Peers run PyTorch's own DDP hooks and model averagers, or torchft's DiLoCo; their all-reduces face the "
        "same emulated link and are counted with the same ring all-reduce accounting (see "
        "`thinwire/compare/peers/`). `ddp-powersgd` runs with a single DDP bucket (bucket_cap_mb above the "
        "model size): with several buckets PyTorch's powerSGD_hook fails on gloo. torchft's quantized all-reduce "
        "needs Triton (a GPU): on this CPU it sends full precision.",
    ]
    peers = {e["label"]: r.get("algorithm_metrics", {}).get("peer") for e in entries if e.get("peer")
             for r in results["cells"] if r["label"] == e["label"] and r.get("status") == "ok"}
    if any(peers.values()):
        lines += ["", "Peer configurations: " + "; ".join(f"`{k}`: {v}" for k, v in peers.items() if v) + "."]
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    wall = results.get("matrix_wall_s")
    if wall:
        lines += ["", f"Matrix wall time: {wall:.0f} s (start-up and evaluations included)."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
