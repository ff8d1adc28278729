"""One training run: its configuration (`TrainConfig`), the launcher side (`run_training`) that assembles the
workers' records into per-step metrics (JSON Lines) and a summary (JSON). The per-worker loop is
`thinwire.run.loop.train_worker` (re-exported here), the same for thinwire's algorithms and the peers.

Clocks: `wall_s` is the whole run as the launcher saw it (start-up included); each worker's training clock
counts the steps only (evaluations are paused out of it), and `time_to_target_s` is read off that clock.
Accuracy is the mean over workers of each worker's own model (identical models for synchronous algorithms).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import algorithms, speeds
from ..algorithms.ps_sync import checkpointable_on_ps
from ..compress import compressors, memories
from ..errors import UserError
from ..exchange.faulty import check as check_faulty
from ..files import atomic_write, check_writable_dir
from ..net import Islands, parse_network, ring_allreduce
from ..optim import check_momentum
from ..trace import write_chrome_trace
from ..trainer import build_components, check_elastic, check_run, nonfinite_params
from ..launcher import MAX_LOCAL_WORKERS, PROGRESS_TIMEOUT, launch, pick_backend, under_torchrun
from ..launcher.elastic import ElasticPool, join_by_hand
from . import checkpoint, workloads
from .loop import check_tensorboard, train_worker
from .schedule import race_crossing, race_curve, racing

_now = time.perf_counter
MAX_SEED = 2**32 - 1   # seeds feed torch, Python and NumPy generators (NumPy's legacy seeding takes 32 bits)
MAX_LR = 100.0
MAX_STEPS = 10**9      # a run's steps: past what any run could reach (a billion steps of 1 ms are 11 days)


def check_int(flag: str, value, low: int, high: int | None = None) -> None:
    """`value` is an integer in low..high: else a UserError naming `flag` and the valid range."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise UserError(f"{flag} must be {span}, got {value!r}" + ("" if isinstance(value, int) else " (an integer)"))


def check_number(flag: str, value, low: float, high: float = math.inf, low_open: bool = False,
                 why: str = "") -> None:
    """`value` is a finite number in [low, high] ((low, high] with `low_open`): else a UserError naming `flag`
    and the valid range (NaN and the infinities are never valid)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        span = (f"> {low:g}" if low_open else f">= {low:g}") if high == math.inf else \
            f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise UserError(f"{flag} must be a finite number {span}, got {value!r}{why}")


def check_lengths(cfg, counts=("steps", "batch_size", "eval_every", "checkpoint_every")) -> None:
    """`cfg`'s --epochs or --steps (not both), --epochs > 0, and its `counts` >= 1 where given (a training run's
    or a matrix's)."""
    if cfg.epochs is not None and cfg.steps is not None:
        raise UserError("give --epochs or --steps, not both")
    if cfg.epochs is not None:
        check_number("--epochs", cfg.epochs, 0, low_open=True)
    for name in counts:
        if getattr(cfg, name) is not None:
            check_int(f"--{name.replace('_', '-')}", getattr(cfg, name), 1)
    steps = cfg.steps
    if cfg.epochs is not None:      # (a float: 1e300 epochs are not counted in ints)
        steps = cfg.epochs * workloads.get(cfg.workload).steps_per_epoch(cfg.workers, cfg.batch_size)
    if isinstance(steps, (int, float)) and steps > MAX_STEPS:
        given = f"--steps {cfg.steps}" if cfg.epochs is None else \
            f"--epochs {cfg.epochs:g}" + (f" ({steps:.3g} steps)" if math.isfinite(steps) else "")
        raise UserError(f"{given} is more than any run could reach: at most {MAX_STEPS:,} steps (10**9)")


