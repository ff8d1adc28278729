"""`thinwire bench dts-accuracy`: final accuracy of bsp, delayed, tsparse and DTS at the same steps and seeds.

Accuracy does not depend on the network (same seed, same numbers), so every run uses `lan` and one pool of
workers; what varies is the algorithm, its (delay, period), the momentum and the seed. For each cell it reports
the final test accuracy (after `close()`: every worker holds the same model) averaged over the seeds, the
spread over seeds, the mean training loss (of the workers' local models) over the last tenth of the steps, and the
largest difference between the workers' final accuracies (0 when close() left them one model).

    thinwire bench dts-accuracy --workloads digits-cnn digits-mlp --steps 80 --seeds 0 1 2 --momenta 0.9 0 \
        --algorithms bsp delayed:delay=4 tsparse:period=4 dts:delay=2,period=4 --out docs/benchmarks
"""
from __future__ import annotations

import statistics
import time

from ..files import write_json
from ..launcher import Pool
from ..run.train import TrainConfig, summarize, train_worker
from .latency import label, specs


def _one(pool, workers, workload, name, params, steps, seed, momentum, lr):
    cfg = TrainConfig(workload=workload, algorithm=name, workers=workers, network="lan", steps=steps, seed=seed,
                      momentum=momentum, lr=lr, params=dict(params), eval_every=steps, progress=False)
    cfg.validate()
    t0 = time.perf_counter()
    results = pool.run(train_worker, cfg, network=cfg.network, seed=cfg.seed)
    summary, rows = summarize(cfg, results, time.perf_counter() - t0)
    tail = rows[-max(1, len(rows) // 10):]
    w = [r["final"] for r in results if r["role"] == "worker"]
    return {"accuracy": summary["final_accuracy"], "train_loss": statistics.fmean(r["loss"] for r in tail),
            "worker_spread": max(w) - min(w)}   # after close() the workers agree (to float rounding)


def run(args) -> int:
    algorithms = specs(args.algorithms)
    rows = []
    with Pool(args.workers, timeout=3600, start_timeout=900) as pool:
        for workload in args.workloads:
            for mu in args.momenta:
                for name, params in algorithms:
                    runs = [_one(pool, args.workers, workload, name, params, args.steps, s, mu, args.lr)
                            for s in args.seeds]
                    accs = [r["accuracy"] for r in runs]
                    row = {"workload": workload, "momentum": mu, "algorithm": label(name, params),
                           "steps": args.steps, "seeds": list(args.seeds), "accuracies": accs,
                           "accuracy": statistics.fmean(accs), "min": min(accs), "max": max(accs),
                           "train_loss": statistics.fmean(r["train_loss"] for r in runs),
                           "worker_spread": max(r["worker_spread"] for r in runs)}
                    rows.append(row)
                    print(f"{workload:<11} mu={mu:<4g} {row['algorithm']:<24} acc {row['accuracy']:.4f} "
                          f"[{row['min']:.4f}, {row['max']:.4f}]  loss {row['train_loss']:.4f}", flush=True)
    result = {"workers": args.workers, "steps": args.steps, "seeds": list(args.seeds), "lr": args.lr,
              "rows": rows}
    if args.out:
        path = write_json(result, args.out, f"dts_accuracy_{args.steps}steps.json", indent=2)
        print(f"written to {path}")
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    """One table per workload: algorithm rows, one column pair (mean accuracy, Δ vs bsp) per momentum."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["workload"] == workload]
        momenta = list(dict.fromkeys(r["momentum"] for r in rows))
        cell = {(r["algorithm"], r["momentum"]): r for r in rows}
        out.append(f"{workload}, {result['workers']} workers, {result['steps']} steps, "
                   f"seeds {result['seeds']} (mean [min, max] final accuracy; Δ vs bsp in pp)\n")
        out.append("| algorithm | " + " | ".join(f"μ={m:g} | Δ" for m in momenta) + " |")
        out.append("|" + " --- |" * (1 + 2 * len(momenta)))
        for a in dict.fromkeys(r["algorithm"] for r in rows):
            cells = []
            for m in momenta:
                r, b = cell.get((a, m)), cell.get(("bsp", m))
                if r is None:
                    cells += ["", ""]
                    continue
                cells.append(f"{r['accuracy']:.4f} [{r['min']:.3f}, {r['max']:.3f}]")
                cells.append("" if b is None else f"{100 * (r['accuracy'] - b['accuracy']):+.1f}")
            out.append(f"| {a} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def register(sub) -> None:
    p = sub.add_parser("dts-accuracy", help="final accuracy of bsp / delayed / tsparse / dts at equal steps")
    p.add_argument("--workloads", nargs="+", default=["digits-cnn", "digits-mlp"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--momenta", type=float, nargs="+", default=[0.9, 0.0])
    p.add_argument("--lr", type=float, help="learning rate (default: the workload's)")
    p.add_argument("--algorithms", nargs="+",
                   default=["bsp", "delayed:delay=2", "delayed:delay=4", "delayed:delay=8",
                            "tsparse:period=2", "tsparse:period=4", "tsparse:period=8",
                            "dts:delay=2,period=2", "dts:delay=2,period=4", "dts:delay=4,period=2",
                            "dts:delay=4,period=4", "dts:delay=2,period=8", "dts:delay=2,period=20"],
                   help="name or name:key=value,key=value")
    p.add_argument("--out", help="directory for dts_accuracy_<steps>steps.json")
    p.set_defaults(func=run)
