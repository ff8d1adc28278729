"""The peers by name: a peer module declares a `Peer` per name and registers it; the race, `thinwire train` and the
benchmarks read the declarations only. `resolve` sets `TrainConfig.peer`, which travels to the workers (so a peer
lives where they can import it): the loop builds its `stepper`, `TrainConfig.validate` calls `check`."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

from ...errors import UserError
from ...registry import Param, check_params


@dataclass
class Peer:
    name: str
    stepper: Callable                   # (cfg, workload, rank, world_size) -> Stepper, built in every worker
    plan_as: tuple[str, str]            # the thinwire (algorithm, compressor) the planner and the defaults see
    params: dict[str, Param] = field(default_factory=dict)   # declared, checked by the registry's rules
    # the parameters the planner reads as `plan_as`'s, each with its value where the cell leaves it out (None:
    # the planner's own default)
    plan_params: dict = field(default_factory=dict)
    kind: str = "PyTorch peer"          # what the report calls it
    title: str | None = None            # the report compares the winner with this peer's plain cell, so named
    needs: str | None = None            # a module its optional extra installs (None: torch only)
    install: str = ""                   # the command that installs it
    checks: Callable | None = None      # (params, workers): its own refusals, a one-line UserError
    checkpoints: bool = False           # its stepper writes checkpoints (and resumes from them)
    faulty: bool = False                # its stepper corrupts a `--faulty` rank's contributions as thinwire's do
    one_machine: str | None = None      # why it runs only on one machine (refused under torchrun), or None

    def missing(self) -> str | None:
        """Why this peer cannot run here (its optional extra is not installed), or None."""
        gone = self.needs is not None and importlib.util.find_spec(self.needs) is None
        return f"{self.name} needs the optional extra: {self.install}" if gone else None

    def unknown(self, params: dict) -> str | None:
        """What is wrong with the names of `params` (ones this peer does not take), or None."""
        bad, takes = [k for k in params if k not in self.params], ", ".join(self.params) or "no parameters"
        return f"peer {self.name!r} takes {takes}, not {', '.join(bad)}" if bad else None

    def check(self, params: dict, workers: int) -> dict:
        """`params` converted to the types the peer declares (CLI strings like every other parameter's); a
        UserError (one line) for parameters it does not take or cannot run with, here or on `workers`."""
        why = self.unknown(params) or self.missing()
        if why:
            raise UserError(why)
        params = check_params(f"peer {self.name!r}", self.params, params)
        if self.checks is not None:
            self.checks(params, workers)
        return params


_PEERS: dict[str, Peer] = {}


def register(peer: Peer) -> Peer:
    if _PEERS.get(peer.name, peer) != peer:
        raise RuntimeError(f"peer {peer.name!r} registered twice")
    _PEERS[peer.name] = peer
    return peer


def unregister(name: str) -> None:
    _PEERS.pop(name, None)


def find(name: str) -> Peer | None:
    return _PEERS.get(name)


def names() -> list[str]:
    """The peers in the order they were registered."""
    return list(_PEERS)


def resolve(cfg):
    """`cfg` (a `thinwire.run.train.TrainConfig`) with `peer` set where its algorithm names a peer."""
    if cfg.peer is None:
        cfg.peer = find(cfg.algorithm)
    return cfg
