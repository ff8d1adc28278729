"""`thinwire bench churn`: goodput and time to target while workers are killed and replaced.

    thinwire bench churn                                  # stdlib-lm, 4 workers behind `world`, a kill every 30 s
    thinwire bench churn --contestants diloco,ddp --kill-every 20 --steps 300

Every contestant trains the same workload with the same seed, network, workers, steps and evaluation cadence, and
suffers the same kill schedule: at t = T, 2T, ... seconds after its first step (`--kill-every` T), the worker at
position v_k (a seeded draw, the same for everyone) among the live ones is SIGKILLed. What happens next is the
contestant's recovery:

| contestant | recovery |
| --- | --- |
| `diloco`, `localsgd`, `bsp` | thinwire's elastic job (`thinwire train --elastic MIN:N`): the survivors go on at once; a replacement is started `--replace-delay` s later and joins at the algorithm's next synchronization boundary with a live peer's state |
| `ddp` | PyTorch DDP under `torchrun --max-restarts` with a checkpoint every `--checkpoint-every` steps: torchrun stops every worker and restarts the group, which resumes from the last checkpoint (stop the world) |
| `torchft-diloco` | torchft's DiLoCo, one replica group per worker, its Lighthouse (`min_replicas` MIN) and Managers on 127.0.0.1: the survivors' quorum goes on; a replacement replica is started `--replace-delay` s later and healed from a live replica at its first sync |

Thinwire's `diloco` runs the planner's settings for the network (`plan_diloco`) unless the command line gives its own;
local SGD and torchft's DiLoCo run H = `--period` (16).

**Goodput** is the share of worker-seconds spent in steps whose work counts toward the final model: N workers ×
the wall time from the first step to the last is the denominator; the numerator adds up the duration of every step
(in every worker process, killed ones included) whose work was kept — a step counts once a synchronization
boundary after it has passed in that process without a loss in between (bsp: the step itself; local SGD and
DiLoCo: the next model average; DTS: the window's end; DDP: the next checkpoint; torchft: the next committed sync;
every contestant: its last step); a killed worker's steps since its last boundary never count. A step whose work
a loss threw away in a survivor (bsp: the interrupted one; local SGD and DiLoCo, only where the survivors had not
all counted the same step, else they keep theirs for the next average: the steps since the last boundary; DDP:
the steps since the last checkpoint, done again after the restart; torchft: a failed sync's local steps, a
replacement's steps before it is healed) does not count, nor does time outside steps (start-up, restarts,
evaluations, waiting for a replacement). Each worker writes its steps as it goes (`THINWIRE_STEP_LOG`,
`thinwire.run.loop.StepLog`); the numbers come from those logs.

**Time to target** is the wall time from the first step to the first evaluation whose mean over the workers that
evaluated that step reached the workload's target (evaluations every `--eval-every` steps).

The machine's load is printed with the table: on a loaded machine, times stretch; the kill schedule is in wall
seconds, so a slower machine sees more kills per step.
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch

from ..comm import set_default_network
from ..compare.forecast import tune_cell
from ..compare.peers import find
from ..compare.peers.counter import AllReduceCounter
from ..compare.peers.torchft_diloco import quiet, replica_group
from ..compare.presets import Cell
from ..errors import UserError
from ..files import check_writable_dir, pyplot, save
from ..net import parse_network
from ..run import workloads
from ..run.measure import measure_step
from ..run.train import TrainConfig, check_int, check_number, run_elastic

CONTESTANTS = ("diloco", "localsgd", "bsp", "ddp", "torchft-diloco")
PERIOD = 16     # H of localsgd and torchft's DiLoCo, and of thinwire's diloco where any of its settings is given
ELASTIC = ("diloco", "localsgd", "bsp")


def register(sub) -> None:
    p = sub.add_parser("churn", help="goodput and time to target while workers are killed and replaced: "
                                     "thinwire's elastic jobs, DDP restarts under torchrun, torchft's DiLoCo")
    p.add_argument("--workload", default="stdlib-lm")
    p.add_argument("--network", default="world")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--min-workers", type=int, default=2, help="the fewest workers the elastic jobs and torchft's "
                                                               "quorum go on with (default 2)")
    p.add_argument("--kill-every", type=float, default=30.0, metavar="T", help="seconds between kills (default 30)")
    p.add_argument("--replace-delay", type=float, default=5.0, metavar="S",
                   help="seconds from a kill to its replacement's start (elastic and torchft; default 5)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=32)
    p.add_argument("--period", type=int, help=f"H of localsgd and torchft's DiLoCo (default {PERIOD}), and of "
                                              f"thinwire's diloco where it or --compressor, --memory, --param is "
                                              f"given; with none of them diloco runs the planner's settings for the "
                                              f"network (as `thinwire advise` names them), printed and kept")
    p.add_argument("--compressor", help="the compressor of thinwire's diloco (its outer gradients), e.g. fp4")
    p.add_argument("--memory", help="the memory beside --compressor (e.g. residual)")
    p.add_argument("--checkpoint-every", type=int, default=32, help="ddp's checkpoint interval in steps")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"subset of {', '.join(CONTESTANTS)}")
    p.add_argument("--target", type=float, help="the target (default: the workload's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=900.0, metavar="S",
                   help="wall seconds a contestant under torchrun or torchft may run (default 900): stopped there, "
                        "its goodput and time to target are read from its step logs so far (DDP on a slow link "
                        "restarted every --kill-every seconds may never reach its next checkpoint)")
    p.add_argument("--out", help="directory for churn.json and the workers' step logs (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    # --param K=V (or --K V): more of diloco's parameters; `planned`: the planner's diloco, where run() asks for it
    p.set_defaults(func=run, accepts_params=True, planned=None)


def given(args) -> bool:
    """Whether the command line sets thinwire's diloco (else it runs the planner's settings: `plan_diloco`)."""
    return bool(args.period or args.compressor or args.memory or args.extra)


def plan_diloco(args) -> dict:
    """The planner's settings of `diloco` for the workload, network and workers (`compare`'s planning of a cell
    that names only `diloco`), from the step measured here with the workers sharing this machine."""
    compute = measure_step(args.workload, workers=args.workers, local=True)["compute_s"]
    cell, why = tune_cell(Cell("diloco", "diloco"), args.network, args.workload, args.workers, compute)
    return {"params": dict(cell.params), "compressor": cell.compressor, "memory": cell.memory,
            "compute_s": compute, "why": why}


def _config(args, name: str) -> TrainConfig:
    """Thinwire's elastic job for contestant `name`: localsgd at H = --period; diloco at the settings given (H,
    --compressor, --memory, `--param overlap=17`), else at the planner's (`args.planned`, set by `run`)."""
    params = {"period": args.period or PERIOD} if name in ("diloco", "localsgd") else {}
    compressor, memory = (args.compressor, args.memory) if name == "diloco" else (None, None)
    if name == "diloco":
        if args.planned is not None:
            params, compressor, memory = (dict(args.planned["params"]), args.planned["compressor"],
                                          args.planned["memory"])
        params.update(args.extra)
    return TrainConfig(workload=args.workload, algorithm=name, workers=args.workers, network=args.network,
                       steps=args.steps, eval_every=args.eval_every, seed=args.seed, params=params,
                       compressor=compressor, memory=memory,
                       elastic=f"{args.min_workers}:{args.workers}", replace_delay=args.replace_delay,
                       progress=False, target=args.target)


