"""The algorithm × compressor matrix (issue 17): every cell that construction accepts builds a Trainer and takes
steps across real worker processes; every refused cell is refused with a message naming alternatives."""
from __future__ import annotations

import math

import pytest

from thinwire.errors import UserError
from thinwire.run.benchmarks import matrix

STEPS = 2


def smoke_worker(rank, world_size, todo):
    """Each cell in turn: build its trainer, take STEPS steps of digits-mlp, close (parameter-server cells: the
    server rank serves). Returns per cell: "ok", or the UserError raised at construction, or the last loss."""
    from thinwire.run.train import train_worker
    out = []
    for cell in todo:
        cfg = matrix.config(cell, "digits-mlp", world_size - cell["servers"], steps=STEPS, eval_every=10 ** 6)
        try:
            rec = train_worker(rank, world_size, cfg)
        except UserError as e:
            out.append(("refused", str(e)))
            continue
        except Exception as e:          # reported with its cell; the other cells go on
            out.append(("error", f"{type(e).__name__}: {e}"[:300]))
            continue
        losses = [s["loss"] for s in rec.get("steps", [])]
        out.append(("ok", losses[-1] if losses else None))
    return out


def test_natural_memories():
    assert matrix.natural_memory("topk") == "residual"
    assert matrix.natural_memory("dgc") == "dgc" and matrix.natural_memory("powersgd") == "powersgd"
    assert matrix.natural_memory("qsgd") == "none" and matrix.natural_memory("fp16") == "none"
    assert matrix.natural_memory("countsketch") == "residual"


def test_refused_cells_name_alternatives():
    rows = matrix.cells(["bsp", "dpsgd"], ["none", "topk"], workers=4)
    refused = [r for r in rows if r["refused"]]
    assert {(r["algorithm"], r["architecture"]) for r in rows if not r["refused"]} >= {("bsp", "allreduce"),
                                                                                       ("dpsgd", "gossip")}
    assert all("one of" in r["refused"] or "valid" in r["refused"] for r in refused)
    md = matrix.markdown(rows)
    assert md.count("\n") == len(rows) + 2


def test_every_valid_cell_constructs_and_steps(pool4):
    rows = [r for r in matrix.cells(workers=4) if not r["refused"]]
    assert len(rows) > 100
    failures = []
    for servers in (0, 1):
        todo = [r for r in rows if r["servers"] == servers]
        for r in todo:
            r["workers"] = 4 - servers
        res = pool4.run(smoke_worker, todo, timeout=600)
        for i, cell in enumerate(todo):
            got = [rank_out[i] for rank_out in res]
            name = f"{cell['algorithm']}/{cell['architecture']}/{cell['compressor']}"
            kinds = {g[0] for g in got}
            if "refused" in kinds:      # refusals belong to construction (TrainConfig.validate), before launch
                failures.append((name, "refused only in the workers", got[0][1]))
                continue
            if kinds != {"ok"}:
                failures.append((name, got))
                continue
            loss = [g[1] for g in got if g[1] is not None]
            if not loss or not all(math.isfinite(x) for x in loss):
                failures.append((name, loss))
    assert not failures, failures
