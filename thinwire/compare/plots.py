"""PNG plots of a `thinwire compare` matrix: accuracy vs training time, accuracy vs bytes sent, and (several
networks) time to target vs network. thinwire's contestants are solid lines, PyTorch peers dashed."""
from __future__ import annotations

import math
import os

from ..files import pyplot
from .results import places, rank


def _style(results: dict) -> dict:
    plt = pyplot()
    labels = list(dict.fromkeys(r["label"] for r in results["cells"]))  # in order of first appearance
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    peers = {r["label"] for r in results["cells"] if r.get("peer")}
    return {lab: {"color": cmap(i % cmap.N), "ls": "--" if lab in peers else "-",
                  "marker": "s" if lab in peers else "o"} for i, lab in enumerate(labels)}


def _log_labels(axis) -> None:
    """Label a log axis in plain numbers, its 2× and 5× minor ticks too (a newcomer reads 0.2, 0.5 more easily
    than 10^-1)."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _pos) -> str:
        mant = round(v / 10 ** math.floor(math.log10(v)), 3) if v > 0 else 0.0
        return f"{v:g}" if mant in (2.0, 5.0) else ""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _metric(results: dict) -> str:
    """The race's metric, from the first cell that ran (a failed cell has none)."""
    return next((r.get("metric") for r in results["cells"] if r.get("metric")), "accuracy")


