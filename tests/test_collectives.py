"""All-reduce algorithms on point-to-point (thinwire.comm.collectives): equal to gloo's, identical on every rank,
bytes and emulated time as their α-β formulas, the same trained model as gloo's."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.collectives import ALGORITHMS, parse
from thinwire.errors import UserError
from thinwire.net import parse_network
from thinwire.net.cost import (ALLREDUCE, grid_shape, hierarchical_allreduce, ring_allreduce, torus_allreduce,
                               tree_allreduce)

P2P = [a for a in ALGORITHMS if a != "gloo"]


def test_parse_validates_names_and_shapes():
    assert parse("ring", 4) == ("ring", None)
    assert parse("torus:2", 4) == ("torus", 2)
    assert parse("hierarchical:3", 6) == ("hierarchical", 3)
    for bad, n in [("butterfly", 4), ("torus:3", 4), ("ring:2", 4), ("hierarchical:x", 4), ("torus:0", 4)]:
        with pytest.raises(UserError) as e:
            parse(bad, n)
        assert "valid" in str(e.value) or "expected" in str(e.value)


def test_cost_formulas_of_hierarchical_and_torus():
    link = parse_network("custom:bandwidth=100mbit,latency=10ms")
    a, b, N = link.alpha, link.beta, 1e6
    assert grid_shape(4) == (2, 2) and grid_shape(6) == (3, 2) and grid_shape(7) == (7, 1)
    # hierarchical on 8 = 4 groups of 2: 2·1·(α + Nβ) + 2·3·α + 2·3/4·Nβ
    assert hierarchical_allreduce(link, 8, N, 2).time == pytest.approx(2 * (a + N * b) + 6 * a + 1.5 * N * b)
    # torus 4×2: 2·3α + 2·1α + 2·3/4 Nβ + 2·1/2 (N/4)β
    assert torus_allreduce(link, 8, N, 4).time == pytest.approx(8 * a + 1.5 * N * b + 0.25 * N * b)
    assert torus_allreduce(link, 8, N, 8).time == pytest.approx(ring_allreduce(link, 8, N).time)
    assert set(P2P) == set(ALLREDUCE)
    # recursive halving (Rabenseifner) on 8: 2·3α + 2·7/8 Nβ; on 6 the 2 extra ranks fold in and out: + 2(α + Nβ)
    assert ALLREDUCE["recursive_halving"](link, 8, N).time == pytest.approx(6 * a + 1.75 * N * b)
    assert ALLREDUCE["recursive_halving"](link, 6, N).time == pytest.approx(4 * a + 1.5 * N * b + 2 * (a + N * b))
    # double binary tree on 8 (height 3), 4 blocks per half: 2·3α + 2·(4 + 2)/4 Nβ
    assert ALLREDUCE["double_binary_tree"](link, 8, N, blocks=4).time == pytest.approx(6 * a + 3 * N * b)
    from thinwire.plan.costmodel import COLLECTIVES
    assert all(COLLECTIVES[name] is ALLREDUCE[name] for name in P2P)   # the planner costs what runs


def test_double_binary_trees_are_complementary():
    from thinwire.comm.collectives import double_trees
    for n in range(2, 20):
        trees = double_trees(n)
        inner = [{i for i, (_, kids) in enumerate(t) if kids} for t in trees]
        assert not inner[0] & inner[1], n              # an inner node of one tree is a leaf of the other
        for t in trees:
            roots = [i for i, (parent, _) in enumerate(t) if parent is None]
            assert len(roots) == 1 and all(len(kids) <= 2 for _, kids in t)
            depth = {roots[0]: 0}
            todo = [roots[0]]
            while todo:
                i = todo.pop()
                for c in t[i][1]:
                    assert t[c][0] == i
                    depth[c] = depth[i] + 1
                    todo.append(c)
            assert len(depth) == n and max(depth.values()) == n.bit_length() - 1   # height ⌊log2 n⌋


def _equal_to_gloo(rank, n):
    from thinwire.comm import Transport
    out = []
    for algo in P2P:
        tp = Transport(allreduce=algo)
        for size, dtype in [(1, torch.float32), (3, torch.float64), (1001, torch.float32), (4096, torch.float64)]:
            for op, red in [("sum", dist.ReduceOp.SUM), ("mean", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)]:
                g = torch.Generator().manual_seed(1000 * rank + size)
                x = torch.randn(size, generator=g, dtype=dtype)
                ref = x.clone()
                dist.all_reduce(ref, op=red)
                if op == "mean":
                    ref /= n
                y = x.clone().reshape(-1, 1) if size > 1 else x.clone()
                h = tp.all_reduce(y, op=op, async_op=True)
                y = h.wait().reshape(-1)
                every = [torch.empty_like(y) for _ in range(n)]
                dist.all_gather(every, y)
                out.append((algo, size, op, torch.allclose(y, ref, rtol=1e-5, atol=1e-5),
                            all(torch.equal(every[0], e) for e in every)))
        # bytes on the wire: the ring sends 2(n-1)/n of the payload (size divisible by n)
        if algo == "ring":
            before = tp.meter.bytes_sent
            tp.all_reduce(torch.ones(n * 100))
            out.append(("ring bytes", tp.meter.bytes_sent - before, 2 * (n - 1) / n * n * 100 * 4))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_algorithm_equals_gloo(n, pool2, pool4):
    pool = pool2 if n == 2 else pool4
    results = pool.run(_equal_to_gloo)
    for rank_result in results:
        for row in rank_result:
            if row[0] == "ring bytes":
                assert row[1] == pytest.approx(row[2])
            else:
                algo, size, op, close, same = row
                assert close, f"{algo} {op} size {size} differs from gloo on {n} ranks"
                assert same, f"{algo} {op} size {size} not identical on every rank"


def _odd_world(rank, n):
    """3 of the 4 ranks in a subgroup: non-powers of two."""
    from thinwire.comm import Transport
    g = dist.new_group([0, 1, 2])
    if rank == 3:
        return None
    out = []
    for algo in ["ring", "recursive_doubling", "recursive_halving", "tree", "double_binary_tree", "torus",
                 "hierarchical:3"]:
        tp = Transport(group=g, allreduce=algo)
        x = torch.arange(7, dtype=torch.float64) * (rank + 1)
        tp.all_reduce(x)
        out.append((algo, torch.equal(x, torch.arange(7, dtype=torch.float64) * 6)))
    try:
        Transport(group=g, allreduce="hierarchical:2")
        out.append(("hierarchical:2 rejected", False))
    except UserError:
        out.append(("hierarchical:2 rejected", True))
    return out


def test_non_power_of_two_world(pool4):
    for rank_result in pool4.run(_odd_world)[:3]:
        for algo, ok in rank_result:
            assert ok, algo


def _timed(rank, n):
    from thinwire.comm import Transport
    tp = Transport(network="custom:bandwidth=100mbit,latency=50ms")
    out = {}
    for algo in P2P:
        tp.allreduce = algo
        x = torch.randn(100_000)
        dist.barrier()
        t0 = time.perf_counter()
        tp.all_reduce(x)
        d = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(d, op=dist.ReduceOp.MAX)  # the last rank to finish: the critical path
        out[algo] = float(d)
    return out


def test_emulated_time_follows_its_formula(pool4):
    measured = pool4.run(_timed)[0]
    link = parse_network("custom:bandwidth=100mbit,latency=50ms")
    for algo, t in measured.items():
        want = ALLREDUCE[algo](link, 4, 400_000).time
        # never faster than the formula; the upper bound leaves room for a loaded machine
        assert 0.85 * want <= t <= 2.0 * want + 0.1, f"{algo}: {t:.3f} s, formula {want:.3f} s"
    # the formulas really differ, so the check tells the algorithms apart
    assert tree_allreduce(link, 4, 400_000).time > 1.2 * ALLREDUCE["recursive_doubling"](link, 4, 400_000).time


def _train_linreg(rank, n, how):
    from thinwire import Trainer
    from thinwire.comm import Transport
    from thinwire.run import workloads
    wl = workloads.get("linreg")
    model = wl.model(0)
    x, y = wl.shard(rank, n)
    loader = workloads.ShardLoader(x, y, 16, seed=0, rank=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if how.startswith("localsgd:"):  # the CLI path: an algorithm parameter
        trainer = Trainer(model, opt, algorithm="localsgd", period=1, allreduce=how.split(":", 1)[1])
    elif how.startswith("bsp:"):
        trainer = Trainer(model, opt, algorithm="bsp", allreduce=how.split(":", 1)[1])
    else:
        trainer = Trainer(model, opt, algorithm="bsp", transport=Transport(allreduce=how))
    for _ in range(15):
        xb, yb = loader.next()
        wl.loss(model(xb), yb).backward()
        trainer.step()
        opt.zero_grad()
    trainer.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), trainer.transport.allreduce


def _all_trained(rank, n):
    return {how: _train_linreg(rank, n, how) for how in ["gloo", *P2P, "localsgd:torus", "bsp:recursive_doubling"]}


def test_every_algorithm_trains_the_same_model(pool4):
    results = pool4.run(_all_trained)
    ref = results[0]["gloo"][0]
    assert ref.dtype == torch.float64
    for rank_result in results:
        for how, (params, used) in rank_result.items():
            assert used == how.split(":")[-1]
            assert torch.allclose(params, ref, rtol=1e-10, atol=1e-12), how