@dataclass
class TrainConfig:
    workload: str = "digits-mlp"
    algorithm: str = "bsp"
    workers: int = 4
    network: str = "lan"
    epochs: float | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    momentum: float | None = None
    seed: int = 0
    eval_every: int | None = None
    target: float | None = None
    compressor: str | None = None
    memory: str | None = None
    servers: int | None = None            # parameter-server ranks; None: the algorithm's default on the PS, else 0
    params: dict = field(default_factory=dict)
    trace: bool = False
    progress: bool = True
    checkpoint_every: int | None = None   # steps between checkpoints (written to `checkpoint_dir`)
    checkpoint_dir: str | None = None
    resume: str | None = None             # a checkpoint directory to continue from
    nonfinite: str = "stop"               # NaN/Inf in a gradient: "stop" every rank, or "skip" the step on all
    on_failure: str = "stop"              # a lost worker: "stop" the job, or "continue" with the survivors
    elastic: str | None = None            # "MIN:MAX": an elastic job (lost workers replaced, newcomers join)
    replace_delay: float = 0.0            # an elastic job: seconds before a lost worker's replacement starts
    join: str | None = None               # "HOST:PORT": join the elastic job whose launcher listens there
    listen: str | None = None             # "HOST[:PORT]": where an elastic job's store listens (127.0.0.1 by default)
    progress_timeout: float | None = None # the launcher's progress watchdog (s); None: its default
    deadline: float | None = None         # the launcher ends the run after this wall time (s); None: no deadline
    budget_s: float | None = None         # a race: stop when the training clock reaches this (agreed by all)
    stop_at_target: bool = False          # a race: stop at the first evaluation whose mean metric is on target
    optimizer: str | None = None          # the workload's own by default; "sgd" / "adamw" by name
    tensorboard: str | None = None        # a directory for TensorBoard scalars (worker rank 0 writes them)
    device: str = "cpu"                   # "cuda": model, batches, buffers on GPUs (launcher.pick_backend)
    speeds: str | None = None             # each worker's emulated speed (`thinwire.speeds`: "1,1,1,0.5", "stragglers")
    race_id: str | None = None            # (set by run_training) names this run's evaluations in the launcher's store
    faulty: str | None = None             # "RANK:KIND": one worker's contributions corrupted (exchange/faulty.py)
    # a race peer that `algorithm` names (PyTorch's, torchft's), resolved by `thinwire.compare.peers.resolve`
    # above this layer: its `stepper` runs instead of thinwire's Trainer, `check(params, workers)` and
    # `checkpoints` serve validation; None: a thinwire algorithm. Not part of the record (`to_dict`).
    peer: Any = None

    def to_dict(self) -> dict:
        """The configuration as recorded (JSON): every field but the resolved peer, which `algorithm` names."""
        return {k: v for k, v in asdict(replace(self, peer=None)).items() if k != "peer"}

    def validate(self) -> "TrainConfig":
        workloads.registry.lookup(self.workload)
        if self.budget_s is not None:
            check_number("--budget", self.budget_s, 0, low_open=True, why=" (seconds of training time)")
        if self.optimizer is not None:
            workloads.check_optimizer(self.optimizer, "--optimizer")
        if self.tensorboard is not None:
            check_tensorboard(self.tensorboard)
        if not self.peer:
            algorithms.registry.lookup(self.algorithm)
            if self.compressor is not None:
                compressors.lookup(self.compressor)
            if self.memory is not None:
                memories.lookup(self.memory)
        net = parse_network(self.network)
        check_int("--workers", self.workers, 1)
        if isinstance(net, Islands):
            net.check_workers(self.workers)
        check_int("--seed", self.seed, 0, MAX_SEED)
        check_faulty(self.faulty, self.workers, self.algorithm if self.peer and not self.peer.faulty else None)
        profile = speeds.parse(self.speeds)
        if profile is not None:
            profile.check_workers(self.workers)
        if self.peer:
            return self._validate_peer()
        arch = self.architecture()
        self.resolve_servers()
        check_int("--servers", self.servers, 0)
        pick_backend(None, self.device, 1 if under_torchrun() else self.workers + self.servers)
        if self.workers + self.servers > MAX_LOCAL_WORKERS and not under_torchrun():
            raise UserError(f"--workers + --servers must be at most {MAX_LOCAL_WORKERS} on one machine, got "
                            f"{self.workers + self.servers} (each rank is a process with its own interpreter, "
                            f"torch runtime and copy of the model); across machines run under torchrun")
        if arch not in algorithms.architectures(self.algorithm):
            algorithms.registry.lookup(self.algorithm)(architecture=arch)  # its own message (Tang et al. 2020 Table II)
        if arch == "ps" and self.servers < 1:  # server ranks come beside the workers: world = workers + servers
            raise UserError(f"{self.algorithm} on the parameter server needs --servers K >= 1 "
                            f"(server ranks beside the {self.workers} workers)")
        if self.servers and isinstance(net, Islands):
            raise UserError(f"{self.network}: a two-tier network has a place for each of its {net.workers} workers, "
                            f"none for parameter servers; run {self.algorithm} on all-reduce or on a flat network")
        if self.servers and arch != "ps":
            raise UserError(f"--servers is for the parameter-server architecture (bsp --architecture ps, ssp, "
                            f"asp, backup); {self.algorithm} runs on {arch}")
        check_lengths(self)
        if self.checkpoint_every is not None and self.servers and self.total_steps(workloads.get(self.workload)) is None:
            raise UserError("checkpoints on the parameter server need a step bound: give --steps or --epochs")
        if self.checkpoint_every is not None and not self.checkpoint_dir:
            raise UserError("--checkpoint-every N needs a directory (--out or --checkpoint-dir)")
        if self.target is not None:
            check_number("--target", self.target, 0, why=" (an accuracy in [0, 1], or a loss)")
        self._check_fit()
        if self.progress_timeout is not None:
            check_number("--progress-timeout", self.progress_timeout, 0, low_open=True, why=" (seconds)")
        self._check_deadline()
        if self.nonfinite not in ("stop", "skip"):
            raise UserError(f"--nonfinite must be stop or skip, got {self.nonfinite!r}")
        if self.on_failure not in ("stop", "continue"):
            raise UserError(f"--on-failure must be stop or continue, got {self.on_failure!r}")
        if self.elastic is not None or self.join is not None:
            self._check_elastic()
        if self.listen is not None:
            self.listen_address()
        if self.on_failure == "continue" and self.checkpoint_every:
            raise UserError("--on-failure continue goes on with the survivors instead of restarting from a "
                            "checkpoint; drop --checkpoint-every (or use --on-failure stop)")
        if self.on_failure == "continue" and (self.budget_s is not None or self.stop_at_target):
            # the race's stop is agreed over every worker rank (run/schedule.py): a lost one would hang it
            raise UserError("--on-failure continue trains a fixed number of steps; drop --budget and "
                            "--stop-at-target (or use --on-failure stop)")
        if self.nonfinite == "skip" and self.servers:  # the agreement is an all-reduce the servers never join
            raise UserError("--nonfinite skip needs every rank to step; parameter-server runs (--servers) use "
                            "--nonfinite stop")
        if self.checkpoint_every is not None and self.servers and not checkpointable_on_ps(self.algorithm):
            ok = [n for n in algorithms.names() if checkpointable_on_ps(n)]
            raise UserError(f"checkpoints of {self.algorithm} on the parameter server are not supported; "
                            f"checkpointable there: {', '.join(ok)} (or {self.algorithm} on all-reduce)")
        if self.resume is not None:   # every rank's file too, where one launcher starts every rank
            checkpoint.check(self.resume, self.workers + self.servers, self, files=not under_torchrun())
        if self.checkpoint_dir is not None:
            check_writable_dir(self.checkpoint_dir, "--checkpoint-dir")
        self._check_lr_momentum(why=f" (plain SGD diverges far below {MAX_LR:g})")
        # every component built as each worker will build it, and every pairing checked, before any starts
        params = nonfinite_params(self.nonfinite, self.component_params())
        alg, comp, mem, _, transport, _ = build_components(self.algorithm, self.compressor, self.memory, **params)
        wl = workloads.get(self.workload)
        optimizer = wl.optimizer_stand_in(self.lr, self.momentum, self.optimizer)   # the run's kind and settings
        check_run(alg, transport, self.workers + self.servers, optimizer, self.on_failure,
                  watching=not under_torchrun())
        if alg.pace != "step" and self.checkpoint_every is not None and not (alg.pace == "free" and self.servers) \
                and not (alg.pace == "round" and not racing(self)):
            raise UserError(f"{self.algorithm} here lets workers take different numbers of steps (pace "
                            f"{alg.pace!r}{') in a race (--budget, --stop-at-target' if alg.pace == 'round' else ''}"
                            f"), so no step is a checkpoint of every worker; drop --checkpoint-every")
        name, settings = wl.optimizer_settings(self.optimizer)
        if name == "sgd":
            check_momentum(alg, comp, mem, settings["momentum"] if self.momentum is None else self.momentum,
                           explicit=self.momentum is not None)
        return self

    def elastic_range(self) -> tuple[int, int]:
        """(MIN, MAX) of `--elastic MIN:MAX`."""
        lo, sep, hi = str(self.elastic).partition(":")
        try:
            lo, hi = int(lo), int(hi)
        except ValueError:
            lo = hi = None
        if not sep or lo is None or not 1 <= lo <= hi <= MAX_LOCAL_WORKERS:
            raise UserError(f"--elastic takes MIN:MAX, the fewest and the most workers, integers with 1 <= MIN <= "
                            f"MAX <= {MAX_LOCAL_WORKERS}; got {self.elastic!r}")
        return lo, hi

    def listen_address(self) -> tuple[str, int]:
        """(HOST, PORT) of `--listen HOST[:PORT]`, where an elastic job's store listens (PORT 0: a free one);
        127.0.0.1 (this machine only) by default."""
        if self.listen is None:
            return "127.0.0.1", 0
        if self.elastic is None:
            raise UserError("--listen is where an elastic job listens for workers that join (--join): give it with "
                            "--elastic MIN:MAX")
        text = str(self.listen)
        host, _, port = text.rpartition(":") if ":" in text else (text, ":", "0")
        host = host.removeprefix("[").removesuffix("]")     # [IPv6]:PORT
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise UserError(f"--listen takes HOST or HOST:PORT (an address of this machine, [IPv6]:PORT; PORT 0 or "
                            f"none: a free one), got {text!r}")
        return host, int(port)

    def _check_elastic(self) -> None:
        """An elastic job (or a worker joining one): an algorithm with synchronization boundaries on all-reduce,
        on the CPU, training a fixed number of steps (docs/reliability.md, "Workers that join a running job")."""
        if self.elastic is not None and self.join is not None:
            raise UserError("--elastic starts an elastic job, --join joins one: give one of them")
        if self.elastic is not None:
            lo, hi = self.elastic_range()
            if not lo <= self.workers <= hi:
                raise UserError(f"--workers {self.workers} is outside --elastic {self.elastic} (the job starts with "
                                f"--workers and keeps between MIN and MAX)")
        check_number("--replace-delay", self.replace_delay, 0, 3600, why=" (seconds)")
        if self.join is not None:
            host, _, port = self.join.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserError(f"--join takes HOST:PORT (the address an elastic job prints), got {self.join!r}")
        what = "--elastic" if self.elastic is not None else "--join"
        if self.servers or self.architecture() != "allreduce":
            raise UserError(f"{what} runs on all-reduce; {self.algorithm} on {self.architecture()} does not take "
                            f"newcomers")
        if self.device != "cpu":
            raise UserError(f"{what} runs on the CPU (gloo groups of its own per generation); drop --device cuda")
        if self.budget_s is not None or self.stop_at_target:
            raise UserError(f"{what} trains a fixed number of steps (every member evaluates at the same steps); "
                            f"drop --budget and --stop-at-target")
        if str(self.network).startswith("islands"):
            raise UserError(f"{what} runs on one link; two-tier networks (islands:...) need a fixed world")
        alg, _, _, scheduler, *_ = build_components(self.algorithm, self.compressor, self.memory,
                                                    **self.component_params())
        check_elastic(alg, scheduler)

    def _check_fit(self) -> None:
        """A target the workload's metric can reach, a batch no larger than the smallest worker's shard."""
        wl = workloads.get(self.workload)
        wl.check_target(self.target)
        wl.check_batch_size(self.workers, self.batch_size)

    def _check_deadline(self) -> None:
        if self.deadline is None:
            return
        check_number("--deadline", self.deadline, 0, low_open=True, why=" (seconds of wall time)")
        if under_torchrun():
            raise UserError("--deadline is the embedded launcher's; under torchrun bound the job with torchrun's "
                            "own options (--monitor-interval, timeouts) or your scheduler's")

    def _validate_peer(self) -> "TrainConfig":
        """A peer: its own parameters only; no thinwire compressor, servers or checkpoints."""
        if self.workers > MAX_LOCAL_WORKERS and not under_torchrun():
            raise UserError(f"--workers must be at most {MAX_LOCAL_WORKERS} on one machine, got {self.workers}")
        if self.compressor or self.memory or self.servers:
            raise UserError(f"{self.algorithm} is a peer (PyTorch's or torchft's own): it takes no thinwire "
                            f"--compressor, --memory or --servers")
        self.servers = 0
        if (self.checkpoint_every is not None or self.resume is not None) and not self.peer.checkpoints:
            raise UserError(f"checkpoints are written by thinwire's algorithms and by the plain ddp peer; "
                            f"{self.algorithm} is a peer with state in its hook or averager (run it without "
                            f"--checkpoint-every / --resume)")
        if self.nonfinite != "stop":
            raise UserError(f"{self.algorithm} is a peer: --nonfinite stop only (its all-reduce runs inside "
                            f"backward, before any agreement to skip)")
        if self.on_failure != "stop":
            raise UserError(f"{self.algorithm} is a peer: --on-failure stop only (survivors regroup in thinwire's "
                            f"Trainer)")
        if self.elastic is not None or self.join is not None:
            raise UserError(f"{self.algorithm} is a peer: --elastic and --join are thinwire's (its Trainer takes "
                            f"newcomers in); PyTorch's elastic restart is torchrun --max-restarts")
        check_lengths(self)
        self._check_fit()
        self._check_deadline()
        self._check_lr_momentum()
        self.params = self.peer.check(self.params, self.workers)   # typed, like every parameter
        return self

    def _check_lr_momentum(self, why: str = "") -> None:
        if self.lr is not None:
            check_number("--lr", self.lr, 0, MAX_LR, low_open=True, why=why)
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise UserError(f"--momentum must be in [0, 1), got {self.momentum}")

    def architecture(self) -> str:
        return self.params.get("architecture") or algorithms.architectures(self.algorithm)[0]

    def resolve_servers(self) -> int:
        """`servers` omitted (None): the algorithm's default on the parameter server (what `thinwire list`
        shows, 1), else 0."""
        if self.servers is None and self.peer:      # a PyTorch / torchft peer has no server ranks
            self.servers = 0
        if self.servers is None:
            default = algorithms.registry.parameters(self.algorithm).get("servers")
            on_ps = self.architecture() == "ps"
            self.servers = (default if isinstance(default, int) and default > 0 else 1) if on_ps else 0
        return self.servers

    def component_params(self) -> dict:
        """The parameters routed to the algorithm, compressor, memory and exchange (`--servers`, `--faulty`
        included)."""
        params = {**self.params, "faulty": self.faulty} if self.faulty is not None else dict(self.params)
        return {**params, "servers": self.servers} if self.servers else params

    def total_steps(self, wl: workloads.Workload) -> int | None:
        """The step bound: --steps, else --epochs, else (a race with a budget) none, else the workload's epochs."""
        if self.steps is not None:
            return self.steps
        if self.epochs is None and self.budget_s is not None:
            return None
        epochs = self.epochs if self.epochs is not None else wl.epochs
        return max(1, math.ceil(epochs * wl.steps_per_epoch(self.workers, self.batch_size)))


