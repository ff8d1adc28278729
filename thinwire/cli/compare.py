"""`thinwire compare`: which algorithm wins on your network — a race to the target of (contestant × network × seed)
training runs, thinwire's algorithms against PyTorch's own options and torchft's DiLoCo, each with the same budget of
training time, with results.json, report.md and PNG plots in --out DIR.

  thinwire compare --preset quick --out results/demo
  thinwire compare --workload digits-mlp --algorithms bsp,dts,ddp --network lan,wan --budget 60 --seeds 3
  thinwire compare --algorithms "bsp; bsp+topk:ratio=0.01,memory=residual" --network wan --workers 4
  thinwire compare --resume results/demo            # run the cells an interrupted matrix is missing
"""
from __future__ import annotations

import sys


def _split(text: str, continues) -> list[str]:
    """Items separated by ';', or by ',' except where `continues(previous item, item)`."""
    if ";" in text:
        return [c.strip() for c in text.split(";") if c.strip()]
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if out and item and continues(out[-1], item):
            out[-1] += "," + item
        elif item:
            out.append(item)
    return out


def split_cells(text: str) -> list[str]:
    """Cells are separated by ';', or by ',' where the next item does not look like key=value
    (so `bsp,dts:delay=4,period=4,ddp` is three cells)."""
    return _split(text, lambda prev, item: ":" in prev and "=" in item
                  and not {":", "+"} & set(item.split("=", 1)[0]))


def register(sub) -> None:
    from ..run import presets
    p = sub.add_parser("compare", help="compare algorithms (and PyTorch's options) on your networks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", help="workload (default: the preset's, else digits-mlp)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--algorithms", help="cells: ALGO[:k=v,...][+COMPRESSOR[:k=v,...,memory=M]] or a PyTorch peer "
                                        f"({', '.join(presets.PEERS)}), comma- or ';'-separated")
    g.add_argument("--preset", help=f"a named matrix: {', '.join(presets.names())}")
    p.add_argument("--network", help="comma-separated profiles (lan, dc, cluster, wan, world, custom:...; "
                                     "separate custom specs with ';')")
    p.add_argument("--workers", type=int, help="workers per cell (default: the preset's, else 4)")
    p.add_argument("--epochs", type=float, help="an upper bound on the epochs of a cell (default: none with a budget, "
                                                "else the workload's)")
    p.add_argument("--target", type=float, help="the target metric, accuracy or loss (default: the workload's)")
    p.add_argument("--budget", type=float, metavar="S",
                   help="seconds of training time every cell gets (evaluations excluded; default: the preset's)")
    p.add_argument("--seeds", type=int, help="run every cell with this many seeds (median and range in the report; "
                                             "default: the preset's, else 1)")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate every N steps instead of the race's cadence (closing in on the target, 2 %% of the "
                        "clock near it): the step a cell stops at no longer depends on timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output directory (default results/compare)")
    p.add_argument("--trace", action="store_true", help="write a Chrome trace per thinwire cell")
    p.add_argument("--tensorboard", metavar="DIR", help="TensorBoard scalars per cell under DIR/<cell> (loss, metric, "
                                                        "bytes, exposed communication; extra thinwire[tensorboard])")
    p.add_argument("--resume", metavar="DIR", help="continue the matrix in DIR (its cells that are not done)")
    p.add_argument("--netem", action="store_true",
                   help="real-network mode (Linux, root): workers in network namespaces, links shaped for real")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL, one worker per GPU: --workers <= the GPUs); "
                        "recorded in every result")
    p.add_argument("--json", action="store_true", help="print results.json to stdout at the end")
    p.set_defaults(func=run)


def _networks(text: str) -> list[str]:
    return _split(text, lambda prev, item: prev.startswith("custom:") and "=" in item)


def check_numbers(args) -> None:
    """The numbers of `compare` in their ranges, before any cell starts (NaN and infinities included)."""
    from ..run.launcher import MAX_LOCAL_WORKERS
    from ..run.train import MAX_SEED, check_int, check_number
    if args.workers is not None:
        check_int("--workers", args.workers, 1, MAX_LOCAL_WORKERS - 1)  # + 1 rank for a parameter server
    if args.epochs is not None:
        check_number("--epochs", args.epochs, 0, low_open=True)
    if args.target is not None:
        check_number("--target", args.target, 0, why=" (an accuracy in [0, 1], or a loss)")
    if args.budget is not None:
        check_number("--budget", args.budget, 0, low_open=True, why=" (seconds of training time per cell)")
    if getattr(args, "seeds", None) is not None:
        check_int("--seeds", args.seeds, 1, 100)
    if getattr(args, "eval_every", None) is not None:
        check_int("--eval-every", args.eval_every, 1)
    check_int("--seed", args.seed, 0, MAX_SEED)


def config_from_args(args):
    from ..errors import UserError
    from ..run import presets
    from ..run.compare import CompareConfig
    check_numbers(args)
    if args.preset:
        pr = presets.get(args.preset)
        cells, workers, nets, budget, epochs, seeds = (list(pr.cells), pr.workers, pr.networks, pr.budget_s,
                                                       pr.epochs, pr.seeds)
        batch = pr.batch_size if not args.workload or args.workload == pr.workload else None
        workload, target = pr.workload, pr.target
        if args.workload and args.workload != workload:
            target = None  # the preset's target is for its own workload
    else:
        if not args.algorithms:
            raise UserError("give --algorithms a,b,... or --preset NAME "
                            f"({', '.join(presets.names())})")
        cells, workload, workers, nets = split_cells(args.algorithms), "digits-mlp", 4, ["wan"]
        budget = epochs = target = batch = None
        seeds = 1
    return CompareConfig(workload=args.workload or workload, workers=args.workers or workers,
                         networks=_networks(args.network) if args.network else list(nets), cells=cells,
                         target=args.target if args.target is not None else target,
                         budget_s=args.budget if args.budget is not None else budget,
                         epochs=args.epochs if args.epochs is not None else epochs, seed=args.seed,
                         seeds=getattr(args, "seeds", None) or seeds, trace=args.trace, netem=args.netem,
                         preset=args.preset, tensorboard=getattr(args, "tensorboard", None),
                         eval_every=getattr(args, "eval_every", None), batch_size=batch,
                         device=getattr(args, "device", "cpu"))


def run(args) -> int:
    import json
    from ..errors import UserError
    from ..run.compare import compare
    from ..run.train import check_writable_dir
    if args.resume:
        if args.preset or args.algorithms or args.network:
            raise UserError("--resume DIR continues the matrix stored in DIR; give no --preset/--algorithms/--network")
        check_writable_dir(args.resume, "--resume")
        out, results = args.resume, compare(None, args.resume, resume=True)
    else:
        cfg = config_from_args(args)
        out = args.out or "results/compare"
        check_writable_dir(out, "--out")  # before the first cell: never lose the matrix to a bad path
        results = compare(cfg, out)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"report: {out}/report.md   results: {out}/results.json   plots: "
              + ", ".join(f"{out}/{p}" for p in (results.get("plots") or {}).values()))
    sys.stdout.flush()
    return 0 if any(r.get("status") == "ok" for r in results["cells"]) else 1
