"""`thinwire bench cdsgd`: the comparison set of Yu, Dong, Xu, Ouyang, Liao 2021, "CD-SGD: Distributed Stochastic
Gradient Descent with Compression and Delay Compensation", arXiv 2106.10796 (Table 2, Figs. 6–10) on our workloads
and networks.

For each workload and network it trains ssgd, bitsgd, odsgd and cdsgd for each k, with the same seed, and
records final accuracy, training time to the target, the measured median iteration time and the one the time
model of the paper's §3.3 predicts from the inputs the run measured itself (τ, φ, ψ, δ).

    thinwire bench cdsgd --workloads digits-cnn wide-mlp --networks cluster wan --ks 2,5,10,20 \
        --thresholds digits-cnn=0.005,wide-mlp=0.001 --warmup 10 --out docs/benchmarks

Without --thresholds every run uses threshold2bit's default α (0.15625: the paper's 0.5/32 on batch-mean
gradients, over 1 − 0.9 for momentum);
`--momentum 0 --lr 0.5` runs all four with plain SGD, the paper's setting (docs/benchmarks/cdsgd-accuracy.md).
"""
from __future__ import annotations

import os

from ..errors import UserError
from ..files import pyplot, save, write_json
from ..launcher import Pool
from ..run.train import TrainConfig, run_training

_TIME_MODEL = ("tau_s", "phi_s", "psi_s", "delta_s")   # the paper's Table 1: τ, φ, ψ, δ, measured by each run


def _thresholds(text: str) -> dict:
    """`0.01` (every workload) or `workload=value,workload=value`; empty: the compressor's default."""
    if not text:
        return {"*": None}
    if "=" not in text:
        return {"*": float(text)}
    out = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise UserError(f"malformed --thresholds item {item!r}; e.g. digits-cnn=0.005,wide-mlp=0.001") from None
    return out


def _ms(v):
    return "-" if v is None else f"{v * 1e3:.1f}"


def run(args) -> int:
    ks = [int(k) for k in args.ks.split(",")]
    alphas = _thresholds(args.thresholds)
    lr = {"local_lr": args.local_lr} if args.local_lr else {}
    rows = []
    with Pool(args.workers) as pool:
        for workload in args.workloads:
            if workload not in alphas and "*" not in alphas:
                raise UserError(f"no threshold for {workload}; give --thresholds {workload}=VALUE")
            alpha = alphas.get(workload, alphas.get("*"))
            th = {} if alpha is None else {"threshold": alpha}
            runs = [("ssgd", {}), ("bitsgd", dict(th)), ("odsgd", {"warmup": args.warmup, **lr})]
            runs += [("cdsgd", {"k": k, "warmup": args.warmup, **th, **lr}) for k in ks]
            for network in args.networks:
                for name, params in runs:
                    cfg = TrainConfig(workload=workload, algorithm=name, workers=args.workers, network=network,
                                      epochs=args.epochs, seed=args.seed, params=dict(params), progress=False,
                                      lr=args.lr, momentum=args.momentum)
                    s = run_training(cfg, pool=pool)
                    m = s["algorithm_metrics"]
                    label = name if name != "cdsgd" else f"cdsgd k={params['k']}"
                    row = {"workload": workload, "network": network, "algorithm": label, "params": params,
                           "steps": s["steps"], "accuracy": s.get("final_accuracy"),
                           "best_accuracy": s.get("best_accuracy"), "target": s["target"],
                           "time_to_target_s": s["time_to_target_s"], "train_s": s["train_s"],
                           **{k: m.get(k) for k in ("measured_step_s", "predicted_step_s", *_TIME_MODEL)},
                           "bytes_per_step": s["bytes_sent_per_worker_per_step"]}
                    rows.append(row)
                    print(f"{workload:<11} {network:<8} {label:<12} acc {row['accuracy']:.4f}  "
                          f"ttt {row['time_to_target_s'] if row['time_to_target_s'] is not None else '-'}  "
                          f"step {_ms(row['measured_step_s'])} ms (predicted {_ms(row['predicted_step_s'])})",
                          flush=True)
    if args.out:
        write_json(rows, args.out, "cdsgd.json")
        _plot(rows, os.path.join(args.out, "cdsgd.png"))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    head = ("| workload | network | algorithm | steps | final acc | time to target (s) | train (s) | "
            "iteration measured (ms) | predicted (ms) | τ / φ / ψ / δ (ms) | KB/step |")
    out = [head, "|" + "---|" * 11]
    for r in rows:
        ttt = f"{r['time_to_target_s']:.2f}" if r["time_to_target_s"] is not None else "not reached"
        out.append(f"| {r['workload']} | {r['network']} | {r['algorithm']} | {r['steps']} | {r['accuracy']:.4f} | "
                   f"{ttt} | {r['train_s']:.2f} | {_ms(r['measured_step_s'])} | {_ms(r['predicted_step_s'])} | "
                   f"{' / '.join(_ms(r[k]) for k in _TIME_MODEL)} | "
                   f"{r['bytes_per_step'] / 1e3:.1f} |")
    return "\n".join(out)


def _plot(rows: list[dict], path: str) -> None:
    """Measured vs predicted iteration time, one panel per (workload, network)."""
    plt = pyplot()
    groups = sorted({(r["workload"], r["network"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (w, n) in zip(axes[0], groups):
        rs = [r for r in rows if (r["workload"], r["network"]) == (w, n)]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [(r["measured_step_s"] or 0) * 1e3 for r in rs], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [(r["predicted_step_s"] or 0) * 1e3 for r in rs], 0.4, label="predicted")
        ax.set_xticks(list(xs), [r["algorithm"].replace("cdsgd ", "cd ") for r in rs], rotation=45, ha="right",
                      fontsize=8)
        ax.set_title(f"{w}, {n}", fontsize=9)
        ax.set_ylabel("iteration time (ms)")
    axes[0][0].legend(fontsize=8)
    save(fig, path)


def register(sub) -> None:
    p = sub.add_parser("cdsgd", help="ssgd / bitsgd / odsgd / cdsgd(k) with predicted vs measured iteration time")
    p.add_argument("--workloads", nargs="+", default=["digits-cnn", "wide-mlp"])
    p.add_argument("--networks", nargs="+", default=["cluster", "wan"])
    p.add_argument("--ks", default="2,5,10,20", help="comma-separated k values for cdsgd")
    p.add_argument("--thresholds", default="",
                   help="2-bit threshold α: one value, or workload=value pairs (default: threshold2bit's, 0.15625)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--local-lr", type=float, default=None, help="η_loc (default: the workload's lr)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=float, default=None, help="default: the workload's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="η (default: the workload's)")
    p.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum (default: the workload's; 0 is the paper's plain SGD)")
    p.add_argument("--out", help="directory for cdsgd.json and cdsgd.png")
    p.set_defaults(func=run)