def summarize(cfg: TrainConfig, results: list[dict], wall_s: float) -> tuple[dict, list[dict]]:
    """Merge the workers' records: the summary and the per-step metrics rows."""
    wl = workloads.get(cfg.workload)
    workers = [r for r in results if r is not None and r["role"] == "worker"]   # None: a lost worker
    servers = [r for r in results if r is not None and r["role"] != "worker"]
    # by step: the workers that recorded it (all of them, except in an elastic job, where a newcomer's records
    # begin at the step it joined)
    target = cfg.target if cfg.target is not None else wl.target
    clocked = any(w.get("pace") == "clock" for w in workers)   # workers at their own pace (run/schedule.py)
    steps_of = {}
    for w in (workers[:1] if clocked else workers):   # (at their own pace: worker 0's steps and clock)
        for rec in w["steps"]:
            steps_of.setdefault(rec["step"], []).append(rec)
    n_steps = len(steps_of)
    # each step: the slowest worker's clock and step time, the workers' mean of the rest
    rows = [{"step": step, **{k: (max if k in ("t", "step_s") else statistics.fmean)(p[k] for p in per)
                              for k in ("loss", "t", "step_s", "bytes_sent", "emulated_s", "wait_s")}}
            for step, per in sorted(steps_of.items())]
    # in a race the ranks agreed on the mean and the clock (and stopped on them): the same numbers here; at their
    # own pace, the mean of every worker's latest evaluation as it moved (`race_curve`)
    mark = wl.metric if wl.metric == "accuracy" else "test_loss"
    if clocked:     # the mean of every worker's latest evaluation, in the order of their clocks
        evals = race_curve([w["evals"] for w in workers])
        hit, resolution = race_crossing(evals, lambda v: wl.reached(v, target))
        j = 0       # worker 0's step rows carry the race's metric as it stood at their clock
        for row in rows:
            if j < len(evals) and evals[j]["t"] <= row["t"]:
                while j < len(evals) and evals[j]["t"] <= row["t"]:
                    j += 1
                row[mark] = evals[j - 1]["value"]
        if rows and 0 < j < len(evals):
            rows[-1][mark] = evals[-1]["value"]
    else:
        evals_of = {}
        for w in workers:
            for rec in w["evals"]:
                evals_of.setdefault(rec["step"], []).append(rec)
        evals = [{"step": per[0]["step"], "t": per[0].get("agreed_t", max(p["t"] for p in per)),
                  "value": per[0].get("agreed", statistics.fmean(p["value"] for p in per))}
                 for _, per in sorted(evals_of.items())]
        by_step = {e["step"]: e for e in evals}
        for row in rows:
            if row["step"] in by_step:
                row[mark] = by_step[row["step"]]["value"]
        at = next((i for i, e in enumerate(evals) if e["step"] > 0 and wl.reached(e["value"], target)), None)
        hit = None if at is None else evals[at]
        # the true crossing lies in the interval before the evaluation that saw it: the reading's resolution
        # (0 when the evaluation before was one step earlier: the model changes only at the end of a step)
        resolution = (hit["t"] - evals[at - 1]["t"] if evals[at - 1]["step"] < hit["step"] - 1 else 0.0) \
            if hit and at > 0 else None
    per_worker = [len(w["steps"]) for w in workers]
    n_params = workers[0]["num_params"]
    # an fp32 ring all-reduce of the model every step, among the workers of that step: those who began, then
    # each loss's survivors (a lost worker's records are gone: it is not among `workers`)
    failures = workers[0]["metrics"].get("failures", []) if cfg.elastic is None else []
    began = len(workers) + sum(len(f["lost"]) for f in failures)
    worlds = Counter(next((len(f["members"]) for f in reversed(failures) if step > f["step"]), began)
                     for step in steps_of)
    nominal = {w: ring_allreduce(parse_network("lan"), w, n_params * 4).sent for w in {began, *worlds}}
    nominal_run = sum(nominal[w] * k for w, k in worlds.items())
    nominal_step = nominal[began] if set(worlds) <= {began} else nominal_run / n_steps
    sent = [w["meter"]["total"]["bytes_sent"] for w in workers]
    step_times = [r["step_s"] for r in rows]
    train_s = max(w["train_s"] for w in workers)
    drain_s = statistics.fmean(w.get("drain_s", 0.0) for w in workers)
    batch = cfg.batch_size or wl.batch_size
    final = statistics.fmean(w["final"] for w in workers)
    best = (max if wl.metric == "accuracy" else min)((e["value"] for e in evals), default=final)
    summary = {
        "workload": cfg.workload, "algorithm": cfg.algorithm, "network": cfg.network,
        "workers": len(workers), "servers": len(servers), "compressor": cfg.compressor, "memory": cfg.memory,
        "params": cfg.params, "seed": cfg.seed, "device": cfg.device, "steps": n_steps, "wall_s": wall_s, "train_s": train_s,
        "metric": wl.metric, "target": target, "metric_note": wl.unmoved([e["value"] for e in evals]),
        ("final_accuracy" if wl.metric == "accuracy" else "final_loss"): final,
        ("best_accuracy" if wl.metric == "accuracy" else "best_loss"): best,
        "time_to_target_s": hit["t"] if hit else None, "steps_to_target": hit["step"] if hit else None,
        "time_to_target_resolution_s": resolution,
        "stop_reason": workers[0].get("stopped", "steps"), "budget_s": cfg.budget_s,
        "bytes_sent_per_worker": statistics.fmean(sent),
        # of those, over a two-tier network's thin link (between islands): what a user pays for between sites
        "bytes_across_per_worker": statistics.fmean(w["meter"]["total"].get("bytes_across", 0.0) for w in workers),
        "bytes_sent_per_worker_per_step": statistics.fmean(sent) / max(1, n_steps),
        "nominal_bytes_per_worker": nominal_run,
        "nominal_bytes_per_worker_per_step": nominal_step,
        "bytes_sent_per_server": statistics.fmean(s["meter"]["total"]["bytes_sent"] for s in servers) if servers else None,
        "bytes_recv_per_server": statistics.fmean(s["meter"]["total"]["bytes_recv"] for s in servers) if servers else None,
        "server_metrics": servers[0]["metrics"] if servers else None,
        "emulated_comm_s": statistics.fmean(w["meter"]["total"]["emulated_s"] for w in workers),
        "exposed_comm_s": statistics.fmean(w["meter"]["total"]["wait_s"] for w in workers),
        # of that, waited within steps (a race's drain after it stopped, `drain_s`, and the final one excluded)
        "exposed_in_steps_s": sum(r["wait_s"] for r in rows),
        "drain_s": drain_s,
        "step_time_s": statistics.median(step_times) if step_times else None,
        # steady throughput: the training clock without the drain after a race stopped
        "throughput_samples_s": sum(per_worker) * batch / (train_s - drain_s) if train_s > drain_s else None,
        "steps_per_worker": per_worker, "slowed_s": statistics.fmean(w.get("slowed_s", 0.0) for w in workers),
        "speeds": cfg.speeds,
        "num_params": n_params,
        "model_sha256": workers[0].get("model_sha256"),  # rank 0's final model: resume equality checks
        "algorithm_metrics": workers[0]["metrics"],
        # workers lost and survived (--on-failure continue): who, and the step the survivors went on from
        "failures": workers[0]["metrics"].get("failures", []),
    }
    return summary, rows


