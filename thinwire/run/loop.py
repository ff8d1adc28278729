"""The training loop, written once. `thinwire train`, every cell of `thinwire compare` (thinwire's algorithms,
the no-communication reference `local`, PyTorch's DDP peers, torchft's DiLoCo) and the benchmarks run
`train_worker`; what differs between them is the *stepper*, thinwire's Trainer's or the one a peer's factory builds
(`cfg.peer.stepper`, resolved above this layer by `thinwire.compare.peers`):

| stepper | where | what `step()` does after `loss.backward()` |
| --- | --- | --- |
| `TrainerStepper` | here | `thinwire.Trainer.step()`: the registered algorithm (its exchanges began during backward) |
| `DDPStepper` | `compare/peers/ddp.py` | PyTorch's optimizer step (DDP's comm hook all-reduced during backward) |
| `TorchftDiLoCoStepper` | `compare/peers/torchft_diloco.py` | the inner optimizer's step; torchft's DiLoCo syncs every H steps |

The loop owns everything else, the same for every stepper: data shards and batches, forward and backward, the
launcher's progress report (`report_progress`, between backward and the step's waits), the training clock,
evaluations (paused out of the clock), checkpoints and resume (steppers that can), the NaN/Inf policy (in the
stepper's `step()`), the progress bar, traces, TensorBoard scalars and the records `summarize` reads.

**Clock.** Each worker's training clock adds up its steps (forward, backward, communication it waits for, the
update) and the final drain (`close()`); evaluations, checkpoints, agreements and logging are outside it. A race's
drain after the evaluation that stopped it is also kept apart (`drain_s`): it is on the clock, but not in the
throughput a scalability reading compares (the sync it waits out would have been hidden by the steps not taken).

**When to evaluate, when to stop**: `thinwire.run.schedule` (`Schedule`, `ClockSchedule`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .. import speeds
from ..comm import elastic
from ..comm.context import store as race_store
from ..errors import UserError
from ..files import check_writable_dir
from ..launcher import report_progress
from ..trace import Tracer
from ..trainer import Trainer
from . import checkpoint, workloads
from .schedule import ClockSchedule, Schedule, racing
from .stepper import Stepper, make_optimizer, model_device

_now = time.perf_counter
ELASTIC_SEED = 10007    # an elastic job's loader of generation g is shuffled by seed + ELASTIC_SEED * g


# -- steppers ---------------------------------------------------------------------------------------------
class TrainerStepper(Stepper):
    """thinwire's own algorithms (and `local`, the no-communication reference) through `thinwire.Trainer`."""

    def __init__(self, cfg, wl, rank: int, tracer=None):
        if elastic.MEMBER is not None:      # a newcomer of another configuration is refused, naming the difference
            elastic.MEMBER.agree("run", checkpoint.config_fields(cfg))
        model = wl.model(cfg.seed).to(model_device(cfg))
        self.trainer = Trainer(model, make_optimizer(cfg, wl, model), algorithm=cfg.algorithm,
                               compressor=cfg.compressor, memory=cfg.memory, network=cfg.network, tracer=tracer,
                               nonfinite=cfg.nonfinite, on_failure=cfg.on_failure, **cfg.component_params())
        super().__init__(model, model, getattr(self.trainer.algorithm, "worker_rank", rank))
        self.optimizer, self.role = self.trainer.optimizer, getattr(self.trainer.algorithm, "role", "worker")
        t = self.trainer    # the Stepper's step, drain and checkpoint state are the Trainer's own
        self.step, self.close, self.state_dict, self.load_state_dict = t.step, t.close, t.state_dict, t.load_state_dict
        self.pace, self.request_stop = t.pace, t.request_stop

    @property
    def finished(self) -> bool:
        return self.trainer.finished

    @property
    def cut(self) -> int | None:
        return self.trainer.cut

    def counted(self, before: dict | None) -> tuple[dict, dict]:
        """This rank's meter (bytes, ops, emulated and exposed time, by kind and in total) and metrics over the
        whole run: on resume, what the checkpoint counted (`before`, written by `_save`) plus this segment's."""
        meter, metrics = self.trainer.transport.meter.to_dict(), self.trainer.metrics()
        if not before:
            return meter, metrics
        add = lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
        old = before["meter"]
        meter = {"total": add(old["total"], meter["total"]),
                 "by_kind": {k: add(old["by_kind"].get(k, {}), meter["by_kind"].get(k, {}))
                             for k in old["by_kind"].keys() | meter["by_kind"].keys()}}
        metrics.update({k: v for k, v in meter["total"].items() if k in metrics})
        metrics["skipped_steps"] = metrics.get("skipped_steps", 0) + before.get("skipped_steps", 0)
        return meter, metrics

    def serve(self, cfg, rank: int, world_size: int, total: int | None) -> dict | None:
        """A server rank: restore its state on resume, then serve; with checkpoints, it joins each one at the
        cut where every worker's pushes of that step are answered (PSServer.serve). Returns what the checkpoint
        it resumed from had counted (None: a fresh start)."""
        before = _restore(cfg, rank, self).get("counted") if cfg.resume else None
        save = lambda step: _save(cfg, rank, world_size, step, self, before)
        self.trainer.algorithm.serve(checkpoint=(cfg.checkpoint_every, total, save) if cfg.checkpoint_every else None)
        return before


