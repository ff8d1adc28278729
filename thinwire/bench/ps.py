"""`thinwire bench ps`: synchronization × architecture on the parameter server against all-reduce.

For each network it trains, with the same seed and workload: bsp on all-reduce (n workers), and on the PS
(n workers + K servers) bsp, ssp for each staleness bound, and asp. It records the median step time, the bytes
per step sent by a worker and received and sent by a server (the PS incast: n gradients in, n models out per
step), the time and steps to the target, and the final accuracy; `--out DIR` writes ps.json and ps.png there.

    thinwire bench ps --workload digits-mlp --networks lan cluster wan --workers 4 --staleness 2,8 --out docs/benchmarks
"""
from __future__ import annotations

import json
import os

from ..files import pyplot, save, write_json
from ..launcher import Pool
from ..run.train import TrainConfig, run_training


def _runs(staleness: list[int], servers: int, momentum=None) -> list[tuple[str, str, int, dict]]:
    runs = [("bsp (all-reduce)", "bsp", 0, {}), ("bsp (PS)", "bsp", servers, {"architecture": "ps"})]
    runs += [(f"ssp s={s}", "ssp", servers, {"staleness": s}) for s in staleness]
    runs.append(("asp", "asp", servers, {}))
    if momentum is None:
        runs.append(("asp momentum 0.5", "asp", servers, {"momentum": 0.5}))  # a TrainConfig field
    return runs


def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def run(args) -> int:
    staleness = [int(s) for s in args.staleness.split(",") if s]
    rows, pools = [], {}  # one pool per world size (workers, workers + servers): start-up is paid once
    try:
        for network in args.networks:
            for label, alg, servers, params in _runs(staleness, args.servers, args.momentum):
                params = dict(params)
                momentum = params.pop("momentum", args.momentum)
                cfg = TrainConfig(workload=args.workload, algorithm=alg, workers=args.workers, servers=servers,
                                  network=network, epochs=args.epochs, seed=args.seed, params=params,
                                  momentum=momentum, progress=False)
                world = args.workers + servers
                if world not in pools:
                    pools[world] = Pool(world, start_timeout=600.0)
                s = run_training(cfg, pool=pools[world])
                steps = max(1, s["steps"])
                sm = s.get("server_metrics") or {}
                row = {"network": network, "run": label, "momentum": cfg.momentum, "algorithm": alg,
                       "servers": servers, "params": params, "steps": s["steps"], "step_ms": s["step_time_s"] * 1e3,
                       "worker_sent_kb_step": s["bytes_sent_per_worker_per_step"] / 1e3,
                       "server_recv_kb_step": (s["bytes_recv_per_server"] or 0) / steps / 1e3 if servers else None,
                       "server_sent_kb_step": (s["bytes_sent_per_server"] or 0) / steps / 1e3 if servers else None,
                       "time_to_target_s": s["time_to_target_s"], "steps_to_target": s["steps_to_target"],
                       "final_accuracy": s.get("final_accuracy", s.get("final_loss")), "train_s": s["train_s"],
                       "staleness_mean": sm.get("staleness_mean"), "staleness_max": sm.get("staleness_max")}
                rows.append(row)
                print(f"{network:8s} {label:18s} step {row['step_ms']:7.1f} ms  worker "
                      f"{row['worker_sent_kb_step']:7.1f} kB/step  server in {_fmt(row['server_recv_kb_step'])} out "
                      f"{_fmt(row['server_sent_kb_step'])} kB/step  target {_fmt(row['time_to_target_s'], digits=2)} s"
                      f" (step {row['steps_to_target']})  final {row['final_accuracy']:.4f}  τ mean "
                      f"{_fmt(row['staleness_mean'], digits=2)}", flush=True)
    finally:
        for p in pools.values():
            p.close()
    if args.out:
        write_json(rows, args.out, "ps.json", indent=2)
        _plot(rows, os.path.join(args.out, "ps.png"))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def _plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    networks = list(dict.fromkeys(r["network"] for r in rows))
    labels = list(dict.fromkeys(r["run"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(networks))]
        get = {r["network"]: r for r in rows if r["run"] == label}
        axes[0].bar(xs, [get[n]["step_ms"] for n in networks], width, label=label)
        axes[1].bar(xs, [get[n]["final_accuracy"] for n in networks], width, label=label)
    for ax, title in zip(axes, ("median step time (ms)", "final accuracy (metric)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(networks))], networks)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    save(fig, path)


def register(subparsers) -> None:
    p = subparsers.add_parser("ps", help="parameter server: bsp/ssp/asp against all-reduce bsp")
    p.add_argument("--workload", default="digits-mlp")
    p.add_argument("--networks", nargs="+", default=["lan", "cluster", "wan"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--staleness", default="2,8", help="comma-separated SSP bounds")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum of every run (default: the workload's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