def check(args) -> list[str]:
    workloads.registry.lookup(args.workload)
    parse_network(args.network)
    check_int("--workers", args.workers, 2, 64)
    check_int("--min-workers", args.min_workers, 1, args.workers - 1)
    check_number("--kill-every", args.kill_every, 0, 3600, low_open=True, why=" (seconds)")
    check_number("--replace-delay", args.replace_delay, 0, 3600, why=" (seconds)")
    check_number("--limit", args.limit, 0, 86400, low_open=True, why=" (seconds)")
    for flag in ("steps", "eval_every", "period", "checkpoint_every"):
        if getattr(args, flag) is not None:
            check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    if args.target is not None:
        check_number("--target", args.target, 0)
    chosen = [c for c in args.contestants.split(",") if c]
    bad = [c for c in chosen if c not in CONTESTANTS]
    if bad or not chosen:
        raise UserError(f"unknown contestant {bad[0] if bad else ''!r}; valid: {', '.join(CONTESTANTS)}")
    if (args.extra or args.compressor or args.memory) and "diloco" not in chosen:
        raise UserError("--compressor, --memory and --param set thinwire's diloco, which --contestants leaves out")
    for peer in filter(None, map(find, chosen)):     # the peers' optional extras are installed
        why = peer.missing()
        if why:
            raise UserError(why)
    for name in (c for c in chosen if c in ELASTIC):
        _config(args, name).validate()
    return chosen