# -- when to evaluate and when to stop --------------------------------------------------------------------
def worker_group(is_worker: bool):
    """A gloo group of the worker ranks (parameter servers left out) for the loop's agreements, apart from every
    group training uses, so that an agreement never interleaves with an exchange in flight. Every rank of the
    job calls this, in the same order; groups are kept for the life of the process (pools run many runs)."""
    world = dist.get_world_size()
    flags = [torch.zeros(1, device="cpu") for _ in range(world)]     # (a gloo group: host tensors)
    mine = torch.tensor([1.0 if is_worker else 0.0], device="cpu")
    dist.all_gather(flags, mine, group=_gloo_group(world, tuple(range(world))))
    return _gloo_group(world, tuple(r for r, f in enumerate(flags) if f.item() > 0))   # host: once per run


@functools.cache
def _gloo_group(world: int, ranks: tuple):
    """The gloo group of `ranks`, made once per process and world size."""
    return dist.new_group(list(ranks), backend="gloo")


# -- TensorBoard ------------------------------------------------------------------------------------------
def check_tensorboard(path) -> None:
    """`--tensorboard DIR` can work here: the optional extra is installed and DIR is writable (else one line)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the optional extra: pip install 'thinwire[tensorboard]' "
                        "(the tensorboard package)")
    check_writable_dir(path, "--tensorboard")


class Board:
    """TensorBoard scalars of one run, written live by worker rank 0 through `torch.utils.tensorboard`, outside
    the training clock. The x axis is the step; the event's wall time is the start plus the training clock, so
    TensorBoard's "relative" axis shows training time (evaluations excluded)."""

    def __init__(self, path: str, metric: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer, self.metric, self.t0 = SummaryWriter(log_dir=path), metric, time.time()

    def step(self, rec: dict) -> None:
        at = dict(global_step=rec["step"], walltime=self.t0 + rec["t"])
        for tag, key in (("train/loss", "loss"), ("train/step_s", "step_s"), ("comm/bytes_sent", "bytes_sent"),
                         ("comm/exposed_s", "wait_s"), ("comm/emulated_s", "emulated_s")):
            self.writer.add_scalar(tag, rec[key], **at)

    def evaluation(self, rec: dict) -> None:
        at = dict(global_step=rec["step"], walltime=self.t0 + rec["t"])
        self.writer.add_scalar(f"eval/{self.metric}", rec["value"], **at)
        if "agreed" in rec:
            self.writer.add_scalar(f"eval/{self.metric}_mean_over_workers", rec["agreed"], **at)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# -- the loop ---------------------------------------------------------------------------------------------
def train_worker(rank: int, world_size: int, cfg) -> dict:
    """Runs in every rank: train, evaluate, agree, stop; return this rank's records. In an elastic job `rank` is
    the member id and `world_size` the number of workers the job started with."""
    if elastic.MEMBER is not None and cfg.workers != world_size:   # (a newcomer joined by hand: the job's count)
        cfg = dataclasses.replace(cfg, workers=world_size)
    wl = workloads.get(cfg.workload)
    tracer = Tracer(rank, enabled=cfg.trace)
    stepper = TrainerStepper(cfg, wl, rank, tracer) if cfg.peer is None else cfg.peer.stepper(cfg, wl, rank, world_size)
    try:
        group = worker_group(stepper.role == "worker") if racing(cfg) and world_size > 1 else None
        if stepper.role != "worker":  # e.g. a parameter server rank: serves until the workers are done
            before = stepper.serve(cfg, rank, world_size, cfg.total_steps(wl))
            meter, metrics = stepper.counted(before)
            return {"rank": rank, "role": stepper.role, "meter": meter, "metrics": metrics,
                    "trace": tracer.events}
        return _loop(rank, world_size, cfg, wl, stepper, tracer, group)
    finally:
        stepper.shutdown()


def progress_bar(**kw):
    """A tqdm bar on stderr, locked by a thread lock. tqdm's default lock is a multiprocessing semaphore; made in a
    worker (rank 0 draws the training bar) it is registered with the launcher's resource tracker and not
    released when the worker exits, so every `thinwire train` ended with "1 leaked semaphore"."""
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
    return tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def _loop(rank, world_size, cfg, wl, stepper: Stepper, tracer, group) -> dict:
    wrank = stepper.worker_rank
    device = next(stepper.module.parameters()).device
    trainer = getattr(stepper, "trainer", None)
    member = getattr(trainer, "elastic", None)      # a member of an elastic job (thinwire.comm.elastic), or None

    def shard(seed: int | None = None):
        """This worker's batches: its shard among `cfg.workers`, or in an elastic job its shard as rank r of the
        current generation's n members, shuffled by (seed, generation, rank): the data follows the membership."""
        if member is None:
            r, n, seed = wrank, cfg.workers, cfg.seed if seed is None else seed
        else:
            r, n = trainer.transport.rank, trainer.transport.world_size
            seed = cfg.seed + ELASTIC_SEED * member.gen if seed is None else seed
        return wl.loader(r, n, cfg.batch_size, seed, device)    # (tensors: the shard moves to the device once)

    loader = shard()
    gen = member.gen if member is not None else None
    total = cfg.total_steps(wl)
    # workers at their own pace (dynamic local updates, asynchronous DiLoCo, `local`) meet on the clock
    clocked = stepper.pace != "step" and racing(cfg) and member is None and cfg.workers > 1
    # ... and outside a race, workers whose rounds differ in steps (dynamic local updates) end at the same sync
    rounds = stepper.pace == "round" and not clocked and member is None and cfg.workers > 1
    schedule = (ClockSchedule(cfg, wl, total, cfg.workers, wrank, race_store(), cfg.race_id) if clocked else
                Schedule(cfg, wl, total, cfg.workers, group))
    profile = speeds.parse(cfg.speeds)          # this worker's emulated speed (thinwire.speeds), on its clock
    slow = speeds.Slowdown(profile, wrank, cfg.workers, cfg.seed, tracer).install(stepper.module) \
        if profile is not None else None
    shown = cfg.progress and wrank == 0 and not os.environ.get("THINWIRE_NO_PROGRESS")
    bar = progress_bar(total=total, desc=f"{cfg.algorithm} on {cfg.network}", unit="step", leave=False) \
        if shown else None
    board = Board(cfg.tensorboard, wl.metric) if cfg.tensorboard and wrank == 0 else None
    steps, evals, clock, first, before, stop = [], [], 0.0, 1, None, None
    cut = 0     # (pace "round") the last round's end: checkpoints are cut there, named by `stepper.cut`
    log = StepLog(rank, stepper)

    def evaluate(step: int) -> str | None:
        """Evaluate (outside the clock), agree in a race, record; why to stop or None."""
        t1 = _now()
        rec = {"step": step, "t": clock, "value": wl.evaluate(stepper.module)}
        log.evaluation(step, rec["value"])
        why, agreed = schedule.evaluated(step, rec["value"], clock, _now() - t1)
        rec.update(agreed)
        evals.append(rec)
        if board is not None:
            board.evaluation(rec)
        return why

    drained = 0.0
    try:
        if cfg.resume:
            state = _restore(cfg, rank, stepper)
            if "loader_seed" in state:      # (an elastic run's shard of the generation it was written in)
                loader = shard(int(state["loader_seed"]))
            loader.load_state_dict(state["loader"])
            steps, evals, clock = state["records"]["steps"], state["records"]["evals"], float(state["clock"])
            first = int(state.get("own_step", state["step"])) + 1     # (cut at a round's end: each its own)
            cut = int(state["step"])
            before = state.get("counted")
            schedule.load_state_dict(state.get("schedule"))
            if bar is not None:
                bar.update(first - 1)
        elif member is not None and member.joining:     # a newcomer: from the step it joined at
            first = trainer.step_count + 1
        else:
            evaluate(0)
        step = first
        while total is None or step <= total or stop is not None:
            t0 = _now()
            log.begin()
            if slow is not None:
                slow.clock = clock
            xb, yb = loader.next()
            with tracer.span("forward", "forward"):
                loss = wl.loss(stepper.model(xb), yb)
            with tracer.span("backward", "backward"):
                loss.backward()
            report_progress(step)  # computed: the launcher's watchdog tells a stuck rank from those waiting on it
            traffic = stepper.step()
            stepper.zero_grad()
            if member is not None and member.gen != gen:    # the membership changed: this generation's shard
                gen, loader = member.gen, shard()
            # on a GPU this read waits for the step's queued work, which the training clock must include
            value = loss.item()   # host: once per step (the loss record)
            dt = _now() - t0
            clock += dt
            rec = {"step": step, "loss": value, "t": clock, "step_s": dt,
                   **{k: traffic[k] for k in ("bytes_sent", "emulated_s", "wait_s")}}
            steps.append(rec)
            if board is not None:
                board.step(rec)
            if clocked:
                if stop is None:
                    stop = evaluate(step) if schedule.due(step, clock) else schedule.poll(step, clock)
                    if stop is not None:
                        stepper.request_stop()      # pace "round": every worker ends at the same sync
                if stop is not None and (stepper.pace == "free" or stepper.finished):
                    drained = _timed(stepper.close)
                    clock += drained
            elif rounds and (step >= total or stepper.finished):   # every worker ends at the same sync, after
                if stop is None:                                    # the first one to reach `total` asked
                    stop = "steps"
                    stepper.request_stop()
                if stepper.finished:
                    clock += _timed(stepper.close)
                    log.committed = step
                    evaluate(step)
            elif schedule.due(step):
                if step == total:  # drain before the final evaluation: the final model is the consistent one
                    clock += _timed(stepper.close)
                    log.committed = step
                stop = evaluate(step)
                if stop is not None and step != total:  # a race ends here: drain, on the clock (and apart:
                    drained = _timed(stepper.close)     # it came after the evaluation that stopped the race)
                    clock += drained
            ending = stop is not None and (not (clocked or rounds) or stepper.pace == "free" or stepper.finished)
            if cfg.checkpoint_every:
                every, at, more = cfg.checkpoint_every, step, {} if member is None else {"loader_seed": loader.seed}
                if rounds:      # each worker at its own step: cut at the end of a round, named by a number they
                    at, more = stepper.cut, {"own_step": step}      # share (the fastest's steps; below `total`,
                    due = at is not None and at < total and at // every > cut // every    # no worker asked to stop)
                    cut = cut if at is None else at
                else:
                    due = step % every == 0 and step != total and stop is None
                if due:
                    _save(cfg, rank, world_size, at, stepper, before, loader=loader.state_dict(),
                          records={"steps": steps, "evals": evals}, clock=clock, schedule=schedule.state_dict(),
                          **more)
                    log.committed = step    # a restart from this checkpoint keeps the work up to here
            log.step(step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}", refresh=False)
            if ending:
                break
            step += 1
        if not evals:                   # a newcomer that joined at the last step
            stepper.close()
            evaluate(first - 1)
    finally:
        for opened in (log, bar, board):
            if opened is not None:
                opened.close()
        if slow is not None:
            slow.remove()
    params = stepper.parameters
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    meter, metrics = stepper.counted(before)
    return {"rank": rank, "role": "worker", "steps": steps, "evals": evals, "final": evals[-1]["value"],
            "model_sha256": hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest(),
            "meter": meter, "metrics": metrics, "stopped": stop or "steps",
            "trace": tracer.events, "num_params": sum(p.numel() for p in params), "train_s": clock,
            "drain_s": drained, "pace": "clock" if clocked or rounds else "step",
            "slowed_s": slow.waited_s if slow is not None else 0.0}


class StepLog:
    """With THINWIRE_STEP_LOG=DIR, one JSON line per step and per evaluation in DIR/<pid>.jsonl, flushed at once
    (a worker killed loses nothing it wrote), for `thinwire bench churn`'s goodput: {"m": rank (an elastic job's
    member), "s": step, "a"/"b": wall-clock start and end, "c": the last step whose work counts for good (a
    synchronization boundary of the algorithm, a checkpoint written, the last step), "d": the losses survived
    so far that threw away the work since the last boundary (not those where the survivors kept it)};
    {"m", "s", "e": the metric, "b"}."""

    def __init__(self, rank: int, stepper: Stepper):
        where = os.environ.get("THINWIRE_STEP_LOG")
        if where:
            os.makedirs(where, exist_ok=True)
        self.file = open(os.path.join(where, f"{os.getpid()}.jsonl"), "a") if where else None
        self.rank, self.trainer = rank, getattr(stepper, "trainer", None)
        self.committed, self.t0 = 0, 0.0

    def begin(self) -> None:
        self.t0 = time.time()

    def step(self, step: int) -> None:
        if self.file is None:
            return
        c, d = self.committed, 0
        if self.trainer is not None:
            c, d = max(c, self.trainer.committed), sum(not f.get("kept") for f in self.trainer.failures)
        self._write({"m": self.rank, "s": step, "a": self.t0, "b": time.time(), "c": c, "d": d})

    def evaluation(self, step: int, value: float) -> None:
        if self.file is not None:
            self._write({"m": self.rank, "s": step, "e": value, "b": time.time()})

    def _write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _timed(fn) -> float:
    t0 = _now()
    fn()
    return _now() - t0


def _save(cfg, rank, world_size, step, stepper, before, **more) -> None:
    """A checkpoint of this rank at `step`: the stepper's state, the RNG streams, the counters so far (so that a
    resumed run's summary counts the whole run) and `more` (a worker's loader position, records, clock and
    schedule)."""
    state = {"step": step, "trainer": stepper.state_dict(), "rng": checkpoint.rng_state()}
    meter, metrics = stepper.counted(before)   # after state_dict(), which may wait for exchanges in flight
    state.update(counted={"meter": meter, "skipped_steps": metrics.get("skipped_steps", 0)}, **more)
    barrier = dist.barrier
    if getattr(getattr(stepper, "trainer", None), "elastic", None) is not None:   # an elastic job: the current
        t = stepper.trainer.transport           # generation's ranks write it, on the generation's own group
        rank, world_size, barrier = t.rank, t.world_size, t.barrier
    checkpoint.save(cfg.checkpoint_dir, rank, world_size, step, cfg, state, barrier)


def _restore(cfg, rank, stepper) -> dict:
    """This rank's checkpoint state in `cfg.resume`, with the stepper's state and the RNG streams restored."""
    state = checkpoint.load(cfg.resume, rank)
    stepper.load_state_dict(state["trainer"])
    checkpoint.set_rng_state(state["rng"])
    return state
