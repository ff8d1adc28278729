"""`thinwire train`: one training run on the embedded default (or as one worker of a torchrun job).

Options beyond the listed ones (`--k 5`, `--delay 4`, `--ratio 0.01`, or `--param name=value`) are passed to
the algorithm, compressor and memory that declare them; unknown ones are an error naming the valid ones.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import fields

from ..compare.peers import resolve
from ..errors import UserError
from ..files import check_writable_dir
from ..launcher import init, under_torchrun
from ..run.train import TrainConfig, run_torchrun_worker, run_training
from ..run.user import canonical


def config_from_args(args):
    """The TrainConfig of `train`'s flags: each flag sets the field of its name, and --budget `budget_s`, the
    extra options `params`, --json / --quiet `progress`; checkpoints go to OUT/checkpoint by default; an
    --algorithm that names a peer (`ddp`, ...) runs it (`thinwire.compare.peers`)."""
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    default_dir = os.path.join(args.out, "checkpoint") if args.out else None
    return resolve(TrainConfig(**{**flags, "checkpoint_dir": args.checkpoint_dir or default_dir,
                                  "budget_s": args.budget, "workload": canonical(args.workload),
                                  "params": dict(args.extra), "progress": not args.json and not args.quiet}))


def format_summary(s: dict) -> str:
    metric = "final_accuracy" if s["metric"] == "accuracy" else "final_loss"
    ttt = f"{s['time_to_target_s']:.2f} s (step {s['steps_to_target']:.0f})" if s["time_to_target_s"] is not None \
        else "not reached"
    stop = {"target": ", stopped at the target", "budget": f", stopped at the budget of {s.get('budget_s')} s"}.get(
        s.get("stop_reason"), "")
    mb = 1e6
    lines = [
        f"{s['algorithm']} on {s['workload']}, {s['workers']} workers, network {s['network']}",
        f"  steps             {s['steps']}   (median step {s['step_time_s'] * 1e3:.1f} ms{stop})",
        f"  {metric:<17} {s[metric]:.4f}   (target {s['target']}, reached: {ttt})",
        f"  wall time         {s['wall_s']:.2f} s   (training {s['train_s']:.2f} s)",
        f"  bytes sent/worker {s['bytes_sent_per_worker'] / mb:.3f} MB   "
        f"(uncompressed fp32 would be {s['nominal_bytes_per_worker'] / mb:.3f} MB)",
        f"  emulated comm     {s['emulated_comm_s']:.2f} s   (exposed, waited for: {s['exposed_comm_s']:.2f} s)",
    ]
    if s.get("speeds"):
        lines.append(f"  worker speeds     {s['speeds']}   (steps per worker {', '.join(map(str, s['steps_per_worker']))}; "
                     f"waited out {s['slowed_s']:.2f} s each)")
    if s.get("metric_note"):
        lines.append(f"  note              {s['metric_note']}")
    runs = (s.get("algorithm_metrics") or {}).get("participants") or []
    if len(runs) > 1:     # the ranks of each sync changed (a loss, a join)
        lines.append("  ranks per sync    " + ", ".join(f"{n} in steps {a}-{b}" if a < b else f"{n} at step {a}"
                                                       for a, b, n in runs))
    for f in s.get("failures") or []:
        lines.append(f"  lost workers      {f['lost']} at step {f['step']}: the survivors {f['members']} went on")
    am = s.get("algorithm_metrics") or {}
    if am.get("robust_rule"):
        lines.append(f"  robust {am['robust_rule']}: {am['robust_exchanges']} exchanges, rejected "
                     f"{am['robust_rejected']} (non-finite), clipped {am['robust_clipped']}; left out per rank "
                     f"{', '.join(f'{v:.2f}' for v in am['robust_left_out'])}")
    # CD-SGD's time model: Yu et al. 2021, "CD-SGD: Distributed Stochastic Gradient Descent with Compression and Delay
    # Compensation", arXiv 2106.10796, §3.3
    if am.get("predicted_step_s") is not None and am.get("measured_step_s") is not None:
        ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
        lines.append(f"  iteration time    predicted {ms(am['predicted_step_s'])} ms, measured "
                     f"{ms(am['measured_step_s'])} ms   (τ {ms(am.get('tau_s'))}, φ {ms(am.get('phi_s'))}, "
                     f"ψ {ms(am.get('psi_s'))}, δ {ms(am.get('delta_s'))} ms)")
    return "\n".join(lines)


def run(args) -> int:
    if args.out is not None:  # first: checkpoints go under it by default, no result may be lost to it after training
        check_writable_dir(args.out, "--out")
    cfg = config_from_args(args)
    if args.trace and not args.out:
        raise UserError("--trace needs --out DIR (the trace is written to DIR/trace.json)")
    if cfg.join is not None:    # one more worker of a running elastic job (under torchrun too: each process joins)
        mine = run_training(cfg)
        steps = mine["steps"]
        print(f"thinwire: joined the elastic job at {cfg.join} as member {mine['rank']}: steps "
              f"{steps[0]['step'] if steps else '-'}..{steps[-1]['step'] if steps else '-'}, final "
              f"{mine['final']:.4f} (the job's launcher writes the summary)", file=sys.stderr)
        exit_past_gloo()
    torchrun = under_torchrun()
    if torchrun:
        rank, world = init(cfg.network, seed=cfg.seed, device=cfg.device)
        summary = run_torchrun_worker(cfg, rank, world, args.out)
    else:
        rank, summary = 0, run_training(cfg, out=args.out)
    if rank == 0:
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(format_summary(summary))
            if args.out:
                print(f"  written to        {args.out}/summary.json, {args.out}/metrics.jsonl")
    if torchrun:
        exit_past_gloo()
    sys.stdout.flush()
    return 0


def exit_past_gloo(code: int = 0) -> None:
    """End a worker process that holds gloo groups of its own (under torchrun, or joined by hand) with exit status
    `code`, without the interpreter's teardown: gloo's worker thread frees the last collective's work (and its tensors,
    which need the GIL) after that collective returns; if teardown has begun by then the thread is killed inside
    a destructor and the process aborts (SIGABRT, "terminate called without an active exception"; 4 of 30
    two-worker torchrun runs here did, and 1 of 5 workers joined by hand, also after destroy_process_group,
    which leaves the group's threads running while anything refers to it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(sub) -> None:
    p = sub.add_parser("train", help="train one workload with one algorithm", epilog=(
        "Any other --name value (e.g. --architecture ps, --k 5 --warmup 20 --local-lr 0.05 --threshold 0.01, "
        "--delay 4 --period 2, --ratio 0.01, --sparse-collective gtopk) or --param name=value goes to the "
        "algorithm, compressor and memory that declare it; `thinwire list` shows each one's parameters."))
    p.add_argument("--workload", default="digits-mlp", help="workload name (see `thinwire list`) or yours: "
                                                             "module:function or path/to/file.py:function")
    p.add_argument("--algorithm", default="bsp", help="algorithm name (see `thinwire list`)")
    p.add_argument("--workers", type=int, default=4, help="number of worker processes (default 4)")
    p.add_argument("--servers", type=int, default=None,
                   help="parameter-server ranks (algorithms on the PS; default 1 there)")
    p.add_argument("--network", default="lan",
                   help="lan, dc, cluster, wan, world, home, custom:bandwidth=200mbit,latency=25ms,jitter=5ms or "
                        "islands:2x2,inside=dc,across=world (two islands of two workers; islands:2+4,... "
                        "two of 2 and 4)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, help="epochs over the training set (default: the workload's)")
    g.add_argument("--steps", type=int, help="number of steps")
    p.add_argument("--batch-size", type=int, help="per-worker batch size (default: the workload's)")
    p.add_argument("--lr", type=float, help="learning rate (default: the workload's)")
    p.add_argument("--momentum", type=float, help="SGD momentum (default: the workload's)")
    p.add_argument("--compressor", help="compressor name (see `thinwire list`)")
    p.add_argument("--memory", help="memory (error feedback) name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: twice per epoch)")
    p.add_argument("--target", type=float, help="accuracy (or loss) target (default: the workload's)")
    p.add_argument("--optimizer", help="sgd, adamw or muon (Muon on the hidden weight matrices, AdamW on the rest: "
                                       "MuLoCo's inner optimizer) instead of the workload's own optimizer")
    p.add_argument("--out", help="directory for metrics.jsonl, summary.json (and trace.json)")
    p.add_argument("--checkpoint-every", type=int, help="write a checkpoint every N steps (to --checkpoint-dir, "
                                                          "default OUT/checkpoint)")
    p.add_argument("--checkpoint-dir", help="where checkpoints go (default OUT/checkpoint)")
    p.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (same configuration)")
    p.add_argument("--on-failure", choices=["stop", "continue"], default="stop",
                   help="a worker lost mid-run: stop the job (default), or continue with the survivors "
                        "(bsp, localsgd, postlocalsgd, dts, diloco, ...: algorithms whose averages stay meaningful)")
    p.add_argument("--elastic", metavar="MIN:MAX",
                   help="an elastic job: a lost worker is replaced (it joins at the algorithm's next synchronization "
                        "boundary with a live peer's state), more join by hand up to MAX, the job goes on while "
                        "MIN remain (bsp, localsgd, postlocalsgd, diloco, dts; docs/reliability.md)")
    p.add_argument("--replace-delay", type=float, default=0.0, metavar="S",
                   help="--elastic: start a lost worker's replacement S seconds after the loss (default 0)")
    p.add_argument("--listen", metavar="HOST[:PORT]",
                   help="--elastic: the address the job listens on for workers that join, one of this machine's "
                        "that the others reach (default 127.0.0.1: this machine only; PORT default: a free one; "
                        "0.0.0.0: every interface; docs/multi-host.md)")
    p.add_argument("--join", metavar="HOST:PORT",
                   help="join the running elastic job whose launcher listens at HOST:PORT (it prints the address) "
                        "as one more worker, with the job's options; under torchrun each process joins")
    p.add_argument("--nonfinite", choices=["stop", "skip"], default="stop",
                   help="NaN/Inf gradient: stop every rank (default) or skip the step on all ranks")
    p.add_argument("--progress-timeout", type=float, metavar="S",
                   help="stop the run, naming the rank, when no rank has advanced a step for S seconds (default "
                        "300, raised to 50 median step times for slow steps)")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="stop the run after S seconds of wall time whatever its progress (default: none; a run "
                        "lasts as long as it progresses)")
    p.add_argument("--faulty", metavar="RANK:KIND",
                   help="emulate a faulty worker: RANK's contributions to every exchange corrupted, KIND scale "
                        "(x -10), noise (random, of its norm), stale (the previous one) or nan; try it against "
                        "--aggregate median|trimmed|clip (docs/robust.md)")
    p.add_argument("--speeds", metavar="SPEC",
                   help="emulate workers of different speeds: factors per worker (1,1,1,0.5), two speeds A:B, "
                        "one-half, two-speeds, stragglers[:p=,factor=,steps=], or SPEC@SECONDS>SPEC "
                        "(see `thinwire list`)")
    p.add_argument("--budget", type=float, metavar="S",
                   help="stop after S seconds of training time (evaluations excluded; decided on every rank alike)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop at the first evaluation whose mean metric over the workers reaches the target")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars to DIR (loss, metric, bytes, "
                                                        "exposed communication per step; extra thinwire[tensorboard])")
    p.add_argument("--trace", action="store_true", help="write a Chrome trace to OUT/trace.json")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL, one worker per GPU; more workers than GPUs share "
                        "them over gloo)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, accepts_params=True)
