"""Sparse collectives (gtopk, shared, hierarchical) across real gloo workers (2, 3 and 4: any n, not only powers
of two): identical results on every rank, gTop-k with k = d equals the dense all-reduce, nothing lost
(Σ sent + Σ residuals = Σ inputs), bytes counted."""
from __future__ import annotations

import pytest
import torch

from thinwire.errors import UserError

COLLECTIVES = ("gtopk", "shared", "hierarchical")


def _inputs(rank, d=4000, step=0):
    return torch.randn(d, generator=torch.Generator().manual_seed(100 * rank + step + 1))


def collectives_worker(rank, world_size):
    import torch.distributed as dist

    from thinwire.comm import Transport
    from thinwire.compress import compressors, memories
    from thinwire.exchange import Exchange

    tr = Transport()
    out = {}
    # gTop-k with k = d (ratio 1) is the dense all-reduce (the mean, as every exchange returns)
    x = _inputs(rank)
    dense = x.clone()
    dist.all_reduce(dense)
    ex = Exchange(tr, compressors.get("topk", ratio=1.0), "none", sparse_collective="gtopk")
    out["gtopk_dense_err"] = float((ex.aggregate(x, "a") - dense / world_size).abs().max())

    for name in COLLECTIVES:
        for comp_name, params in (("topk", {"ratio": 0.05}), ("stc", {"ratio": 0.05}),
                                  ("topk+golomb", {"ratio": 0.02})):
            comp = compressors.get(comp_name, **params)
            mem = memories.get("residual")
            ex = Exchange(tr, comp, mem, sparse_collective=name)
            before = tr.meter.totals()["bytes_sent"]
            inputs_sum, results = torch.zeros(4000), []
            for step in range(2):
                g = _inputs(rank, step=step)
                inputs_sum += g
                results.append(ex.aggregate(g, "w"))        # the mean over ranks of what was sent
            resid = mem.residuals["w"].clone()
            # nothing lost: Σ_steps (mean · n) + Σ_ranks residual = Σ_ranks Σ_steps inputs
            agg_total = torch.stack(results).sum(0) * world_size
            total_res = resid.clone()
            dist.all_reduce(total_res)
            total_in = inputs_sum.clone()
            dist.all_reduce(total_in)
            gathered = [torch.zeros(4000 * 2) for _ in range(world_size)]
            dist.all_gather(gathered, torch.cat(results))
            out[(name, comp_name)] = {
                "identical": all(torch.equal(gathered[0], gr) for gr in gathered),
                "lost": float((agg_total + total_res - total_in).abs().max()),
                "nnz": int((results[0] != 0).sum()),
                "bytes": tr.meter.totals()["bytes_sent"] - before,
            }
    # coded payloads over the all-gather: the same mean as the uncoded compressor, fewer bytes on the wire
    for coded, plain, kw in (("qsgd+elias", "qsgd", {"collective": "allgather"}), ("topk+golomb", "topk", {})):
        x = _inputs(rank, d=20000)
        b0 = tr.meter.totals()["bytes_sent"]
        a = Exchange(tr, compressors.get(coded, seed=3), "none").aggregate(x, "c")
        b1 = tr.meter.totals()["bytes_sent"]
        b = Exchange(tr, compressors.get(plain, seed=3), "none", **kw).aggregate(x, "c")
        b2 = tr.meter.totals()["bytes_sent"]
        out[coded] = (torch.equal(a, b), b1 - b0, b2 - b1)
    try:
        Exchange(tr, compressors.get("qsgd"), "none", sparse_collective="gtopk")
        out["dense_error"] = None
    except UserError as e:
        out["dense_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def pool3():
    """3 ranks: gTop-k folds rank 2 into rank 0; hierarchical runs groups {0, 1} and {2}."""
    from conftest import LazyPool
    pool = LazyPool(3)
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sparse_collectives(world, pool2, pool3, pool4):
    res = {2: pool2, 3: pool3, 4: pool4}[world].run(collectives_worker)
    for r in res:
        assert r["gtopk_dense_err"] < 1e-5
        assert "top-k-family" in r["dense_error"]
        for coded in ("qsgd+elias", "topk+golomb"):
            same, coded_bytes, plain_bytes = r[coded]
            assert same and coded_bytes < plain_bytes, (coded, r[coded])
        for name in COLLECTIVES:
            for comp in ("topk", "stc", "topk+golomb"):
                got = r[(name, comp)]
                assert got["identical"], (name, comp)
                assert got["lost"] < 1e-3, (name, comp, got)
                assert got["bytes"] > 0
    d, k = 4000, int(0.05 * 4000)
    for name in ("gtopk", "shared"):      # re-selected / shared: exactly k coordinates, whatever the world
        assert res[0][(name, "topk")]["nnz"] == k, name
    if world == 3:   # the extra rank only folds its set in (one set per step); its partner also returns the result
        assert res[2][("gtopk", "topk")]["bytes"] < res[0][("gtopk", "topk")]["bytes"]
    # gTop-k's traffic stays O(k log n): below what an all-gather of n·k pairs would move at 4 ranks
    if world == 4:
        assert res[0][("gtopk", "topk")]["bytes"] < 3 * 3 * k * 8 + 3 * 400


def test_unknown_sparse_collective_is_a_user_error():
    from thinwire.compress import compressors
    from thinwire.exchange.exchange import check_collectives
    from thinwire.trainer import build_components
    with pytest.raises(UserError, match="valid: allgather, gtopk, shared, hierarchical"):
        check_collectives(compressors.get("topk"), sparse_collective="ring")
    with pytest.raises(UserError, match="valid: allgather, gtopk, shared, hierarchical"):
        build_components("bsp", "topk", sparse_collective="ring")      # the Trainer's check, before any worker
    with pytest.raises(UserError, match="cannot use collective 'allreduce'; valid: allgather"):
        check_collectives(compressors.get("topk"), "allreduce", "gtopk")   # (what a sparse collective replaces)


def test_the_exchange_takes_the_sparse_collective_and_the_compressor_refuses_it_in_one_line():
    from thinwire.compress import compressors
    from thinwire.trainer import build_components
    assert build_components("bsp", "topk", "residual", sparse_collective="gtopk")[5] == {"sparse_collective": "gtopk"}
    assert build_components("bsp", "int8", collective="allreduce")[5] == {"collective": "allreduce"}
    for name in ("topk", "topk+golomb", "dgc", "threshold"):
        with pytest.raises(UserError) as err:
            compressors.get(name, sparse_collective="gtopk")
        assert str(err.value) == (f"compressor {name!r} no longer takes sparse_collective: it is the exchange's "
                                  f"parameter — pass sparse_collective=... to the Trainer / --sparse-collective")
    for name in ("int8", "qsgd", "terngrad"):
        with pytest.raises(UserError) as err:
            compressors.get(name, aggregation="allgather")
        assert str(err.value) == (f"compressor {name!r} no longer takes aggregation: the collective is the exchange's "
                                  f"parameter — pass collective=... to the Trainer / --collective")
    with pytest.raises(UserError, match="^compressor 'qsgd' no longer takes aggregation: .* --collective$"):
        build_components("bsp", "qsgd", aggregation="allgather")        # through the Trainer's routing too


@pytest.mark.slow
def test_train_topk_gtopk_digits(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "digits-mlp", "--workers", "3",
                        "--compressor", "topk", "--ratio", "0.05", "--memory", "residual",
                        "--sparse-collective", "gtopk", "--epochs", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.8, summary


def test_survival_mask_bits_round_trip():
    from thinwire.exchange.sparse import pack_bits, unpack_bits
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 1000):
        mask = torch.rand(n, generator=g) < 0.3
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        assert torch.equal(unpack_bits(packed, n), mask)


def test_bench_coding_writes_its_rows_and_plot(tmp_path, capsys):
    """`thinwire bench coding --out DIR` writes coding.json and the plot of the measured collectives."""
    import json

    from thinwire.cli import main
    assert main(["bench", "coding", "--workers", "2", "--networks", "cluster", "--densities", "0.01",
                 "--numel", "4096", "--steps", "1", "--qsgd-numel", "4096", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "coding.json").read_text())["collectives"]
    assert {r["collective"] for r in rows} == {"allgather", "gtopk", "shared", "hierarchical"}
    assert all(r["bytes_per_step"] > 0 for r in rows), rows
    assert (tmp_path / "coding.png").stat().st_size > 0
