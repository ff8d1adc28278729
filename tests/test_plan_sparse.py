"""The planner chooses among sparse collectives (single process, pure logic): `thinwire advise` gives every
sparsifier a row per collective, with the α-β costs of net/cost.py written out here by hand."""
from __future__ import annotations

import json
import math

import pytest

from thinwire.cli import main
from thinwire.net import parse_network
from thinwire.net.cost import gtopk_allreduce, hierarchical_topk, sparse_collective, sparse_group_size
from thinwire.plan.advise import advise
from thinwire.plan.costmodel import Scenario, predict

PARAMS = 25e6            # > 2^15 elements: topk's payload is int32 index + fp32 value = 8 bytes per kept element


def _rows(s: Scenario, label: str) -> dict:
    return {a.prediction.collective: a.prediction for a in advise(s) if a.label == label}


def _topk_bsp(s: Scenario, comm_s: float) -> float:
    """bsp iteration: τ + compress time + exchange (Tang et al. 2020, arXiv 2003.06307, §III-A, no overlap)."""
    return s.compute_s + s.compress_s("topk") + comm_s


def test_gtopk_beats_allgather_on_many_workers_high_latency():
    link = parse_network("wan")                              # α = 50 ms, 100 Mbit/s: β = 8e-8 s/byte
    s = Scenario(params=PARAMS, compute_s=0.1, link=link, workers=64)
    rows = _rows(s, "bsp + topk(1%) + EF")
    assert set(rows) == {"allgather", "gtopk", "shared", "hierarchical"}
    k = 250_000                                                 # 1 % of 25e6
    a, b = link.alpha, link.beta
    allgather = 63 * a + 63 * 8 * k * b                         # ring all-gather of 64 payloads of 8k bytes
    gtopk = 2 * 6 * a + 2 * 6 * 8 * k * b                       # Tang et al. §VI-B: 2α log n + 4kβ log n (4-byte words)
    assert allgather == pytest.approx(3.15 + 10.08) and gtopk == pytest.approx(0.6 + 1.92)
    assert rows["allgather"].iteration_s == pytest.approx(_topk_bsp(s, allgather))
    assert rows["gtopk"].iteration_s == pytest.approx(_topk_bsp(s, gtopk))
    assert rows["gtopk"].iteration_s < rows["allgather"].iteration_s
    assert rows["gtopk"].bytes_per_step == pytest.approx(6 * 8 * k)   # log2 64 rounds of k pairs
    ranked = [a.prediction.collective for a in advise(s) if a.label == "bsp + topk(1%) + EF"]
    assert ranked[0] == "gtopk"                                 # the fastest topk row is the gTop-k one


def test_allgather_not_worse_on_two_workers():
    link = parse_network("cluster")
    s = Scenario(params=PARAMS, compute_s=0.1, link=link, workers=2)
    rows = _rows(s, "bsp + topk(1%) + EF")
    k, a, b = 250_000, link.alpha, link.beta
    allgather, gtopk = a + 8 * k * b, 2 * a + 2 * 8 * k * b    # n = 2: one ring step vs one swap round
    assert rows["allgather"].iteration_s == pytest.approx(_topk_bsp(s, allgather))
    assert rows["gtopk"].iteration_s == pytest.approx(_topk_bsp(s, gtopk))
    assert rows["allgather"].iteration_s <= rows["gtopk"].iteration_s
    # hierarchical at 2 ranks is groups of 1: exactly the all-gather
    assert rows["hierarchical"].iteration_s == pytest.approx(rows["allgather"].iteration_s)


def test_non_sparsifiers_keep_their_one_collective():
    s = Scenario(params=1e6, compute_s=0.1, link=parse_network("wan"), workers=8)
    by_label: dict = {}
    for a in advise(s):
        by_label.setdefault(a.label, []).append(a.prediction.collective)
    assert by_label["bsp"] == ["ring"] and by_label["bsp + randomk(1%) + EF"] == ["ring"]
    assert by_label["asp (1 server)"] == ["ps"] and by_label["dpsgd ring"] == ["gossip"]
    for label in ("bsp + topk(1%) + EF", "bsp + dgc(0.1%) + EF", "bsp + gaussiank(1%) + EF"):
        assert sorted(by_label[label]) == ["allgather", "gtopk", "hierarchical", "shared"], label
    # predict() takes the sparse collective as a parameter, and ignores it for a compressor it cannot apply to
    assert predict(s, "bsp", "topk", ratio=0.01, sparse_collective="gtopk").collective == "gtopk"
    assert predict(s, "bsp", "qsgd", sparse_collective="gtopk").collective == "ring"


def test_gtopk_cost_any_n():
    link = parse_network("wan")
    a, b, k, pair = link.alpha, link.beta, 1000, 8
    for n, rounds in ((2, 1), (4, 2), (8, 3)):                 # powers of two: unchanged
        c = gtopk_allreduce(link, n, k, pair)
        assert c.time == pytest.approx(rounds * (2 * a + 2 * k * pair * b))
    # n = 3, 5, 6, 7: fold into p = 2^⌊log2 n⌋ (2 messages), log2 p rounds, result + ⌈k/8⌉-byte mask back (2)
    for n, p in ((3, 2), (5, 4), (6, 4), (7, 4)):
        r = int(math.log2(p))
        c = gtopk_allreduce(link, n, k, pair)
        assert c.latency == pytest.approx((4 + 2 * r) * a)
        assert c.transfer == pytest.approx(((2 + 2 * r) * k * pair + 125) * b)
        assert c.sent == (r + 1) * k * pair + 125 and c.received == (r + 1) * k * pair
    assert sparse_collective("gtopk", link, 3, k, 10_000) == gtopk_allreduce(link, 3, k)


def test_hierarchical_groups_any_n():
    assert [sparse_group_size(n) for n in range(2, 13)] == [1, 2, 2, 3, 2, 3, 2, 3, 2, 4, 3]
    link = parse_network("cluster")
    # 3 ranks: groups {0, 1} and {2}: ring all-reduce of the dense tensor among 2, all-gather between the 2 leaders,
    # one broadcast round of the 2 gathered sets inside a group of 2
    k, numel, a, b = 100, 10_000, link.alpha, link.beta
    c = hierarchical_topk(link, 3, k, numel)
    expect = (2 * a + numel * 4 * b) + (a + k * 8 * b) + (a + 2 * k * 8 * b)
    assert c.time == pytest.approx(expect)


def test_advise_json_names_the_collective(capsys):
    assert main(["advise", "--params", "25e6", "--compute-ms", "100", "--network", "wan", "--workers", "32",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranking"]
    assert all("collective" in r for r in rows)
    topk = [r for r in rows if r["config"] == "bsp + topk(1%) + EF"]
    assert [r["collective"] for r in topk][0] == "gtopk" and len(topk) == 4
    assert main(["advise", "--params", "25e6", "--workers", "32"]) == 0
    out = capsys.readouterr().out
    assert "collective" in out.splitlines()[1] and " gtopk " in out