def run_training(cfg: TrainConfig, out: str | None = None, pool=None) -> dict:
    """Launch the workers (or use `pool`), train, write `out/metrics.jsonl`, `out/summary.json`
    (and `out/trace.json` with `cfg.trace`), and return the summary."""
    if out:
        check_writable_dir(out, "--out")  # before training: never lose the results to a bad path
    cfg.validate()
    t0 = _now()
    if cfg.race_id is None:     # (workers at their own pace post their evaluations under it: run/schedule.py)
        cfg = replace(cfg, race_id=uuid.uuid4().hex)
    if cfg.join is not None:    # this process joins the elastic job there as one more worker (under torchrun
        return join_by_hand(cfg.join, train_worker, cfg)    # too); the job's launcher writes the summary
    if cfg.elastic is not None:
        return run_elastic(cfg, out, pool)
    if pool is not None:
        extra = {} if cfg.deadline is None else {"deadline": cfg.deadline}
        results = pool.run(train_worker, cfg, network=cfg.network, seed=cfg.seed, **extra)
    else:
        results = launch(train_worker, cfg.workers + cfg.servers, network=cfg.network, args=(cfg,), seed=cfg.seed,
                         progress_timeout=cfg.progress_timeout or PROGRESS_TIMEOUT, on_failure=cfg.on_failure,
                         device=cfg.device, deadline=cfg.deadline)
    return summarize_and_write(cfg, results, _now() - t0, out)


