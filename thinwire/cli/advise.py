"""`thinwire advise`: which algorithm wins on this network, predicted before renting the machines."""
from __future__ import annotations

import json

from ..errors import UserError


MAX_PARAMS = 1e13          # ten trillion parameters
MAX_COMPUTE_MS = 3.6e6     # one hour per iteration
MAX_WORKERS = 2**20        # a cost model, not a launch: any cluster size


def check_numbers(args) -> None:
    """Every number of `advise` in its range, before any work (NaN and infinities included)."""
    if args.params is not None and not 1 <= args.params <= MAX_PARAMS:
        raise UserError(f"--params must be a number of parameters in 1..{MAX_PARAMS:g}, got {args.params}")
    if not 0 < args.compute_ms <= MAX_COMPUTE_MS:
        raise UserError(f"--compute-ms must be in (0, {MAX_COMPUTE_MS:g}] (one hour), got {args.compute_ms}")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise UserError(f"--workers must be in 1..{MAX_WORKERS}, got {args.workers}")
    if not 0 <= args.servers <= MAX_WORKERS:
        raise UserError(f"--servers must be in 0..{MAX_WORKERS}, got {args.servers}")
    if not 0 < args.scalability <= 1:
        raise UserError(f"--scalability must be in (0, 1], got {args.scalability}")


def run(args) -> int:
    from .. import speeds
    from ..net import parse_network
    from ..plan.advise import advise, format_diloco, format_table, recommend_diloco
    from ..bench.calibrate import calibrate, load_calibration
    from ..plan.costmodel import Scenario, scenario_speeds
    check_numbers(args)
    paces = scenario_speeds(speeds.parse(args.speeds), args.workers)    # a bad spec: one line, before any work
    if args.calibrate:
        cal = calibrate(workers=args.workers if args.workers <= 4 else 2)
        print(json.dumps(cal, indent=2) if args.json else f"calibration stored: {cal['path']}\n"
              f"  loopback alpha {cal['alpha_s'] * 1e6:.1f} us, beta {1 / cal['beta_s_per_byte'] / 1e9:.2f} GB/s")
        return 0
    measured = None
    if sum(v is not None for v in (args.workload, args.model, args.params)) > 1:
        raise UserError("give one of --params, --model and --workload")
    if args.out is not None:
        from ..files import check_writable_dir
        check_writable_dir(args.out, "--out")
    if args.workload:       # one worker's step timed here, the size read off the model
        from ..run import user
        from ..run.measure import measure_step
        args.workload = user.canonical(args.workload)
        measured = measure_step(args.workload, device=args.device, workers=args.workers, local=args.local)
        name = measured.pop("name")
        params, args.compute_ms = measured["params"], measured["compute_s"] * 1e3
    elif args.model:
        from ..run import workloads
        params = workloads.get(args.model).num_params()
    elif args.params is not None:
        params = args.params
    else:
        raise UserError("give --params N, --model WORKLOAD (its size) or --workload WORKLOAD (measured here)")
    network = args.network
    if args.bandwidth is not None or args.latency is not None:
        network = "custom:" + ",".join(f"{k}={v}" for k, v in (("bandwidth", args.bandwidth),
                                                                ("latency", args.latency)) if v)
    link = parse_network(network)
    cal = load_calibration()
    s = Scenario(params=params, compute_s=args.compute_ms / 1e3, link=link, workers=args.workers,
                 servers=args.servers, collective=args.collective, x_memcpy=cal.get("x_memcpy", {}) if cal else {},
                 **paces)
    rows = advise(s)
    diloco = recommend_diloco(s, args.scalability)
    advice = {"scenario": {"params": params, "compute_s": s.compute_s, "network": link.to_dict(),
                           "workers": s.workers, "servers": s.servers, "collective": s.collective,
                           **({"speeds_spec": args.speeds, **paces} if paces else {})},
              "ranking": [a.row() for a in rows], "diloco": diloco}
    planned = None
    if paces:           # what a `diloco` cell would run at these speeds: synchronous, dynamic, quorum or async
        from ..plan.diloco import plan_diloco
        planned = plan_diloco(s)
        advice["diloco_plan"] = {"algorithm": planned.algorithm, "params": planned.params(),
                                 "compressor": planned.compressor, "memory": planned.memory,
                                 "iteration_s": planned.iteration_s, "scalability": planned.scalability}
    if measured is not None:
        advice = {"workload": args.workload, "workload_name": name, "network": network,
                  "measured": measured, **advice}
    if args.out:
        from ..run.measure import write_advice
        write_advice(args.out, advice)
    if args.json:
        print(json.dumps(advice, indent=2))
    else:
        if measured is not None:
            print(f"measured {name}: {measured['params']:,} parameters, step "
                  f"{measured['step_s'] * 1e3:.1f} ms (median of {measured['steps']}, {measured['threads']} "
                  f"thread(s) on {measured['device']})" + (f"; {measured['compute_s'] * 1e3:.1f} ms with its "
                                                           f"{args.workers} workers together on {measured['cpus']} "
                                                           f"cores" if "together_s" in measured else ""))
        print(format_table(rows, s))
        print(format_diloco(diloco))
        if planned is not None:
            print(f"DiLoCo at these speeds: {planned.algorithm}, {planned.describe()}")
        if args.out:
            print(f"written to {args.out}/advice.json")
    return 0


def register(sub) -> None:
    from ..plan.costmodel import COLLECTIVES
    p = sub.add_parser("advise", help="rank algorithms for a model, compute time and network (cost model)")
    p.add_argument("--params", type=float, help="number of model parameters, e.g. 25e6")
    p.add_argument("--model", help="read the size from a workload (see `thinwire list`)")
    p.add_argument("--workload", help="measure a workload's step here and read its size: a name (see `thinwire "
                                      "list`) or yours, module:function or path/to/file.py:function")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--workload: time the step there")
    p.add_argument("--local", action="store_true",
                   help="--workload: the workers share this machine, as `thinwire compare` runs them (each its "
                        "share of the cores); default: each worker is a machine like this one")
    p.add_argument("--out", metavar="DIR", help="write the advice (with --workload: and the measurement) to "
                                                "DIR/advice.json, to set beside a `compare --out DIR`'s results")
    p.add_argument("--compute-ms", type=float, default=100.0, help="forward+backward time per iteration (ms)")
    p.add_argument("--network", default="wan", help="profile name or custom:... (see `thinwire list`)")
    p.add_argument("--bandwidth", help="instead of --network: e.g. 200mbit")
    p.add_argument("--latency", help="instead of --network: one-way, e.g. 25ms")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--servers", type=int, default=1, help="parameter servers for PS algorithms")
    p.add_argument("--collective", default="ring", choices=sorted(COLLECTIVES), metavar="NAME",
                   help=f"all-reduce algorithm: {', '.join(sorted(COLLECTIVES))}")
    p.add_argument("--speeds", metavar="SPEC", help="workers of different speeds: factors per worker (1,1,1,0.5), "
                   "two speeds A:B or a profile (see `thinwire list`); a synchronous algorithm is predicted at its "
                   "slowest worker's pace, an asynchronous one at the sum of the speeds (docs/planner.md)")
    p.add_argument("--scalability", type=float, default=0.9,
                   help="the DiLoCo family's recommendation: smallest period H reaching this scalability (0.9)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's loopback α, β and store them")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
