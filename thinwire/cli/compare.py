"""`thinwire compare`: which algorithm wins on your network — a race to the target of (contestant × network × seed)
training runs, thinwire's algorithms against PyTorch's own options and torchft's DiLoCo, each with the same budget of
training time, with results.json, report.md and PNG plots in --out DIR.

  thinwire compare --preset quick --out results/demo
  thinwire compare --workload digits-mlp --algorithms bsp,dts,ddp --network lan,wan --budget 60 --seeds 3
  thinwire compare --algorithms "bsp; bsp+topk:ratio=0.01,memory=residual" --network wan --workers 4
  thinwire compare --resume results/demo            # run the cells an interrupted matrix is missing
  torchrun --nnodes 2 --nproc-per-node 1 ... -m thinwire compare --algorithms "bsp;localsgd" --budget 30
                                                    # on your machines (docs/multi-host.md)
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from ..compare import CompareConfig, cluster, compare, peers, presets
from ..errors import UserError
from ..files import check_writable_dir
from ..launcher import init, under_torchrun
from ..run.user import canonical
from .train import exit_past_gloo


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
    p = sub.add_parser("compare", help="compare algorithms (and PyTorch's options) on your networks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", help="workload (default: the preset's, else digits-mlp), or yours: "
                                      "module:function or path/to/file.py:function")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--algorithms", help="cells: ALGO[:k=v,...][+COMPRESSOR[:k=v,...,memory=M]] or a PyTorch peer "
                                        f"({', '.join(peers.names())}), comma- or ';'-separated")
    g.add_argument("--preset", help=f"a named matrix: {', '.join(presets.names())}")
    p.add_argument("--network", help="comma-separated profiles (lan, dc, cluster, wan, world, home, custom:..., "
                                     "islands:AxB or A+B,inside=NET,across=NET; separate custom specs with ';'; "
                                     "under torchrun: lan by default, the network between the processes as it is)")
    p.add_argument("--speeds", metavar="SPEC[;SPEC...]",
                   help="emulated worker speeds, a dimension of the matrix beside the network: per profile, factors "
                        "per worker (1,1,1,0.5), two speeds A:B, or a name (thinwire list); several separated by "
                        "';' (default: equal). The no-communication reference races the same speeds")
    p.add_argument("--faulty", metavar="RANK:KIND",
                   help="one faulty replica in every cell: RANK's contributions corrupted, KIND scale (x -10), noise, "
                        "stale or nan (docs/robust.md); cells give their rule (diloco:aggregate=median), torchft's "
                        "DiLoCo faces it too, other peers are refused")
    p.add_argument("--workers", type=int, help="workers per cell (default: the preset's, else 4; under torchrun: "
                                                "the processes it started)")
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
                   help="cpu (gloo, default) or cuda (NCCL, one worker per GPU; more workers than GPUs "
                        "share them over gloo); recorded in every result")
    p.add_argument("--json", action="store_true", help="print results.json to stdout at the end")
    p.set_defaults(func=run)


def _networks(text: str) -> list[str]:
    return _split(text, lambda prev, item: prev.startswith(("custom:", "islands:")) and "=" in item)


def config_from_args(args):
    """The matrix of a preset (or the defaults) with what the flags give instead, checked before any cell starts."""
    if args.preset:
        pr = presets.get(args.preset)
        own = not args.workload or args.workload == pr.workload  # the preset's target and batch are for its workload
        cfg = CompareConfig(workload=pr.workload, workers=pr.workers, networks=list(pr.networks), cells=list(pr.cells),
                            target=pr.target if own else None, budget_s=pr.budget_s, epochs=pr.epochs, seeds=pr.seeds,
                            batch_size=pr.batch_size if own else None, speeds=list(pr.speeds))
    elif args.algorithms:
        cfg = CompareConfig(cells=split_cells(args.algorithms))  # digits-mlp, 4 workers, wan
    else:
        raise UserError(f"give --algorithms a,b,... or --preset NAME ({', '.join(presets.names())})")
    torchrun = under_torchrun()     # every process torchrun started is a worker, on the network as it is
    given = dict(workload=canonical(args.workload) if args.workload else None,
                 workers=args.workers if args.workers is not None or not torchrun else cluster.world_size(),
                 target=args.target, budget_s=args.budget, epochs=args.epochs,
                 networks=_networks(args.network) if args.network else ["lan"] if torchrun else None,
                 seeds=getattr(args, "seeds", None),
                 speeds=[s.strip() for s in args.speeds.split(";")] if getattr(args, "speeds", None) else None)
    return replace(cfg, **{k: v for k, v in given.items() if v is not None}, seed=args.seed, trace=args.trace,
                   netem=args.netem, preset=args.preset, tensorboard=getattr(args, "tensorboard", None),
                   eval_every=getattr(args, "eval_every", None), device=getattr(args, "device", "cpu"),
                   faulty=getattr(args, "faulty", None), torchrun=torchrun).validate()


def run(args) -> int:
    return _run_torchrun(args) if under_torchrun() else _race(args)


def _run_torchrun(args) -> int:
    """Under torchrun (the same command on every node): every rank checks the flags (the same refusals everywhere,
    before any rendezvous); rank 0 runs the race on the processes torchrun started and writes the report
    (`thinwire.compare.cluster`), the others follow it; every rank exits with rank 0's status."""
    cfg = _resume_flags(args) if args.resume else config_from_args(args)
    rank, world = init("lan", seed=args.seed)
    if rank:
        exit_past_gloo(cluster.follow(rank, world))
    pool, code, error = cluster.ClusterPool(world), 1, None
    try:
        code = _race(args, cfg, pool)
    except UserError as e:
        code, error = 2, str(e)
        print(f"thinwire: error: {e}", file=sys.stderr)
    finally:
        pool.close(code, error)
    exit_past_gloo(code)


def _resume_flags(args) -> None:
    if args.preset or args.algorithms or args.network or getattr(args, "speeds", None) or \
            getattr(args, "faulty", None):
        raise UserError("--resume DIR continues the matrix stored in DIR; give no --preset/--algorithms/--network/"
                        "--speeds/--faulty")


def _race(args, cfg=None, pool=None) -> int:
    if args.resume:
        _resume_flags(args)
        check_writable_dir(args.resume, "--resume")
        out, results = args.resume, compare(None, args.resume, resume=True, pool=pool)
    else:
        cfg = cfg or config_from_args(args)
        out = "results/compare" if args.out is None else args.out
        check_writable_dir(out, "--out")  # before the first cell: never lose the matrix to a bad path
        results = compare(cfg, out, pool=pool)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"report: {out}/report.md   results: {out}/results.json   plots: "
              + ", ".join(f"{out}/{p}" for p in (results.get("plots") or {}).values()))
    sys.stdout.flush()
    return 0 if any(r.get("status") == "ok" for r in results["cells"]) else 1
