"""`thinwire compare` under torchrun: the race on the processes torchrun started (one worker each, on your
machines), over the network between them.

The same command runs on every node. Rank 0 runs the race (`thinwire.compare.matrix.Harness`): every decision —
the cells and their order, the seeds, the planner's parameters from the reference's measured steps, the
calibrations — is taken there, and only there. The other ranks follow (`follow`): each training run of the race
(a calibration, the reference, a cell) is one message from rank 0, the run's configuration as JSON
(`thinwire.comm.state.broadcast_state`: nothing pickled, nothing decided on the receiving side), which every rank
then trains as one worker (`train_worker`, as a local pool's worker does); rank 0 gathers the workers' records as
JSON (`thinwire.run.train.gather_json`). A last message ends the followers with rank 0's exit status. So no rank
can take another path and leave the others waiting in a collective.

`ClusterPool` is that pool as the harness sees it (`run(train_worker, cfg, network=, seed=)`, by rank at rank 0).
The network a cell names is emulated in-process on top of the real one (`lan`, the default under torchrun,
emulates nothing: the network as it is). No watchdog or deadline: a worker that fails or hangs ends the race (the
cells done are kept in results.json; `--resume DIR` under torchrun runs the rest).

Refused before anything starts (`check`, one line): `--netem` (namespaces on one machine), `--device cuda` (the
messages here travel on gloo), `--workers` other than the processes torchrun started, cells with parameter-server
ranks (every process is a worker here), and peers that run on one machine only (torchft's Lighthouse).
"""
from __future__ import annotations

import os
import sys

from ..comm import set_default_network
from ..comm.state import broadcast_state
from ..errors import UserError, WorkerError
from ..launcher import under_torchrun
from ..run.loop import train_worker
from ..run.train import TrainConfig, gather_json
from . import peers


def world_size() -> int:
    """The processes torchrun started (its WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check(cfg, cells, servers) -> None:
    """A one-line UserError for what a race under torchrun cannot run (`cells`: the matrix's `presets.Cell`s;
    `servers(cell)`: the parameter-server ranks its run takes)."""
    if cfg.netem:
        raise UserError("--netem makes network namespaces on one machine; under torchrun the cells run on the "
                        "network between torchrun's processes: drop --netem")
    if cfg.device != "cpu":
        raise UserError("--device cuda is not supported under torchrun yet (the race's messages between ranks "
                        "travel on gloo); run --device cpu")
    if cfg.workers != world_size():
        raise UserError(f"under torchrun every process is one worker: --workers must be the {world_size()} "
                        f"processes torchrun started, got {cfg.workers}")
    for cell in cells:
        peer = peers.find(cell.algorithm) if cell.peer else None
        if peer is not None and peer.one_machine:
            raise UserError(f"cell {cell.label!r}: {peer.name} runs on one machine only ({peer.one_machine}); "
                            f"leave it out under torchrun")
        if servers(cell):
            raise UserError(f"cell {cell.label!r}: parameter-server cells need server ranks beside the workers; "
                            f"under torchrun every process is a worker (run it with thinwire's own launcher)")


def matches(torchrun: bool) -> None:
    """A matrix for torchrun's processes (`torchrun`) runs (and resumes) under torchrun only, one for thinwire's
    local worker pools without it."""
    if torchrun != under_torchrun():
        raise UserError("this matrix ran under torchrun: resume it under torchrun" if torchrun else
                        "this matrix is for thinwire's local worker pools: run it without torchrun")


def _work(rank: int, world: int, cfg: TrainConfig, network: str, seed: int) -> list | None:
    set_default_network(network, seed)      # as a local pool's worker does before each run
    return gather_json(train_worker(rank, world, cfg), rank, world)


class ClusterPool:
    """Rank 0's pool: a run is sent to the followers, trained here as worker 0, and gathered (by rank)."""

    closed = False

    def __init__(self, world: int):
        self.world_size = world
        self.busy = False       # inside a run: the followers are in its collectives, not waiting for a message

    def run(self, fn, *args, network="lan", seed: int = 0, timeout=None, deadline=None) -> list:
        if fn is not train_worker or len(args) != 1 or not isinstance(args[0], TrainConfig):
            raise TypeError("under torchrun the race runs train_worker(cfg) only")
        cfg = args[0]
        broadcast_state({"op": "run", "config": cfg.to_dict(), "network": network, "seed": seed}, src=0)
        self.busy = True
        try:
            out = _work(0, self.world_size, cfg, network, seed)
        except (UserError, WorkerError) as e:   # not a failed cell: the others are inside this run's collectives
            raise RuntimeError(f"rank 0 failed inside a run of the race, which ends it: {e}") from e
        self.busy = False
        return out

    def close(self, code: int, error: str | None = None) -> None:
        """End the followers with this exit status (and rank 0's error). Not from inside a run that failed: the
        followers are in its collectives then, and end when this process's connections close."""
        if not self.busy and not self.closed:
            broadcast_state({"op": "stop", "code": code, "error": error}, src=0)
        self.closed = True


def follow(rank: int, world: int) -> int:
    """A rank other than 0: train every run rank 0 sends, until it says stop; returns rank 0's exit status."""
    while True:
        msg = broadcast_state(None, src=0)
        if msg["op"] == "stop":
            if msg.get("error"):
                print(f"thinwire: rank 0 stopped the race: {msg['error']}", file=sys.stderr)
            return int(msg["code"])
        cfg = peers.resolve(TrainConfig(**msg["config"]))
        _work(rank, world, cfg, msg["network"], int(msg["seed"]))
