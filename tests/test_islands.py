"""Two-tier networks (`islands:AxB,inside=...,across=...`, or islands of different sizes `islands:A+B,...`): the spec,
and every message charged on the link it crosses — a collective on its group's path, a point-to-point message on the
link between its two ranks, each on that link's queue — with the bytes over the thin link metered apart."""
from __future__ import annotations

import pytest
import torch

from thinwire.errors import UserError
from thinwire.net import Islands, Link, p2p, parse_network, ring_allreduce

NET = "islands:2x2,inside=10gbit@1ms,across=50mbit@40ms"


def test_the_spec_and_the_paths():
    n = parse_network("islands:2x2,inside=dc,across=world")
    assert isinstance(n, Islands) and isinstance(n, Link) and n.workers == 4
    assert (n.bandwidth, n.latency) == (50e6, 0.15) and n.across.name == "world" and n.inside.name == "dc"
    assert n.path([0, 1]) == n.inside and n.path([2, 3]) == n.inside and n.path([0, 2]) == n.across
    assert n.between(1, 0) == n.inside and n.between(1, 2) == n.across and n.crosses(0, 3)
    # a ring 0 → 1 → 2 → 3 → 0 crosses the thin link at 1 → 2 and 3 → 0
    assert [n.ring_crossing([0, 1, 2, 3], i) for i in range(4)] == [False, True, False, True]
    assert [n.ring_crossing([0, 2], i) for i in range(2)] == [True, True]
    # a binomial tree from 0 sends 0 → 1, 2 and 1 → 3: 0 → 2 and 1 → 3 cross; from 2: 2 → 3, 0 and 3 → 1
    assert [n.tree_crossings([0, 1, 2, 3], i, 0) for i in range(4)] == [1, 1, 0, 0]
    assert [n.tree_crossings([0, 1, 2, 3], i, 2) for i in range(4)] == [0, 0, 1, 1]
    h = n.handshaking()
    assert h.latency == 0.3 and h.inside.latency == pytest.approx(1e-4) and h.islands == 2
    custom = parse_network("islands:3x1,across=10mbit@100ms")      # inside: dc by default
    assert (custom.bandwidth, custom.latency, custom.inside.name, custom.workers) == (10e6, 0.1, "dc", 3)
    assert parse_network("home").bandwidth == 10e6 and parse_network("home").latency == 0.1
    with pytest.raises(UserError, match="3 islands of 1 workers = 3"):
        custom.check_workers(4)
    from thinwire.cli.compare import _networks       # compare --network: a two-tier spec keeps its commas
    assert _networks("dc,islands:2x2,inside=dc,across=world,home") == ["dc", "islands:2x2,inside=dc,across=world",
                                                                       "home"]


def test_islands_of_different_sizes():
    """`islands:2+4`: ranks 0-1 island 0, ranks 2-5 island 1; `size` the largest; AxB is B, A times."""
    n = parse_network("islands:2+4,inside=dc,across=world")
    assert (n.islands, n.size, n.sizes, n.workers, n.equal) == (2, 4, (2, 4), 6, False)
    assert n.name == "islands:2+4,inside=dc,across=world" and n.inside.name == "dc" and n.across.name == "world"
    assert [n.island(r) for r in range(6)] == [0, 0, 1, 1, 1, 1] and list(n.ranks(1)) == [2, 3, 4, 5]
    assert n.path([0, 1]) == n.inside and n.path([2, 5]) == n.inside and n.path([1, 2]) == n.across
    assert n.between(3, 4) == n.inside and n.between(0, 5) == n.across
    # a ring 0 → ... → 5 → 0 crosses the thin link at 1 → 2 and 5 → 0
    assert [n.ring_crossing(list(range(6)), i) for i in range(6)] == [False, True, False, False, False, True]
    assert n.handshaking().sizes == (2, 4) and n.to_dict()["sizes"] == (2, 4)
    three = parse_network("islands:3+1+2")
    assert three.sizes == (3, 1, 2) and [three.island(r) for r in range(6)] == [0, 0, 0, 1, 2, 2]
    eq = parse_network("islands:2x3")
    assert eq.sizes == (3, 3) and eq.equal and "sizes" not in eq.to_dict()
    with pytest.raises(UserError, match="islands of 2\\+4 workers = 6; --workers is 4"):
        n.check_workers(4)
    # refused before any worker starts, in one line
    from thinwire.run.train import TrainConfig
    with pytest.raises(UserError, match="2\\+4 workers = 6") as e:
        TrainConfig(workload="digits-mlp", algorithm="diloco", workers=4, network="islands:2+4").validate()
    assert "\n" not in str(e.value)


def test_the_planner_on_islands_of_different_sizes():
    """Hierarchical DiLoCo's sync: the smallest island's workers carry the largest shards across (2+4 sends as
    2x2 does); an inner step waits for the largest island's all-reduce (2+4 as 2x4)."""
    from thinwire.plan.costmodel import Scenario
    from thinwire.plan.diloco import fragment_sync, inside_step_s, plan_diloco
    uneven, small, large = (parse_network(f"islands:{s},inside=dc,across=world") for s in ("2+4", "2x2", "2x4"))
    s = Scenario(params=1e6, compute_s=0.1, link=uneven, workers=6)
    assert fragment_sync(s, "none", "gloo", 1, uneven) == fragment_sync(s, "none", "gloo", 1, small)
    assert inside_step_s(s, uneven) == inside_step_s(s, large) > inside_step_s(s, small)
    p = plan_diloco(s, uneven)
    assert p.replicas == "island" and p.iteration_s > 0


