"""`thinwire bench matrix`: every registered algorithm (on each architecture it runs on) × every compressor with
its natural memory, each at its defaults on a small workload.

A cell is either refused at construction — `TrainConfig.validate()` raises a `UserError` whose message names the
alternatives, and the table shows it — or trained at its defaults, reporting the final metric, the steps to the
workload's target, bytes sent per worker per step, and whether it reached the target.

    thinwire bench matrix --only-algorithms bsp,dts --only-compressors topk,qsgd --markdown table.md

Parameter-server cells run with `--servers 1` beside `--ps-workers` workers (default `--workers`; a second
pool of workers + 1 ranks). A cell whose run fails is reported with its error and the next starts afresh.
Algorithms that take no compressor are run once (compressor "none").
"""
from __future__ import annotations

from .. import algorithms as algs
from ..compress import compressors as comps, memories
from ..errors import UserError
from ..files import emit
from ..launcher import Pool
from ..run import workloads
from ..run.train import TrainConfig, run_training

OUT = "file"    # --out names the JSON file of the rows (thinwire/cli/bench.py checks it first)

# Compressors whose own error-feedback memory shares their name; biased ones otherwise pair with `residual`
# (error feedback: Stich, Cordonnier, Jaggi 2018, arXiv 1809.07599); unbiased ones and plain casts need none.
CASTS = ("fp16", "bf16", "fp8", "fp4")
# Every cell trains this many times the workload's default epochs (digits-mlp: 30 epochs, 330 steps at 4 workers):
# a compressor that sends 1 % of a coordinate's updates per step needs more steps than bsp's 40, and the table's
# "steps to target" says how many. (At 1× the sparsifiers, DeMo and SparseLoCo missed only for want of steps.)
EPOCHS_FACTOR = 5


def natural_memory(compressor: str) -> str:
    """The memory a compressor is meant to run with."""
    if compressor in memories.names():
        return compressor
    comp = comps.get(compressor) if compressor != "none" else None
    if comp is None or compressor in CASTS or comp.unbiased or comp.takes_momentum:   # at its defaults
        return "none"       # (signum: its momentum-sign is the method, Bernstein et al. 2018; no error feedback)
    return "residual"


def cells(algorithms=None, compressors=None, workers: int = 4) -> list[dict]:
    """Every (algorithm, architecture, compressor, memory) cell with its refusal (None where it is valid)."""
    out = []
    for alg in algorithms or algs.names():
        archs = algs.architectures(alg)
        for arch in archs:
            cls = algs.registry.constructor(alg, {"architecture": arch})
            names = (compressors or comps.names()) if cls.compression else ["none"]
            optimizer = "adamw" if cls.adam_only else None       # 1-bit Adam, 0/1 Adam, DES-LOC: Adam's
            servers = 1 if arch == "ps" else 0
            for comp in names:
                params = {} if arch == archs[0] else {"architecture": arch}
                # its natural memory, else none (an algorithm with its own error feedback, e.g. choco, refuses one)
                natural, refused = natural_memory(comp), None
                for memory in dict.fromkeys([natural, "none"]):
                    try:
                        TrainConfig(algorithm=alg, workers=workers, compressor=comp, memory=memory,
                                    servers=servers, params=params, optimizer=optimizer, progress=False).validate()
                        refused = None
                        break
                    except UserError as e:
                        refused = refused or str(e)     # the natural memory's refusal is the one reported
                else:
                    memory = natural
                out.append({"algorithm": alg, "architecture": arch, "compressor": comp, "memory": memory,
                            "servers": servers, "params": params, "optimizer": optimizer, "refused": refused})
    return out


def config(cell: dict, workload: str, workers: int, **kw):
    return TrainConfig(workload=workload, algorithm=cell["algorithm"], workers=workers,
                       compressor=cell["compressor"], memory=cell["memory"], servers=cell["servers"],
                       params=dict(cell["params"]), optimizer=cell.get("optimizer"), progress=False, **kw)


