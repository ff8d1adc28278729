"""`thinwire bench diloco`: the DiLoCo family's bytes per sync (peak bandwidth) and step times against the planner.

    thinwire bench diloco                        # wide-mlp, 4 workers: bytes per sync, plain vs streaming, 32/8/4 bits
    thinwire bench diloco --crossover            # + bsp vs diloco vs streaming as bandwidth and latency vary

Crossover: `local` (no communication) is measured first, on `lan`, in the same run; then every configuration of
CROSSOVER on every `--crossover-networks` network (default: 1 Gbit/s 1 ms, 100 Mbit/s 50 ms, 10 Mbit/s 200 ms).
Printed per network: the mean step time (training time / steps, so the sync steps count) as a ratio to `local`'s
and to bsp's on the same network, the cost model's prediction (compute = local's step), bytes per step, the
accuracy reached and the time to the workload's target; then the fastest configuration per network (the
crossover). The machine is shared: the ratios, not the milliseconds, are what carries over.

Bytes per sync: each configuration trains `--steps` steps on `lan` (bytes do not depend on the link); the bytes a
worker sent over those steps divided by the fragment syncs started in them (the largest step's bytes beside it: a
sync overlapped with the next step may be counted on either), the cost model's `bytes_per_sync` beside it.
Streaming DiLoCo sends 1/F of the model per sync (fragments are equal element ranges), F times as often: the peak
falls by F, the bytes per step stay DiLoCo's. Predicted against measured step times: `thinwire bench costmodel
--configs diloco,streaming-diloco` (as for the seed algorithms).
"""
from __future__ import annotations

from ..algorithms import get
from ..errors import UserError
from ..files import emit
from ..launcher import Pool
from ..net import parse_network
from ..plan.costmodel import Scenario, predict
from ..run import workloads
from ..run.train import TrainConfig, run_training, train_worker

OUT = "file"    # --out names the JSON file of the rows (thinwire/cli/bench.py checks it first)

CASES = [  # label, compressor, parameters
    ("diloco H=8", None, {"period": 8}),
    ("streaming F=2 τ=1", None, {"period": 8, "fragments": 2, "overlap": 1}),
    ("streaming F=4 τ=1", None, {"period": 8, "fragments": 4, "overlap": 1}),
    ("streaming F=8", None, {"period": 8, "fragments": 8}),
    ("diloco H=8 + fp8", "fp8", {"period": 8}),
    ("streaming F=4 τ=1 + fp4", "fp4", {"period": 8, "fragments": 4, "overlap": 1}),
]


CROSSOVER = [  # label, algorithm, compressor, parameters
    ("bsp", "bsp", None, {}),
    ("diloco H=8", "diloco", None, {"period": 8}),
    ("diloco H=8 + fp8", "diloco", "fp8", {"period": 8}),
    ("streaming H=8 F=4 τ=1", "diloco", None, {"period": 8, "fragments": 4, "overlap": 1}),
]
CROSSOVER_NETWORKS = ("custom:bandwidth=1gbit,latency=1ms", "custom:bandwidth=100mbit,latency=50ms",
                      "custom:bandwidth=10mbit,latency=200ms")


def crossover(pool, workload: str, workers: int, steps: int, networks=CROSSOVER_NETWORKS) -> list[dict]:
    """Rows of {network, config, step_s, vs_local, vs_bsp, predicted_s, bytes_per_step, accuracy/loss,
    time_to_target_s}; `local` on lan first, the baseline of every ratio (measured in this run)."""
    wl = workloads.get(workload)

    def train(algorithm, comp, params, network):
        cfg = TrainConfig(workload=workload, algorithm=algorithm, workers=workers, network=network, steps=steps,
                          compressor=comp, params=dict(params), progress=False, eval_every=8)
        s = run_training(cfg, pool=pool)
        return s, s["train_s"] / steps           # mean step: the sync steps included (the median would hide them)

    _, local = train("local", None, {}, "lan")
    rows = [{"network": "lan", "config": "local", "step_s": local, "vs_local": 1.0}]
    for net in networks:
        link = parse_network(net)
        # local runs no compressor: fp8's cost is charged from its declaration (`x_memcpy`)
        scen = Scenario(params=wl.num_params(), compute_s=local, link=link, workers=workers, handshake=True)
        bsp = None
        for label, algorithm, comp, params in CROSSOVER:
            s, step = train(algorithm, comp, params, net)
            bsp = step if algorithm == "bsp" else bsp
            pred = predict(scen, algorithm, comp or "none", **params)
            rows.append({"network": net, "config": label, "step_s": step, "vs_local": step / local,
                         "vs_bsp": step / bsp, "predicted_s": pred.iteration_s,
                         "bytes_per_step": s["bytes_sent_per_worker_per_step"],
                         wl.metric: s.get("final_" + wl.metric), "time_to_target_s": s["time_to_target_s"]})
    return rows


