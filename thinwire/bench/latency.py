"""`thinwire bench latency`: scalability and accuracy of algorithms across one-way latencies (Zhu, Lu, Lin, Han 2019,
"Distributed Training Across the World" (DTS), Fig. 3).

For each algorithm and each latency (a `custom:` network at a fixed bandwidth) it trains the workload for a
fixed number of steps and reports throughput / throughput of the same workers with `local` (no communication,
the limit of this machine) and the final accuracy. Runs whose synchronous α-β lower bound would take longer
than `--budget-s` are shortened (never below `--min-steps`); the table says how many steps each run took.

    thinwire bench latency --workload wide-mlp --latencies 0,25,50,100,250,500 --bandwidth 1gbit \
        --algorithms bsp delayed:delay=4 tsparse:period=20 dts:delay=4,period=20 --out docs/benchmarks
"""
from __future__ import annotations

import json

from ..algorithms import registry
from ..errors import UserError
from ..files import pyplot, save, write_json
from ..launcher import Pool
from ..net import parse_network, ring_allreduce
from ..run.train import TrainConfig, run_training
from ..run.workloads import get as get_workload


def _spec(text: str) -> tuple[str, dict]:
    """`name` or `name:key=value,key=value`."""
    name, _, rest = text.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        if "=" not in item:
            raise UserError(f"malformed algorithm spec {text!r}; e.g. dts:delay=4,period=20")
        k, v = item.split("=", 1)
        params[k.strip()] = v.strip()
    return name, params


def specs(texts: list[str]) -> list[tuple[str, dict]]:
    """Every `--algorithms` spec parsed, its algorithm checked to be registered before any run starts."""
    out = [_spec(t) for t in texts]
    for name, _ in out:
        registry.lookup(name)
    return out


def label(name: str, params: dict) -> str:
    return name if not params else f"{name}(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")"


def run(args) -> int:
    algorithms = specs(args.algorithms)
    try:
        latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--latencies takes one-way milliseconds separated by commas, e.g. 0,25,250; got "
                        f"{args.latencies!r}") from None
    if not latencies:
        raise UserError(f"--latencies names no latency, got {args.latencies!r}")
    wl = get_workload(args.workload)
    n_params = wl.num_params()
    rows = []

    def cfg_for(name, params, network, steps):
        return TrainConfig(workload=args.workload, algorithm=name, workers=args.workers, network=network,
                           steps=steps, batch_size=args.batch_size, seed=args.seed, params=dict(params),
                           compressor=args.compressor if name != "local" else None,
                           eval_every=steps, progress=False)

    def baseline(pool):
        s = run_training(cfg_for("local", {}, "lan", args.steps), pool=pool)
        print(f"local: {s['throughput_samples_s']:.1f} samples/s (step {s['step_time_s'] * 1e3:.1f} ms)", flush=True)
        return s["throughput_samples_s"]

    def network(lat: float) -> str:
        return f"custom:bandwidth={args.bandwidth},latency={lat:g}ms" + (f",jitter={args.jitter}" if args.jitter else "")

    # every run checked as `thinwire train` checks one, before the workers start
    cfg_for("local", {}, "lan", args.steps).validate()
    for name, params in algorithms:
        for lat in latencies:
            cfg_for(name, params, network(lat), args.steps).validate()
    base = []
    with Pool(args.workers, timeout=3600, start_timeout=900) as pool:
        before = baseline(pool)   # the machine may be shared: each sweep is measured against the `local`
        for name, params in algorithms:  # runs just before and just after it
            sweep = []
            for lat in latencies:
                link = parse_network(network(lat)).handshaking()   # as the Transport charges
                bound = ring_allreduce(link, args.workers, n_params * 4).time
                steps = args.steps
                if name == "bsp" and bound * steps > args.budget_s:
                    steps = max(args.min_steps, int(args.budget_s / bound))
                s = run_training(cfg_for(name, params, network(lat), steps), pool=pool)
                sweep.append({"algorithm": label(name, params), "latency_ms": lat, "steps": steps,
                              "throughput": s["throughput_samples_s"],
                              "accuracy": s.get("final_accuracy") if steps == args.steps else None,
                              "loss": s.get("final_loss") if steps == args.steps else None,
                              "step_ms": s["step_time_s"] * 1e3, "exposed_comm_s": s["exposed_comm_s"],
                              "emulated_comm_s": s["emulated_comm_s"],
                              "bytes_per_step": s["bytes_sent_per_worker_per_step"],
                              "max_in_flight": s["algorithm_metrics"].get("max_in_flight")})
            after = baseline(pool)
            base += [before, after]
            for row in sweep:
                row["local_throughput"] = (before + after) / 2
                row["scalability"] = row["throughput"] / row["local_throughput"]
                rows.append(row)
                acc = "" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
                print(f"{row['algorithm']:<24} {row['latency_ms']:6g} ms  steps {row['steps']:4d}  "
                      f"scal {row['scalability']:.3f}  acc {acc}  step {row['step_ms']:.1f} ms  "
                      f"exposed {row['exposed_comm_s']:.2f} s  emulated {row['emulated_comm_s']:.2f} s", flush=True)
            before = after
    local = sum(base) / len(base)
    result = {"workload": args.workload, "workers": args.workers, "bandwidth": args.bandwidth,
              "batch_size": args.batch_size or wl.batch_size, "steps": args.steps, "compressor": args.compressor,
              "local_throughput": local, "local_runs": base, "rows": rows}
    if args.out:
        stem = write_json(result, args.out, f"latency_{args.workload}.json", indent=2).removesuffix(".json")
        _plot(result, stem + ".png")
        print(f"written to {stem}.json, {stem}.png")
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0