def schedule(seed: int, every: float, count: int = 10_000) -> list[tuple[float, int]]:
    """The kill schedule every contestant suffers: (seconds after its first step, position among the live
    workers) pairs."""
    rng = random.Random(seed)
    return [(every * (k + 1), rng.randrange(1 << 30)) for k in range(count)]


class Killer:
    """Kills, on `schedule`, the worker at the drawn position among `victims()` (their pids, in worker order),
    counting time from the first step any worker wrote to `logdir`."""

    def __init__(self, plan, logdir: str, victims):
        self.plan, self.logdir, self.victims = plan, logdir, victims
        self.kills: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="thinwire-churn-killer")

    def start(self) -> "Killer":
        self.thread.start()
        return self

    def _run(self) -> None:
        t0 = None
        while t0 is None and not self.stop.wait(0.2):     # the start of the first step any worker logged
            t0 = next((json.loads(line)["a"] for line in _lines(self.logdir) if '"a":' in line), None)
        if t0 is None:
            return
        for at, draw in self.plan:
            if self.stop.wait(max(0.0, t0 + at - time.time())):
                return
            pids = self.victims()
            if not pids:
                continue
            i = draw % len(pids)
            try:
                os.kill(pids[i], signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t": round(time.time() - t0, 2), "position": i, "pid": pids[i]})

    def close(self) -> list[dict]:
        self.stop.set()
        self.thread.join(timeout=5)
        return self.kills


# -- the contestants --------------------------------------------------------------------------------------
def _elastic(args, name: str, logdir: str, plan) -> dict:
    cfg = _config(args, name)
    killer = None

    def on_start(pool):
        nonlocal killer
        killer = Killer(plan, logdir, lambda: [pid for _, pid in sorted(pool.pids.items())]).start()

    os.environ["THINWIRE_STEP_LOG"] = logdir
    try:
        summary = run_elastic(cfg, on_start=on_start)
    finally:
        os.environ.pop("THINWIRE_STEP_LOG", None)
        kills = killer.close() if killer else []
    e = summary["elastic"]
    return {"kills": kills, "recoveries": f"{len(e['lost'])} lost, {len(e['joined'])} replacements",
            "final": summary.get("final_loss", summary.get("final_accuracy"))}


def _children(pid: int) -> list[tuple[int, int]]:
    """(local rank, pid) of the thinwire workers torchrun's agent (`pid`) runs now."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if b"LOCAL_RANK" in env:
                out.append((int(env[b"LOCAL_RANK"]), int(entry)))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out)


def _ddp(args, logdir: str, plan, workdir: str) -> dict:
    ckpt, out = os.path.join(workdir, "ddp-checkpoint"), os.path.join(workdir, "ddp-out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.workers}",
           "--max-restarts=1000", "--monitor-interval=0.2", "-m", "thinwire", "train", "--algorithm", "ddp",
           "--workload", args.workload, "--workers", str(args.workers), "--network", args.network,
           "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
           "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", ckpt, "--resume", ckpt,
           "--out", out, "--quiet", "--json"]
    if args.target is not None:
        cmd += ["--target", str(args.target)]
    env = {**os.environ, "THINWIRE_STEP_LOG": logdir, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "THINWIRE_NO_PROGRESS": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.workers))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)     # torchrun's signals to its group stay there
    killer = Killer(plan, logdir, lambda: [pid for _, pid in _children(proc.pid)]).start()
    stopped = False
    try:
        stdout, stderr = proc.communicate(timeout=args.limit)
    except subprocess.TimeoutExpired:       # stopped at the limit: what its step logs hold is its result
        for _, pid in _children(proc.pid):  # (torchrun's workers run in sessions of their own)
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        stopped = True
    finally:
        kills = killer.close()
        if proc.poll() is None:
            proc.kill()
    out = {"kills": kills, "recoveries": f"{len(kills)} kills, torchrun restarts of every worker (from the "
                                         f"checkpoint every {args.checkpoint_every} steps)", "final": None}
    if stopped:
        out["recoveries"] += f"; stopped at --limit {args.limit:g} s"
        return out
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"ddp under torchrun exited with {proc.returncode}:\n{tail}")
    summary = json.loads(stdout[stdout.index("{"):])
    out["final"] = summary.get("final_loss", summary.get("final_accuracy"))
    out["torchrun_restart_lines"] = sum("Restarting" in line or "restarting" in line for line in stderr.splitlines())
    return out


def _torchft(args, logdir: str, plan) -> dict:
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_workers, join_timeout_ms=100)
    spec = {"workload": args.workload, "network": args.network, "workers": args.workers, "steps": args.steps,
            "eval_every": args.eval_every, "seed": args.seed, "period": args.period or PERIOD, "min": args.min_workers,
            "lighthouse": lighthouse.address(), "logdir": logdir, "target": args.target}
    procs: dict[int, subprocess.Popen] = {}
    incarnation = [0]
    lock = threading.Lock()

    def start(index: int) -> None:
        incarnation[0] += 1
        cmd = [sys.executable, "-m", "thinwire.bench.churn", "replica", str(index), str(incarnation[0]),
               json.dumps(spec)]
        env = {**os.environ, "THINWIRE_NO_PROGRESS": "1",
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.workers))}
        with lock:
            procs[index] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            text=True, start_new_session=True)

    for i in range(args.workers):
        start(i)
    killer = Killer(plan, logdir, lambda: [p.pid for _, p in sorted(procs.items()) if p.poll() is None]).start()
    due: list[tuple[float, int]] = []
    finished: set[int] = set()
    errors = []
    t0 = time.time()
    try:
        while len(finished) < len(procs) and time.time() - t0 < args.limit:
            now = time.time()
            with lock:
                items = list(procs.items())
            for index, p in items:
                if index in finished or p.poll() is None:
                    continue
                if p.returncode == 0:
                    finished.add(index)
                elif p.returncode < 0 and not any(i == index for _, i in due):   # killed: replace it later
                    due.append((now + args.replace_delay, index))
                    procs[index] = SimpleNamespace(returncode=-9, poll=lambda: -9)     # until its replacement
                elif p.returncode > 0:
                    errors.append(p.stderr.read()[-2000:])
                    finished.add(index)
            done = os.path.exists(os.path.join(logdir, "done"))
            for at, index in [d for d in due if done or d[0] <= now]:
                due.remove((at, index))     # replaced, or after the job's end not needed
                (finished.add if done else start)(index)
            time.sleep(0.1)
    finally:
        kills = killer.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    finals = [json.loads(line)["final"] for line in _lines(logdir) if '"final"' in line]
    if errors and not any(finals):
        raise RuntimeError("torchft replicas failed:\n" + errors[0])
    return {"kills": kills, "recoveries": f"{len(kills)} kills, {incarnation[0] - args.workers} replacement "
                                          f"replicas healed from a live one",
            "final": statistics.fmean(finals) if finals else None}


def _lines(logdir: str):
    for path in glob.glob(os.path.join(logdir, "*.jsonl")):
        with open(path) as f:
            yield from f


def replica(index: int, incarnation: int, spec: dict) -> None:
    """One torchft replica group (a process of its own, no torch.distributed world): the workload's model and
    optimizer, torchft's Manager (its own store, the emulated gloo of `thinwire.compare.peers.torchft_diloco`) and
    DiLoCo around the optimizer; the shard of worker `index`. Its steps count from the job's committed syncs: a
    replacement heals from a live replica at its first sync and goes on from there. Writes the step log."""
    quiet()
    from torchft.local_sgd import DiLoCo
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    set_default_network(spec["network"], spec["seed"])
    wl = workloads.get(spec["workload"])
    model = wl.model(spec["seed"])
    opt = wl.make_optimizer(model)
    manager, pg, store = replica_group(AllReduceCounter(index, parse_network(spec["network"])), spec["lighthouse"],
                                       f"churn_{index}_{incarnation}", spec["min"], 120, model, opt)
    period, total = spec["period"], spec["steps"]
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    x, y = wl.shard(index, spec["workers"])
    loader = workloads.ShardLoader(x, y, wl.batch_size, seed=spec["seed"] + 7 * incarnation, rank=index)
    log = open(os.path.join(spec["logdir"], f"{os.getpid()}.jsonl"), "a")

    def write(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    committed, discards, local = 0, 0, 0
    with DiLoCo(manager, [model], opt, [outer], sync_every=period, use_bucketization=True):
        while manager.current_step() * period < total:
            a = time.time()
            before = manager.current_step()
            xb, yb = loader.next()
            wl.loss(model(xb), yb).backward()
            opt.step()          # DiLoCo's hook: every `period` steps the quorum, the average, the outer step
            opt.zero_grad()
            local += 1
            step = before * period + local
            if local == period:             # a sync was attempted: committed (the step advanced) or thrown away
                local = 0
                if manager.current_step() > before:
                    committed = manager.current_step() * period
                    step = committed
                else:
                    discards += 1
            write({"m": index, "s": step, "a": a, "b": time.time(), "c": committed, "d": discards})
            if local == 0 and committed and committed % spec["eval_every"] == 0:
                write({"m": index, "s": committed, "e": wl.evaluate(model), "b": time.time()})
    write({"m": index, "final": wl.evaluate(model)})
    open(os.path.join(spec["logdir"], "done"), "w").close()
    log.close()
    manager.shutdown(wait=False)
    pg.shutdown()
    del store           # (the replica group's store, kept until its Manager is done)


# -- goodput and time to target from the step logs -----------------------------------------------------------
def read_logs(logdir: str) -> tuple[list[list[dict]], dict]:
    """(each worker process's steps in order, the evaluations by step) from the step logs in `logdir`."""
    per_process, evals = [], {}
    for path in sorted(glob.glob(os.path.join(logdir, "*.jsonl"))):
        steps = []
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:          # a line cut by a kill
                    continue
                if "e" in rec:
                    evals.setdefault(rec["s"], []).append(rec)
                elif "a" in rec:
                    steps.append(rec)
        per_process.append(steps)
    return per_process, evals


def kept(steps: list[dict]) -> list[bool]:
    """Whether each step of one worker process counts toward the final model (see the module doc): a boundary
    after it passed in this process without a loss that threw the work away in between."""
    out, pending, losses = [False] * len(steps), [], 0
    for i, s in enumerate(steps):
        if s["d"] > losses:                 # a loss in this step: the work since the last boundary is gone
            losses, pending = s["d"], []
        else:
            pending.append(i)
        for j in [j for j in pending if steps[j]["s"] <= s["c"]]:
            out[j] = True
        pending = [j for j in pending if steps[j]["s"] > s["c"]]
    return out


def analyse(logdir: str, workers: int, metric: str, target: float, reached) -> dict:
    """Goodput, time to target, steps and wall time from the workers' step logs (see the module doc)."""
    per_process, evals = read_logs(logdir)
    starts = [s["a"] for steps in per_process for s in steps]
    ends = [s["b"] for steps in per_process for s in steps]
    if not starts:
        return {"goodput": None, "time_to_target_s": None, "wall_s": None}
    t0, t1 = min(starts), max(ends)
    good = [s for steps in per_process for s, k in zip(steps, kept(steps)) if k]
    useful = sum(s["b"] - s["a"] for s in good)
    hit = None
    for step in sorted(evals):
        recs = evals[step]
        value = statistics.fmean(r["e"] for r in recs)
        if step > 0 and reached(value, target):
            hit = (min(r["b"] for r in recs) - t0, step, value)
            break
    last = evals[max(evals)] if evals else []
    return {"goodput": useful / (workers * (t1 - t0)), "time_to_target_s": None if hit is None else hit[0],
            "steps_to_target": None if hit is None else hit[1], "wall_s": t1 - t0,
            "steps_kept": len(good), "last_eval": statistics.fmean(r["e"] for r in last) if last else None}


def plot(result: dict, workdir: str) -> str | None:
    """`churn.png`: one timeline per contestant, a line per worker process — its steps whose work was kept,
    those a loss threw away, the gaps (start-up, joins, restarts, evaluations) — the kills marked, the time to
    target and the goodput in the title. None if matplotlib is missing."""
    try:
        plt = pyplot()
    except ImportError:
        return None
    rows = [r for r in result["rows"] if r.get("goodput") is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.2 + 1.6 * len(rows)), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        per_process = [p for p in read_logs(os.path.join(workdir, "logs", row["contestant"]))[0] if p]
        t0 = min(p[0]["a"] for p in per_process)
        per_process.sort(key=lambda p: p[0]["a"])
        for y, steps in enumerate(per_process):
            flags = kept(steps)
            for want, colour in ((True, "tab:green"), (False, "tab:red")):
                bars = [(s["a"] - t0, s["b"] - s["a"]) for s, k in zip(steps, flags) if k == want]
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour, linewidth=0)
        for k in row.get("kills", []):
            ax.axvline(k["t"], color="0.3", linewidth=0.8, linestyle=":")
        if row.get("time_to_target_s") is not None:
            ax.axvline(row["time_to_target_s"], color="tab:blue", linewidth=1.2)
        ttt = "not reached" if row["time_to_target_s"] is None else f"target at {row['time_to_target_s']:.0f} s"
        ax.set_title(f"{row['contestant']}: goodput {row['goodput']:.0%}, {ttt}", fontsize=9, loc="left")
        ax.set_yticks([])
        ax.set_ylabel("processes", fontsize=8)
    axes[-1, 0].set_xlabel("wall time from the first step (s); green: kept, red: thrown away, dotted: a kill, "
                           "blue: target", fontsize=8)
    fig.suptitle(f"{result['workload']}, {result['workers']} workers behind {result['network']}, a kill every "
                 f"{result['kill_every_s']:g} s", fontsize=10)
    save(fig, os.path.join(workdir, "churn.png"))
    return os.path.join(workdir, "churn.png")


def run(args) -> int:
    chosen = check(args)
    if args.out:
        check_writable_dir(args.out, "--out")
    workdir = args.out or tempfile.mkdtemp(prefix="thinwire-churn-")
    os.makedirs(workdir, exist_ok=True)
    wl = workloads.get(args.workload)
    target = args.target if args.target is not None else wl.target
    plan = schedule(args.seed, args.kill_every)
    rows = []
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"churn: {args.workload}, {args.workers} workers behind {args.network}, a kill every {args.kill_every:g} s "
          f"(replacement {args.replace_delay:g} s later), {args.steps} steps, target {target}; load average {load}",
          file=sys.stderr, flush=True)
    if "diloco" in chosen and not given(args):
        args.planned = plan_diloco(args)
        settings = ", ".join(f"{k}={v}" for k, v in args.planned["params"].items())
        pair = f" + {args.planned['compressor']} + {args.planned['memory']}" if args.planned["compressor"] else ""
        print(f"  diloco: the planner's settings for {args.network}: {settings}{pair} (a step of "
              f"{args.planned['compute_s'] * 1e3:.0f} ms measured here)", file=sys.stderr, flush=True)
    for name in chosen:
        logdir = os.path.join(workdir, "logs", name)
        os.makedirs(logdir, exist_ok=True)
        for stale in glob.glob(os.path.join(logdir, "*")):
            os.remove(stale)
        print(f"  {name} ...", file=sys.stderr, flush=True)
        t = time.time()
        try:
            if name in ELASTIC:
                got = _elastic(args, name, logdir, plan)
            elif name == "ddp":
                got = _ddp(args, logdir, plan, workdir)
            else:
                got = _torchft(args, logdir, plan)
        except Exception as e:      # one contestant's failure does not lose the others'
            rows.append({"contestant": name, "error": f"{type(e).__name__}: {e}"})
            print(f"    failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
            continue
        row = {"contestant": name, **analyse(logdir, args.workers, wl.metric, target, wl.reached), **got,
               "run_s": time.time() - t}
        rows.append(row)
        print(f"    goodput {row['goodput']:.3f}, time to target {row['time_to_target_s']}", file=sys.stderr,
              flush=True)
    result = {"workload": args.workload, "network": args.network, "workers": args.workers,
              "min_workers": args.min_workers, "kill_every_s": args.kill_every, "replace_delay_s": args.replace_delay,
              "steps": args.steps, "target": target, "seed": args.seed, "period": args.period or PERIOD,
              "diloco_planned": args.planned, "load_average_start": load,
              "load_average_end": " ".join(f"{x:.2f}" for x in os.getloadavg()), "rows": rows}
    with open(os.path.join(workdir, "churn.json"), "w") as f:
        json.dump(result, f, indent=2)
    drawn = plot(result, workdir)
    if drawn:
        print(f"  timelines: {drawn}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
    return 0


def table(result: dict) -> str:
    head = ("| contestant | goodput | time to target (s) | steps kept | kills | final | recovery |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['contestant']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ttt = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} (step {r['steps_to_target']})"
        final = "" if r.get("final") is None else f"{r['final']:.3f}"
        lines.append(f"| {r['contestant']} | {r['goodput']:.1%} | {ttt} | {r['steps_kept']} | {len(r['kills'])} | "
                     f"{final} | {r['recoveries']} |")
    lines.append(f"\n{result['workload']}, {result['workers']} workers behind {result['network']}, a kill every "
                 f"{result['kill_every_s']:g} s, replacement {result['replace_delay_s']:g} s later, {result['steps']} "
                 f"steps, target {result['target']}; load average {result['load_average_start']} at the start, "
                 f"{result['load_average_end']} at the end")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "replica":
    replica(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