def run_elastic(cfg: TrainConfig, out: str | None = None, pool=None, on_start=None) -> dict:
    """`thinwire train --elastic MIN:MAX`: an elastic job (`thinwire.launcher.elastic.ElasticPool`) that replaces
    each lost worker (`replace_delay` later) and takes newcomers joined by hand (`--join`, the address printed on
    stderr) up to MAX. The summary adds `elastic`: the generations, the workers lost and the newcomers started.
    `on_start(pool)`, if given, runs once the pool listens (the churn benchmark starts its kill schedule there)."""
    lo, hi = cfg.elastic_range()
    t0 = _now()
    own = pool is None
    if own:
        host, port = cfg.listen_address()
        pool = ElasticPool(cfg.workers, max_workers=hi, min_workers=lo, replace=True,
                           replace_delay=cfg.replace_delay, host=host, port=port,
                           progress_timeout=cfg.progress_timeout or PROGRESS_TIMEOUT)
    try:
        here = pool.host if pool.host not in ("0.0.0.0", "::") else "ADDRESS"     # every interface: any of them
        print(f"thinwire: elastic job ({lo}..{hi} workers) on {pool.host}:{pool.port}; more workers join with "
              f"`thinwire train --join {here}:{pool.port}` and this run's other options", file=sys.stderr,
              flush=True)
        if on_start is not None:
            on_start(pool)
        got = pool.run(train_worker, cfg, network=cfg.network, seed=cfg.seed, deadline=cfg.deadline)
    finally:
        if own:
            pool.close()
    elastic = {"min": lo, "max": hi, "generations": pool.generations, "lost": pool.lost, "joined": pool.joined,
               "refused": {str(k): v for k, v in pool.refused.items()}}
    return summarize_and_write(cfg, [got[m] for m in sorted(got)], _now() - t0, out, {"elastic": elastic})


