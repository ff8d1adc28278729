"""A peer of one's own touches one file: this module declares a toy peer (its stepper, parameters, how the planner
sees it, what the report calls it), registers it and races it through `thinwire compare`'s code path. The worker
processes import this module to build the stepper: the declaration travels with the run's configuration."""
from __future__ import annotations

import json
import os

import pytest

from thinwire.compare import matrix as cmp
from thinwire.compare import peers
from thinwire.compare.peers.counter import AllReduceCounter, PeerStepper
from thinwire.errors import UserError
from thinwire.net import parse_network
from thinwire.registry import Param
from thinwire.run.stepper import make_optimizer

NAME = "toy-mean"


class MeanOfGradients(PeerStepper):
    """The smallest peer: every gradient all-reduced on its own (charged and counted on the emulated link) and
    divided by the workers, then the optimizer's step."""

    def __init__(self, cfg, wl, rank: int, world_size: int):
        self.counter = AllReduceCounter(rank, parse_network(cfg.network))
        model = wl.model(cfg.seed)
        super().__init__(model, model, rank)
        self.optimizer, self.world = make_optimizer(cfg, wl, model), world_size
        self.desc = f"mean of gradients, tensor by tensor ({cfg.params.get('note', 'plain')})"
        self.start_counting()

    def step(self) -> dict:
        for p in self.parameters:
            self.counter.all_reduce(p.grad)
            p.grad.div_(self.world)
        return super().step()


def _refuse_one_worker(params: dict, workers: int) -> None:
    if workers < 2:
        raise UserError(f"{NAME} averages over at least 2 workers")


@pytest.fixture
def toy():
    peer = peers.register(peers.Peer(NAME, MeanOfGradients, ("bsp", "none"), {"note": Param("note", (str,), None)},
                                     kind="toy peer", checks=_refuse_one_worker))
    yield peer
    peers.unregister(NAME)


def test_a_toy_peer_registered_here_races_in_compare(toy, pool2, tmp_path):
    cfg = cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=["bsp", f"{NAME}:note=toy"],
                            steps=40, budget_s=5.0, eval_every=1)
    results = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    by = {r["label"]: r for r in json.load(open(tmp_path / "results.json"))["cells"]}
    bsp, mine = by["bsp"], by[f"{NAME}:note=toy"]
    assert mine["status"] == "ok" and mine["peer"] and not bsp["peer"], mine.get("error")
    assert mine["algorithm_metrics"]["peer"] == "mean of gradients, tensor by tensor (toy)"
    assert "peer" not in mine["config"] and mine["config"]["algorithm"] == NAME   # the record names it
    # the mean of the gradients is synchronous SGD: bsp's trajectory step by step, and its bytes on the wire
    assert mine["steps"] == bsp["steps"] and mine["stop_reason"] == bsp["stop_reason"]
    assert mine["final_loss"] == pytest.approx(bsp["final_loss"], rel=1e-4)
    assert bsp["bytes_sent_per_worker_per_step"] > 0
    assert mine["bytes_sent_per_worker_per_step"] == pytest.approx(bsp["bytes_sent_per_worker_per_step"])
    # planned as bsp, called what it declares in the report
    pred = results["predictions"]["lan"]["cells"]
    assert pred[f"{NAME}:note=toy"]["step_s"] == pytest.approx(pred["bsp"]["step_s"])
    report = open(os.path.join(tmp_path, "report.md")).read()
    assert f"| `{NAME}:note=toy` | toy peer |" in report


def test_a_toy_peers_declaration_is_checked_before_any_worker_starts(toy):
    with pytest.raises(UserError, match=f"peer '{NAME}' takes note, not rank"):
        cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=[f"{NAME}:rank=2"]).validate()
    with pytest.raises(UserError, match="averages over at least 2 workers"):
        cmp.CompareConfig(workload="linreg", workers=1, networks=["lan"], cells=[NAME]).validate()


def test_unregistered_the_name_is_unknown_again():
    assert peers.find(NAME) is None and NAME not in peers.names()
    with pytest.raises(UserError, match=f"unknown algorithm '{NAME}'"):
        cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=[NAME]).validate()
