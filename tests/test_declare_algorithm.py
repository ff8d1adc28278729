"""Adding an algorithm touches one file: a toy algorithm defined, declared and registered in this test module is
predicted by the planner, listed by `thinwire list` and raced by `thinwire compare`'s code path on 2 real workers
(registered in them by a task of the pool, which imports this module there), then unregistered. And the
declarations say what the name tables they replaced said."""
from __future__ import annotations

import json

import pytest

from thinwire import algorithms
from thinwire.algorithms import CostFamily
from thinwire.algorithms.bsp import BSP
from thinwire.errors import UserError
from thinwire.net import parse_network
from thinwire.plan.costmodel import Scenario, predict

TOY = "toy-declared"


class Toy(BSP):
    """A toy: synchronous SGD under a name of its own, declared to the planner as the every-step family."""

    cost = CostFamily("every_step")


class Undeclared(BSP):
    """A toy whose class says the planner has no model of it."""

    cost = None


def register(rank=None, world_size=None, names=((TOY, Toy),)) -> None:
    """Register the toys (here, and as a pool task in each worker)."""
    for name, cls in names:
        if name not in algorithms.registry:
            algorithms.register(name)(cls)


def unregister(rank=None, world_size=None, names=(TOY,)) -> None:
    for name in names:
        algorithms.registry.unregister(name)


@pytest.fixture
def toy():
    register()
    try:
        yield TOY
    finally:
        unregister()


def _scenario() -> Scenario:
    return Scenario(params=1e6, compute_s=0.1, link=parse_network("wan"), workers=4)


def test_the_planner_predicts_a_toy_from_its_declaration(toy):
    s = _scenario()
    for overlap in (False, True):
        got, bsp = predict(s, toy, "topk", overlap=overlap), predict(s, "bsp", "topk", overlap=overlap)
        assert (got.name, got.iteration_s, got.bytes_per_step, got.collective) == \
               (toy, bsp.iteration_s, bsp.bytes_per_step, bsp.collective)


def test_an_algorithm_without_a_cost_family_is_refused_by_name():
    register(names=(("toy-undeclared", Undeclared),))
    try:
        with pytest.raises(UserError, match="toy-undeclared.*declares no cost family"):
            predict(_scenario(), "toy-undeclared")
    finally:
        unregister(names=("toy-undeclared",))


def test_thinwire_list_lists_a_toy(toy, capsys):
    from thinwire.cli import main
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["algorithms"]}
    assert rows[toy]["summary"].startswith("A toy: synchronous SGD")


def test_a_toy_races_through_compare(toy, pool2, tmp_path):
    from thinwire.compare import matrix as cmp
    pool2.run(register)                 # each worker imports this module and registers the toy
    try:
        cfg = cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=[toy], budget_s=0.5)
        res = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    finally:
        pool2.run(unregister)
    (row,) = res["cells"]
    assert row["label"] == toy and row["status"] == "ok", row.get("error")
    assert row["steps"] > 0 and row["bytes_sent_per_worker_per_step"] > 0
    assert res["predictions"]["lan"]["cells"][toy]["step_s"] > 0     # the planner predicted it before the race
    assert toy in open(tmp_path / "report.md").read()


def test_the_declarations_say_what_the_name_tables_said():
    """(compare/matrix.py's EVERY_STEP and compare/presets.py's SGD_ONLY, before the algorithms declared them)"""
    from thinwire.compare.matrix import syncs_every_step
    every_step = {"bsp", "ssgd", "bitsgd", "odsgd", "cdsgd", "dts", "delayed", "tsparse", "dpsgd", "choco", "sgp",
                  "adpsgd", "asp", "ssp", "backup", "ddp", "ddp-fp16", "ddp-powersgd", "onebit-adam", "zeroone-adam"}
    peers = ("ddp", "ddp-fp16", "ddp-powersgd", "ddp-postlocalsgd", "ddp-hierarchical", "torchft-diloco")
    assert {n for n in [*algorithms.names(), *peers] if syncs_every_step(n)} == every_step
    assert {n for n in algorithms.names() if algorithms.registry.lookup(n).sgd_only} == \
           {"dts", "delayed", "tsparse", "cdsgd", "bitsgd", "odsgd", "ssgd"}