@pytest.mark.parametrize("spec", ["islands:", "islands:2", "islands:2x", "islands:0x2", "islands:2x2,inside=moon",
                                  "islands:2x2,over=dc", "islands:2x2,across=10mbit", "islands:2x2,across=x@1ms",
                                  "islands:4", "islands:2+", "islands:+2", "islands:2+0", "islands:2+x",
                                  "islands:2+2x2", "islands:2+4,inside=moon"])
def test_bad_island_specs(spec):
    with pytest.raises(UserError):
        parse_network(spec)


def _charged(rank, world_size):
    """Ops on the world group, on this rank's island and across: which link each was charged on, its cost, and
    the bytes metered as crossing the thin link."""
    import torch.distributed as dist

    from thinwire.comm import Transport, subgroup
    t = Transport()
    groups = {ranks: subgroup(ranks) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}   # every rank, in this order
    island = t.sub(groups[(0, 1) if rank < 2 else (2, 3)])
    column = t.sub(groups[(0, 2) if rank % 2 == 0 else (1, 3)])
    out = {"paths": (t.path.name, island.path.name, column.path.name),
           "shared": island.clock is t.clocks["inside"] and column.clock is t.clock}
    x = torch.ones(250)                                 # 1000 bytes
    for name, tp in (("world", t), ("island", island), ("column", column)):
        before = tp.meter.totals()
        h = tp.all_reduce(x.clone(), async_op=True)
        h.wait()
        after = tp.meter.totals()
        out[name] = {"link": h.clock.link.name, "cost": h.cost,
                     "across": after["bytes_across"] - before["bytes_across"],
                     "sent": after["bytes_sent"] - before["bytes_sent"]}
    # point to point: rank 0 to 1 (inside) and to 2 (across); 3 sends nothing
    sends = {}
    if rank == 0:
        for peer in (1, 2):
            before = t.meter.totals()["bytes_across"]
            h = t.isend(torch.ones(100), peer)
            h.wait()
            sends[peer] = (h.clock.link.name, h.cost, t.meter.totals()["bytes_across"] - before)
    elif rank in (1, 2):
        buf = torch.empty(100)
        h = t.irecv(buf, 0)
        h.wait()
        sends[rank] = (h.clock.link.name, h.cost, bool(torch.equal(buf, torch.ones(100))))
    out["p2p"] = sends
    dist.barrier()
    return out


def test_every_message_is_charged_on_the_link_it_crosses(pool4):
    net = parse_network(NET)
    inside, across = net.inside.handshaking(), net.across.handshaking()
    out = pool4.run(_charged, network=NET, timeout=120)
    for rank, o in enumerate(out):
        assert o["paths"] == (net.across.name, net.inside.name, net.across.name) and o["shared"]
        # the world's ring steps at the thin link's pace; this rank's bytes cross it when its neighbour is away
        assert o["world"]["link"] == net.across.name
        assert o["world"]["cost"] == ring_allreduce(across, 4, 1000)
        assert o["world"]["across"] == (o["world"]["sent"] if rank in (1, 3) else 0.0)
        assert o["world"]["sent"] == pytest.approx(1500)
        assert o["island"]["link"] == net.inside.name and o["island"]["cost"] == ring_allreduce(inside, 2, 1000)
        assert o["island"]["across"] == 0.0 and o["island"]["sent"] == 1000
        assert o["column"]["link"] == net.across.name and o["column"]["across"] == o["column"]["sent"] == 1000
    sent = out[0]["p2p"]
    assert sent[1][0] == net.inside.name and sent[1][1].latency == net.inside.latency and sent[1][2] == 0.0
    assert sent[2][0] == net.across.name and sent[2][1].latency == p2p(net.across, 400).latency
    assert sent[2][1].transfer == pytest.approx(p2p(net.across, 400).transfer)
    assert sent[2][2] == 400
    assert out[1]["p2p"][1][0] == net.inside.name and out[2]["p2p"][2][0] == net.across.name
    assert out[1]["p2p"][1][2] and out[2]["p2p"][2][2]


def test_the_peers_face_the_same_two_tier_network(pool4):
    """PyTorch's DDP on islands: its all-reduce of the whole world crosses the thin link at the ring's two
    crossings (workers 1 and 3), charged and counted like thinwire's (bytes across apart)."""
    from thinwire.compare.peers import find, resolve
    from thinwire.run.train import TrainConfig, train_worker
    net = "islands:2x2,inside=lan,across=lan"      # (the bytes only: unemulated)
    cfg = resolve(TrainConfig(workload="digits-mlp", algorithm="ddp", workers=4, steps=2, eval_every=2,
                              progress=False, network=net)).validate()
    out = pool4.run(train_worker, cfg, network=net)
    totals = [r["meter"]["total"] for r in out]
    assert all(t["bytes_sent"] > 0 for t in totals)
    assert [t["bytes_across"] for t in totals] == [0.0, totals[1]["bytes_sent"], 0.0, totals[3]["bytes_sent"]]
    if find("torchft-diloco").missing() is None:    # torchft's DiLoCo: its quorum's ring, the same crossings
        cfg = resolve(TrainConfig(workload="digits-mlp", algorithm="torchft-diloco", workers=4, steps=2, eval_every=2,
                                  progress=False, network=net, params={"period": 1})).validate()
        totals = [r["meter"]["total"] for r in pool4.run(train_worker, cfg, network=net)]
        assert all(t["bytes_sent"] > 0 for t in totals)
        assert [t["bytes_across"] for t in totals] == [0.0, totals[1]["bytes_sent"], 0.0, totals[3]["bytes_sent"]]
    with pytest.raises(UserError, match="2 islands of 2 workers"):
        resolve(TrainConfig(workload="digits-mlp", algorithm="ddp", workers=2, network=NET)).validate()