def summarize_and_write(cfg: TrainConfig, results: list[dict], wall_s: float, out: str | None,
                        extra: dict | None = None) -> dict:
    """The summary (`summarize`, with `extra`); with `out`, also written: `out/metrics.jsonl`,
    `out/summary.json` and, with `cfg.trace`, `out/trace.json` (each atomically)."""
    summary, rows = summarize(cfg, results, wall_s)
    summary.update(extra or {})
    if out:
        os.makedirs(out, exist_ok=True)
        if cfg.trace:
            write_chrome_trace(os.path.join(out, "trace.json"), [r["trace"] for r in results])
            summary["trace"] = os.path.join(out, "trace.json")
        atomic_write(os.path.join(out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
        atomic_write(os.path.join(out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    return summary


def run_torchrun_worker(cfg: TrainConfig, rank: int, world_size: int, out: str | None) -> dict | None:
    """Under torchrun: train as one worker of the job; rank 0 gathers the records (as JSON, never pickle)
    and writes the outputs. Returns the summary on rank 0, None elsewhere."""
    cfg.workers = world_size - cfg.resolve_servers()  # the workers are what torchrun started
    if cfg.resume and not checkpoint.exists(cfg.resume):
        # torchrun runs the same command on every (re)start: `--resume DIR` before DIR's first checkpoint
        # starts fresh; an elastic restart after a failure then continues from the last checkpoint
        if rank == 0:
            print(f"thinwire: no checkpoint in {cfg.resume} yet: starting from step 0", file=sys.stderr)
        cfg.resume = None
    if (rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        # the restarted group would share the store with the failed one and may read its stale addresses
        print("thinwire: warning: with --max-restarts, run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "(a restarted group may otherwise connect to the failed group's addresses; pytorch#135712)",
              file=sys.stderr)
    if out and rank == 0:
        check_writable_dir(out, "--out")
    cfg.validate()
    if cfg.resume and rank == 0:
        step = checkpoint.check(cfg.resume, world_size, cfg)["step"]
        print(f"thinwire: resuming from the checkpoint in {cfg.resume} (step {step})", file=sys.stderr)
    t0 = _now()
    results = gather_json(train_worker(rank, world_size, cfg), rank, world_size)
    return None if results is None else summarize_and_write(cfg, results, _now() - t0, out)


def gather_json(mine, rank: int, world_size: int) -> list | None:
    """Every rank's `mine` (JSON-serialisable: a worker's records) at rank 0, by rank, sent as JSON (never
    pickle: a receiver parses, no code runs); None on the other ranks."""
    blob = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    padded = torch.zeros(int(max(s.item() for s in sizes)), dtype=torch.uint8)
    padded[:blob.numel()] = blob
    got = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(got, padded)
    dist.barrier()
    if rank != 0:
        return None
    return [json.loads(bytes(g[:int(s.item())].tolist()).decode()) for g, s in zip(got, sizes)]