def _curves(results: dict, path: str, x_index: int, xlabel: str, title: str, log_x: bool) -> str:
    plt, style = pyplot(), _style(results)
    nets = [n for n, _, _ in places(results["matrix"]) if any(r["network"] == n for r in results["cells"])]
    cols = min(len(nets), 3)   # one panel per network, up to three a row
    rows = (len(nets) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.8 * rows + 0.6), squeeze=False)
    axes = list(axes.flat)
    metric = _metric(results)
    handles = {}
    for ax, net in zip(axes, nets):
        target, lows = None, []
        cells = [r for r in results["cells"] if r["network"] == net and r.get("status") == "ok" and r.get("curve")]
        # a log axis needs a positive value: where nothing was sent (one worker, or no contestant communicated)
        # the panel is drawn on a linear axis instead
        log = log_x and any(p[x_index] > 0 for r in cells for p in r["curve"])
        for r in cells:
            pts = [p for p in r["curve"] if not (log and p[x_index] <= 0)]
            xs = [p[x_index] / (1e6 if x_index == 1 else 1) for p in pts]
            s = style[r["label"]]
            h, = ax.plot(xs, [p[2] for p in pts], color=s["color"], ls=s["ls"], marker=s["marker"], ms=3.5,
                         lw=1.8, label=r["label"])
            handles[r["label"]] = h
            lows += [p[2] for p in pts]
            target = r.get("target")
        if target is not None:
            ax.axhline(target, color="grey", lw=1, ls=":")
            ax.annotate(f"target {target}", (0.01, target), xycoords=("axes fraction", "data"),
                        textcoords="offset points", xytext=(2, 3), fontsize=8, color="grey")
        if log:
            ax.set_xscale("log")
            _log_labels(ax.xaxis)
        ax.set_title(f"network: {net}", fontsize=11)
        ax.set_xlabel(xlabel if log or not log_x else xlabel.replace(" (log scale)", "") + " (nothing sent)")
        ax.set_ylabel("test " + metric)
        if metric == "accuracy" and lows:
            ax.set_ylim(max(0.0, min(lows) - 0.05), 1.0)
        ax.grid(alpha=0.3)
    for ax in axes[len(nets):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(handles.values(), [h.get_label() for h in handles.values()], loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False, title="contestant (dashed: PyTorch)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return os.path.basename(path)


def _ttt(results: dict, path: str) -> str:
    plt, style = pyplot(), _style(results)
    nets = [n for n, _, _ in places(results["matrix"]) if any(r["network"] == n for r in results["cells"])]
    fig, ax = plt.subplots(figsize=(max(8.5, 1.9 * len(nets) + 3), 5.6))
    entries = results.get("summary") or []   # per contestant and network: the median over seeds
    med = lambda e: e["ttt_median"] if e.get("reached") and e.get("ttt_median") not in (None, math.inf) else None
    reached = [med(e) for e in entries if med(e)]
    ceiling = max(reached) * 1.6 if reached else 1.0
    for label in style:
        ys, miss = [], []
        for i, n in enumerate(nets):
            r = next((e for e in entries if e["label"] == label and e["network"] == n), None)
            v = med(r) if r and r.get("status") == "ok" else None
            ys.append(v if v is not None else float("nan"))
            if r is not None and v is None:
                miss.append(i)
        s = style[label]
        ax.plot(range(len(nets)), ys, color=s["color"], ls=s["ls"], marker=s["marker"], lw=1.8,
                label=label + (" (PyTorch)" if s["ls"] == "--" else ""))
        if miss:
            ax.scatter(miss, [ceiling] * len(miss), color=s["color"], marker="x", s=50)
    # per network: the measured winner (a star on its point) and the planner's predicted one (a ring on its point,
    # predicted before the cells ran), both named under the axis
    preds = results.get("predictions") or {}
    names = []
    for i, n in enumerate(nets):
        here = [e for e in entries if e["network"] == n and e.get("status") == "ok"]
        ranked = rank(here) if here else []
        won = ranked[0] if ranked and ranked[0].get("reached") else None
        guess = (preds.get(n) or {}).get("winner")
        if won is not None:
            ax.scatter([i], [med(won)], marker="*", s=260, color=style[won["label"]]["color"], edgecolor="black",
                       zorder=5, label="measured winner" if i == 0 else None)
        g = next((e for e in here if e["label"] == guess), None)
        if g is not None and med(g):
            ax.scatter([i], [med(g)], marker="o", s=420, facecolor="none", edgecolor="black", lw=1.4, zorder=4,
                       label="planner's predicted winner" if i == 0 else None)
        tied = [guess, *((preds.get(n) or {}).get("tied") or [])]    # the model's ties: each a predicted winner
        mark = "" if won is None or guess is None else (" ✓" if won["label"] in tied else
                                                         " ≈" if g is not None and g.get("within_noise_of_best")
                                                         else " ✗")       # ≈: within the readings' noise of it
        names.append(n.replace("custom:", "").replace(",", "\n").replace("islands:", "islands ")
                     + (f"\nwinner: {won['label']}" if won else "\nno winner")
                     + ("\npredicted: " + "\nor ".join(tied) + mark if guess else ""))
    ax.axhline(ceiling, color="grey", lw=0.8, ls=":")
    ax.annotate("× = target not reached", (0.01, ceiling), xycoords=("axes fraction", "data"),
                textcoords="offset points", xytext=(2, 4), fontsize=8, color="grey")
    if reached:
        ax.set_yscale("log")
        ax.set_ylim(min(reached) / 1.5, ceiling * 1.4)
        _log_labels(ax.yaxis)
        ax.set_ylabel("time to target (s, log scale; lower is better)")
    else:
        ax.set_ylim(0, 1.5)
        ax.set_yticks([])
        ax.set_ylabel("time to target")
        ax.text(0.5, 0.45, "no contestant reached the target on any network", transform=ax.transAxes,
                ha="center", color="grey")
    ax.set_xticks(range(len(nets)), names, fontsize=7)
    ax.set_xlim(-0.3, len(nets) - 0.7)
    ax.set_xlabel("network")
    ax.set_title("Time to reach the target on each network" + (" (median over seeds)"
                                                                if results["matrix"].get("seeds", 1) > 1 else ""))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return os.path.basename(path)


def plot_all(results: dict, out: str) -> dict:
    """Draw every plot into `out`; returns {title: file name}."""
    if not any(r.get("status") == "ok" for r in results["cells"]):
        return {}
    m = results["matrix"]
    sub = f"{m['workload']}, {m['workers']} workers"
    metric = _metric(results)
    better = "up and to the left is better" if metric == "accuracy" else "down and to the left is better"
    name = "accuracy" if metric == "accuracy" else "loss"
    plots = {
        f"{name} vs training time": _curves(results, os.path.join(out, "accuracy_vs_time.png"), 0,
                                            "training time (s)",
                                            f"Test {name} vs training time\n{sub}; {better}", log_x=False),
        f"{name} vs bytes sent": _curves(results, os.path.join(out, "accuracy_vs_bytes.png"), 1,
                                         "MB sent per worker so far (log scale)",
                                         f"Test {name} vs bytes each worker sent\n{sub}; {better}", log_x=True),
    }
    if len({r["network"] for r in results["cells"]}) > 1:
        plots["time to target vs network"] = _ttt(results, os.path.join(out, "time_to_target_vs_network.png"))
    return plots