def markdown(result: dict) -> str:
    lats = sorted({r["latency_ms"] for r in result["rows"]})
    algs = list(dict.fromkeys(r["algorithm"] for r in result["rows"]))
    cell = {(r["algorithm"], r["latency_ms"]): r for r in result["rows"]}
    head = "| algorithm | " + " | ".join(f"{x:g} ms" for x in lats) + " | final accuracy |"
    lines = [head, "|" + " --- |" * (len(lats) + 2)]
    for a in algs:   # accuracy does not depend on the network (same seed, same numbers): one value per row
        accs = sorted({round(cell[(a, x)]["accuracy"], 4) for x in lats
                       if (a, x) in cell and cell[(a, x)]["accuracy"] is not None})
        acc = "/".join(f"{v:.4f}" for v in accs)
        short = lambda r: "*" if r["steps"] != result["steps"] else ""
        lines.append(f"| {a} | " + " | ".join(f"{cell[(a, x)]['scalability']:.3f}{short(cell[(a, x)])}"
                                             if (a, x) in cell else "" for x in lats) + f" | {acc} |")
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    plt = pyplot()
    lats = sorted({r["latency_ms"] for r in result["rows"]})
    pos = {x: i for i, x in enumerate(lats)}   # latencies evenly spaced: 0 has no place on a log axis
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        pts = sorted((r["latency_ms"], r["scalability"]) for r in result["rows"] if r["algorithm"] == a)
        ax.plot([pos[p[0]] for p in pts], [p[1] for p in pts], marker="o", label=a)
    ax.set_xticks(range(len(lats)), [f"{x:g}" for x in lats])
    ax.set_xlabel("one-way latency (ms)")
    ax.set_ylabel("scalability (throughput / throughput of `local`)")
    top = max([1.1] + [r["scalability"] + 0.1 for r in result["rows"]])
    ax.set_ylim(0, top)
    ax.axhline(0.7, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title(f"{result['workload']}, {result['workers']} workers, {result['bandwidth']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def register(sub) -> None:
    p = sub.add_parser("latency", help="scalability and accuracy vs one-way latency (Zhu et al. 2019, DTS, Fig. 3)")
    p.add_argument("--workload", default="wide-mlp")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", default="1gbit", help="fixed bandwidth of every custom: network")
    p.add_argument("--jitter", default="", help="jitter of every network, e.g. 20ms")
    p.add_argument("--latencies", default="0,25,50,100,250,500", help="one-way latencies in ms")
    p.add_argument("--algorithms", nargs="+", default=["bsp", "delayed:delay=4", "delayed:delay=20",
                                                       "tsparse:period=4", "tsparse:period=20",
                                                       "dts:delay=4,period=20"],
                   help="name or name:key=value,key=value")
    p.add_argument("--compressor", help="compressor for the algorithms that take one")
    p.add_argument("--budget-s", type=float, default=90.0, help="shorten bsp runs predicted longer than this")
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--out", help="directory for latency_<workload>.json and .png")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
