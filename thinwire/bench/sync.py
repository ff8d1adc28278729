"""`thinwire bench sync`: local SGD and gossip against bsp, and the all-reduce algorithms against their formulas.

    thinwire bench sync                       # digits-mlp, 4 workers, lan/cluster/wan, 7 configurations each
    thinwire bench sync --allreduce           # each all-reduce algorithm: measured time vs its α-β formula
"""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from ..comm import Transport
from ..comm.collectives import ALGORITHMS
from ..files import emit
from ..launcher import Pool
from ..net import parse_network
from ..net.cost import ALLREDUCE
from ..run.train import TrainConfig, run_training

OUT = "file"    # --out names the JSON file of the rows (thinwire/cli/bench.py checks it first)

CASES = [("bsp", None, {}), ("localsgd", None, {"period": 4}), ("localsgd", None, {"period": 16}),
         ("dpsgd", None, {"topology": "ring"}), ("choco", "topk", {"ratio": 0.1, "gamma": 0.5}),
         ("adpsgd", None, {}), ("sgp", None, {})]


def _time_allreduce(rank, world_size, numel):
    """Per algorithm: median over 3 of the slowest rank's time for one all-reduce, and rank's bytes sent."""
    tp = Transport()
    out = {}
    for algo in ALGORITHMS:
        tp.allreduce = algo
        times = []
        for _ in range(3):
            x = torch.randn(numel)
            dist.barrier()
            t0, b0 = time.perf_counter(), tp.meter.bytes_sent
            tp.all_reduce(x)
            d = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            times.append(float(d))
            sent = tp.meter.bytes_sent - b0
        out[algo] = (sorted(times)[1], sent)
    return out


def run(args) -> int:
    rows = []
    with Pool(args.workers, timeout=900, start_timeout=600) as pool:
        for net in args.networks:
            if args.allreduce:
                for nbytes in (10_000, 1_000_000):
                    got = pool.run(_time_allreduce, nbytes // 4, network=net)[0]
                    for algo, (t, sent) in got.items():
                        want = ALLREDUCE["ring" if algo == "gloo" else algo](parse_network(net), args.workers, nbytes)
                        rows.append({"network": net, "bytes": nbytes, "algorithm": algo, "measured_s": t,
                                     "formula_s": want.time, "sent": sent})
                        if not args.json:
                            print(f"{net:8s} {nbytes:>8d} B {algo:20s} {1000 * t:8.1f} ms  formula "
                                  f"{1000 * want.time:8.1f} ms  sent {sent:.0f} B", flush=True)
                continue
            for algo, comp, params in CASES:
                cfg = TrainConfig(workload=args.workload, algorithm=algo, workers=args.workers, network=net,
                                  epochs=args.epochs, compressor=comp, params=dict(params), progress=False,
                                  seed=args.seed)
                s = run_training(cfg, pool=pool)
                s["algorithm_metrics"].pop("consensus_history", None)
                rows.append(s)
                if not args.json:
                    print(f"{net:8s} {algo:9s} {json.dumps(params):34s} step {1000 * s['step_time_s']:7.1f} ms  "
                          f"{s['bytes_sent_per_worker_per_step'] / 1e3:7.1f} kB/step  to target "
                          f"{s['time_to_target_s']} s ({s['steps_to_target']} steps)  final "
                          f"{s.get('final_accuracy', s.get('final_loss')):.4f}", flush=True)
    emit(rows, args.out, args.json)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("sync", help="local SGD and gossip vs bsp; all-reduce algorithms vs their formulas")
    p.add_argument("--workload", default="digits-mlp")
    p.add_argument("--networks", nargs="+", default=["lan", "cluster", "wan"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allreduce", action="store_true", help="time the all-reduce algorithms instead")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
