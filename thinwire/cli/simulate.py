"""`thinwire simulate`: scalability of the schedules for many workers and latencies (discrete-event model)."""
from __future__ import annotations

import json
import os

from ..errors import UserError
from ..files import check_writable_dir, pyplot, save, write_json
from ..net import parse_bandwidth
from ..net.link import MAX_BANDWIDTH, MIN_BANDWIDTH
from ..plan.simulate import WORLD_LATENCY, SimConfig, simulate
from ..registry import check_params, params_of
from ..run.train import MAX_SEED, check_int, check_number

def _parse_algorithms(text: str) -> list[tuple[str, str, dict]]:
    out = []
    for item in filter(None, text.split(",")):
        name, *kv = item.split(":")
        if not all("=" in pair for pair in kv):
            raise UserError(f"malformed schedule {item!r}; e.g. dts:delay=4:period=4")
        out.append((item, name, dict(pair.split("=", 1) for pair in kv)))   # typed and checked in `run`
    return out


def _numbers(text: str, what: str, kind=float) -> list:
    try:
        values = [kind(v.strip().removesuffix("ms")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"malformed {what} list {text!r}" + ("; e.g. 4,16,256" if kind is int else "")) from None
    if not values:
        raise UserError(f"{what} needs at least one value, got {text!r}")
    return values


MAX_WORKERS, MAX_STEPS, MAX_LATENCY_MS = 65536, 1_000_000, 60_000.0


def check_numbers(args) -> None:
    """Every number of `simulate` in its range before anything runs (NaN and infinities included)."""
    check_number("--params", args.params, 1, 1e13)
    check_number("--compute-ms", args.compute_ms, 0, 3.6e6, low_open=True)
    check_number("--compute-cv", args.compute_cv, 0, 10)
    check_number("--straggler-prob", args.straggler_prob, 0, 1)
    check_int("--steps", args.steps, 1, MAX_STEPS)
    check_int("--servers", args.servers, 1, MAX_WORKERS)
    check_int("--seed", args.seed, 0, MAX_SEED)
    if args.out is not None:
        check_writable_dir(args.out, "--out")


def run(args) -> int:
    check_numbers(args)
    algorithms = _parse_algorithms(args.algorithms)
    if not algorithms:
        raise UserError(f"--algorithms names no schedule, got {args.algorithms!r}; e.g. bsp,dts:delay=4")
    workers = _numbers(args.workers, "--workers", kind=int)
    latencies = _numbers(args.latency, "--latency")
    if any(w < 1 or w > MAX_WORKERS for w in workers):
        raise UserError(f"--workers values must be in 1..{MAX_WORKERS}")
    if not all(0 <= v <= MAX_LATENCY_MS for v in latencies):  # NaN fails too
        raise UserError(f"--latency values must be one-way milliseconds in 0..{MAX_LATENCY_MS:g}, got {args.latency!r}")
    latencies = [v * 1e-3 for v in latencies]
    bandwidth = parse_bandwidth(args.bandwidth)
    if not MIN_BANDWIDTH <= bandwidth <= MAX_BANDWIDTH:
        raise UserError(f"--bandwidth must be in 1kbit..10000gbit (1e3..1e13 bit/s), got {args.bandwidth!r}")
    fields = params_of(SimConfig)
    runs = []
    for label, name, params in algorithms:
        params = check_params(f"schedule {name!r}", fields, params)   # the registry's rules: type, finiteness
        for n in workers:
            for lat in ([None] if args.regions == "world" else latencies):
                cfg = SimConfig(workers=n, params=args.params, compute_s=args.compute_ms / 1e3,
                                compute_cv=args.compute_cv, straggler_prob=args.straggler_prob,
                                bandwidth=bandwidth, latency=lat or 0.0, algorithm=name, steps=args.steps,
                                regions=WORLD_LATENCY if args.regions == "world" else None,
                                collective=args.collective, seed=args.seed, servers=args.servers)
                for key, value in params.items():
                    setattr(cfg, key, value)
                cfg.validate()                  # every configuration before the first is simulated
                runs.append((label, n, lat, cfg))
    rows = [{"schedule": label, "workers": n, "latency_s": lat, **simulate(cfg).to_dict()}
            for label, n, lat, cfg in runs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'schedule':<26} {'workers':>7} {'latency':>9} {'iteration':>11} {'scalability':>11}")
        for r in rows:
            lat = "regions" if r["latency_s"] is None else f"{r['latency_s'] * 1e3:.0f} ms"
            print(f"{r['schedule']:<26} {r['workers']:>7} {lat:>9} {r['iteration_s'] * 1e3:>9.1f}ms "
                  f"{r['scalability']:>11.3f}")
    if args.out is not None:
        write_json(rows, args.out, "simulate.json", indent=2)
        for path in plot(rows, args.out):
            if not args.json:
                print(f"plot: {path}")
    return 0


def plot(rows: list[dict], out: str) -> list[str]:
    paths = []
    lats = sorted({r["latency_s"] for r in rows if r["latency_s"] is not None})
    workers = sorted({r["workers"] for r in rows})
    if len(lats) > 1:
        n0 = workers[0]
        paths.append(_plot(rows, os.path.join(out, "scalability_vs_latency.png"), lambda r: r["latency_s"] * 1e3,
                           lambda r: r["workers"] == n0 and r["latency_s"] is not None,
                           xlabel="one-way latency (ms)",
                           ylabel="scalability (throughput / no-communication throughput)",
                           title=f"Simulated scalability vs latency, {n0} workers"))
    if len(workers) > 1:
        l0 = lats[0] if lats else None
        where = "four world regions" if l0 is None else f"{l0 * 1e3:.0f} ms one-way"
        paths.append(_plot(rows, os.path.join(out, "scalability_vs_workers.png"), lambda r: r["workers"],
                           lambda r: r["latency_s"] == l0, log2=True, xlabel="workers", ylabel="scalability",
                           title=f"Simulated scalability vs workers ({where})"))
    return paths


def _plot(rows: list[dict], path: str, x, keep, log2: bool = False, **labels) -> str:
    """One line of scalability against `x(row)` per schedule, over the rows `keep(row)` selects, written to `path`."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for lab in dict.fromkeys(r["schedule"] for r in rows):
        pts = sorted((x(r), r["scalability"]) for r in rows if r["schedule"] == lab and keep(r))
        ax.plot(*zip(*pts), marker="o", label=lab)
    if log2:
        ax.set_xscale("log", base=2)
    ax.set(**labels, ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)
    return path


def register(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of many workers (scalability vs latency/workers)")
    p.add_argument("--algorithms", default="bsp,delayed:delay=4,tsparse:period=4,dts:delay=4:period=4",
                   help="comma list of schedules, each optionally with parameters: bsp,dts:delay=4:period=4,"
                        "localsgd:period=16")
    p.add_argument("--workers", default="4", help="comma list, e.g. 4,16,256,4096")
    p.add_argument("--latency", default="0", help="one-way latencies in ms, comma list, e.g. 0,25,50,100,250,500")
    p.add_argument("--regions", choices=["none", "world"], default="none",
                   help="world: workers split across four regions with a latency matrix (replaces --latency)")
    p.add_argument("--bandwidth", default="1gbit", help="per-worker link, e.g. 100mbit")
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--compute-ms", type=float, default=300.0)
    p.add_argument("--compute-cv", type=float, default=0.05, help="spread of compute times (coefficient of variation)")
    p.add_argument("--straggler-prob", type=float, default=0.0)
    p.add_argument("--collective", default="auto",
                   help="auto, ring, tree, recursive_doubling, recursive_halving, double_binary_tree, hierarchical, "
                        "torus")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for simulate.json and PNG plots")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