def markdown(rows: list[dict]) -> str:
    lines = ["| algorithm | architecture | compressor | memory | final | target reached | steps to target | "
             "kB/step | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['algorithm']} | {r['architecture']} | {r['compressor']} | {r['memory']} |"
        if r.get("refused"):
            lines.append(f"{head} – | refused | – | – | {r['refused'].replace('|', '/')} |")
        elif r.get("error"):
            lines.append(f"{head} – | **error** | – | – | {r['error'].replace('|', '/')} |")
        elif "final" not in r:
            lines.append(f"{head} – | not run | – | – | |")
        else:
            lines.append(f"{head} {r['final']:.4f} | {'yes' if r['reached'] else '**no**'} | "
                         f"{r['steps_to_target'] if r['steps_to_target'] is not None else '–'} | "
                         f"{r['bytes_per_step'] / 1e3:.1f} | |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    wl = workloads.get(args.workload)
    split = lambda s: [x for x in s.split(",") if x]
    epochs = args.epochs if args.epochs is not None else EPOCHS_FACTOR * wl.epochs
    # the run every cell shares, checked as `thinwire train` checks one (a bad --workers or --epochs is the
    # command's error, not every cell's refusal)
    base = {"algorithm": "bsp", "compressor": "none", "memory": "none", "servers": 0, "params": {}}
    config(base, args.workload, args.workers, epochs=epochs, seed=args.seed).validate()
    if args.ps_workers is not None:
        config({**base, "servers": 1, "params": {"architecture": "ps"}}, args.workload, args.ps_workers,
               epochs=epochs, seed=args.seed).validate()
    rows = cells(split(args.only_algorithms) or None, split(args.only_compressors) or None, args.workers)
    for servers in (0, 1):                           # one pool per world size, one at a time
        todo = [r for r in rows if r["servers"] == servers and not r["refused"]]
        workers = args.ps_workers or args.workers if servers else args.workers
        pool = None
        try:
            for r in todo:
                cfg = config(r, args.workload, workers, epochs=epochs, seed=args.seed)
                if pool is None or pool.closed:          # a failed run closes its pool: a fresh one
                    pool = Pool(workers + servers, timeout=900, start_timeout=600)
                try:
                    s = run_training(cfg, pool=pool)
                except Exception as e:                 # a cell that breaks is reported, the others go on
                    r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                else:
                    r["final"] = s.get("final_accuracy", s.get("final_loss"))
                    r["reached"] = wl.reached(r["final"]) or s["steps_to_target"] is not None   # at an evaluation
                    r["steps_to_target"] = s["steps_to_target"]
                    r["bytes_per_step"] = s["bytes_sent_per_worker_per_step"]
                if not args.json:
                    what = r.get("error") or (f"final {r['final']:.4f} {'reached' if r['reached'] else 'NOT reached'}"
                                              f"  {r['bytes_per_step'] / 1e3:.1f} kB/step")
                    print(f"{r['algorithm']:12s} {r['architecture']:9s} {r['compressor']:13s} {r['memory']:10s} "
                          f"{what}", flush=True)
        finally:
            if pool is not None:
                pool.close()
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))
    emit(rows, args.out, args.json)
    return 0 if not any(r.get("error") for r in rows) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("matrix", help="every algorithm x compressor (natural memory) at its defaults")
    p.add_argument("--workload", default="digits-mlp")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--ps-workers", type=int, default=None,
                   help="workers beside the one server in parameter-server cells (default: --workers)")
    p.add_argument("--epochs", type=float, default=None,
                   help=f"default: {EPOCHS_FACTOR}x the workload's (the same for every cell)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only-algorithms", default="", help="comma-separated algorithm names")
    p.add_argument("--only-compressors", default="", help="comma-separated compressor names")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--markdown", default=None, help="write the table as Markdown")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
