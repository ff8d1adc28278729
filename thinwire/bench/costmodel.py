"""`thinwire bench costmodel`: the planner's predicted step times against measured ones.

Each configuration of `thinwire.bench.validate.CONFIGS` trains briefly on `lan` (the machine's own compute and
loopback cost, the model's τ) and on each emulated network; the table gives measured and predicted step times
and the relative error of the prediction. This was a test with a 25% bound; a wall-clock bound on a shared
machine is a benchmark's figure, not a correctness property (issue 19).

    thinwire bench costmodel --networks cluster,wan --steps 48
"""
from __future__ import annotations

import json


def register(sub) -> None:
    from .validate import CONFIGS
    p = sub.add_parser("costmodel", help="predicted vs measured step times of the planner's cost model")
    p.add_argument("--workload", default="digits-mlp")
    p.add_argument("--networks", default="cluster,wan", help="comma-separated network presets or custom: specs")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import UserError
    from ..net import parse_network
    from ..launcher import Pool
    from .validate import CONFIGS, compare
    from ..run.workloads import get as get_workload
    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise UserError(f"unknown configuration {bad[0]!r}; valid: {', '.join(CONFIGS)}")
    networks = tuple(n for n in args.networks.split(",") if n)
    for n in networks:
        parse_network(n)
    get_workload(args.workload)
    if args.steps < 10:
        raise UserError(f"--steps must be at least 10, got {args.steps}")
    with Pool(args.workers, timeout=3600, start_timeout=900) as pool:
        rows = compare(pool, workload=args.workload, networks=networks, names=names, steps=args.steps,
                       workers=args.workers)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| network | configuration | local (ms) | measured (ms) | predicted (ms) | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['network']} | {r['config']} | {r['local_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.0%} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"largest error: {worst['error']:+.0%} ({worst['network']}, {worst['config']})")
    return 0