def format_crossover(rows: list[dict], metric: str) -> str:
    lines = [f"{'network':<38} {'configuration':<24} {'step ms':>8} {'x local':>8} {'x bsp':>6} {'pred ms':>8} "
             f"{'B/step':>9} {metric:>8} {'to target s':>11}"]
    for r in rows:
        if r["config"] == "local":
            lines.append(f"{'lan (baseline, no communication)':<38} {'local':<24} {r['step_s'] * 1e3:>8.1f} "
                         f"{1.0:>8.2f}")
            continue
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"
        lines.append(f"{r['network']:<38} {r['config']:<24} {r['step_s'] * 1e3:>8.1f} {r['vs_local']:>8.2f} "
                     f"{r['vs_bsp']:>6.2f} {r['predicted_s'] * 1e3:>8.1f} {r['bytes_per_step']:>9.0f} "
                     f"{r[metric]:>8.3f} {ttt:>11}")
    lines.append("fastest per network (the crossover):")
    for net in dict.fromkeys(r["network"] for r in rows if r["config"] != "local"):
        mine = [r for r in rows if r["network"] == net]
        best = min(mine, key=lambda r: r["step_s"])
        reached = [r for r in mine if r["time_to_target_s"] is not None]
        first = min(reached, key=lambda r: r["time_to_target_s"])["config"] if reached else "none reached the target"
        lines.append(f"  {net:<38} step time: {best['config']} ({best['vs_bsp']:.2f}x bsp); to target: {first}")
    return "\n".join(lines)


def bytes_per_sync(pool, workload: str, workers: int, steps: int) -> list[dict]:
    n_params = workloads.get(workload).num_params()
    rows = []
    for label, comp, params in CASES:
        cfg = TrainConfig(workload=workload, algorithm="diloco", workers=workers, network="lan", steps=steps,
                          compressor=comp, params=dict(params), progress=False, eval_every=10 ** 6)
        results = pool.run(train_worker, cfg, network="lan")
        alg = get("diloco", **params)
        syncs = sum(alg.starting(s) is not None for s in range(1, steps + 1))   # started within the steps
        # a sync's bytes are counted when its collectives complete: on its step, or the next with overlap
        sent = [sum(r["steps"][i]["bytes_sent"] for i in range(steps)) for r in results]
        peak = max(max(r["steps"][i]["bytes_sent"] for i in range(steps)) for r in results)
        s = Scenario(params=n_params, compute_s=0.0, link=parse_network("lan"), workers=workers)
        pred = predict(s, "diloco", comp or "none", **params)
        rows.append({"config": label, "compressor": comp, **params, "syncs": syncs,
                     "bytes_per_sync": max(sent) / syncs, "peak_step_bytes": peak, "bytes_per_step": max(sent) / steps,
                     "predicted_bytes_per_sync": pred.bytes_per_sync, "predicted_bytes_per_step": pred.bytes_per_step})
    base = rows[0]["bytes_per_sync"]
    for r in rows:
        r["sync_vs_diloco"] = r["bytes_per_sync"] / base
    return rows


def run(args) -> int:
    if args.steps < 8 or args.steps % 8:
        raise UserError(f"--steps must be a multiple of 8 (the period of every configuration), got {args.steps}")
    if args.crossover_steps < 8 or args.crossover_steps % 8:
        raise UserError(f"--crossover-steps must be a multiple of 8, got {args.crossover_steps}")
    for net in args.crossover_networks:
        parse_network(net)                                  # a bad network fails before any work starts
    out = {}
    with Pool(args.workers, timeout=900, start_timeout=600) as pool:
        out["bytes_per_sync"] = rows = bytes_per_sync(pool, args.workload, args.workers, args.steps)
        if not args.json:
            print(f"{args.workload}, {args.workers} workers, {args.steps} steps (bytes one worker sends, the "
                  f"busiest; close() not counted)")
            print(f"{'configuration':<26} {'syncs':>5} {'B/sync':>10} {'predicted':>10} {'vs diloco':>9} "
                  f"{'peak step B':>11} {'B/step':>9} {'predicted':>9}")
            for r in rows:
                print(f"{r['config']:<26} {r['syncs']:>5} {r['bytes_per_sync']:>10.0f} "
                      f"{r['predicted_bytes_per_sync']:>10.0f} {r['sync_vs_diloco']:>9.3f} "
                      f"{r['peak_step_bytes']:>11.0f} "
                      f"{r['bytes_per_step']:>9.0f} {r['predicted_bytes_per_step']:>9.0f}", flush=True)
        if args.crossover:
            out["crossover"] = cross = crossover(pool, args.crossover_workload, args.workers, args.crossover_steps,
                                                 tuple(args.crossover_networks))
            if not args.json:
                print(f"\ncrossover: {args.crossover_workload}, {args.workers} workers, {args.crossover_steps} steps "
                      f"(mean step time; ratios to local on lan and to bsp on the same network, this run)")
                print(format_crossover(cross, workloads.get(args.crossover_workload).metric), flush=True)
    emit(out, args.out, args.json)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("diloco", help="DiLoCo family: bytes per sync (plain vs streaming, bits), "
                                             "bsp vs diloco vs streaming across networks")
    p.add_argument("--workload", default="wide-mlp")
    p.add_argument("--workers", type=int, default=4, choices=range(2, 5), metavar="2..4")
    p.add_argument("--steps", type=int, default=16, help="steps per configuration (a multiple of 8)")
    p.add_argument("--crossover", action="store_true",
                   help="also bsp vs diloco vs streaming as bandwidth and latency vary (ratios to local, bsp)")
    p.add_argument("--crossover-workload", default="digits-mlp")
    p.add_argument("--crossover-steps", type=int, default=40, help="steps per crossover run (a multiple of 8)")
    p.add_argument("--crossover-networks", nargs="+", default=list(CROSSOVER_NETWORKS), metavar="NETWORK")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
