"""The Transport: results, bytes counted under the algorithm that runs, and network emulation."""
from __future__ import annotations

import time

import pytest
import torch

from thinwire.comm import Transport
from thinwire.net import Link, parse_network, ring_allgather, ring_allreduce


def _ops(rank, world_size):
    t = Transport()
    out = {}
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    t.all_reduce(x, op="mean")
    out["mean_ok"] = torch.allclose(x, torch.arange(1000, dtype=torch.float32) * (world_size + 1) / 2)
    out["allreduce_sent"] = t.meter.by_kind["all_reduce"]["bytes_sent"]
    # uneven all-gather: rank r contributes r + 1 elements
    mine = torch.full((rank + 1,), float(rank))
    got = t.all_gather(mine)
    out["gather_ok"] = all(torch.equal(g, torch.full((r + 1,), float(r))) for r, g in enumerate(got))
    known = t.all_gather(torch.ones(3) * rank, sizes=[3] * world_size, async_op=True).wait()
    out["known_ok"] = all(torch.equal(k, torch.ones(3) * r) for r, k in enumerate(known))
    out["gather_sent"] = t.meter.by_kind["all_gather"]["bytes_sent"]
    b = torch.full((10,), float(rank))
    t.broadcast(b, src=1)
    out["bcast_ok"] = torch.equal(b, torch.full((10,), 1.0))
    # ring of point-to-point messages
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    buf = torch.empty(100)
    h = t.irecv(buf, prv)
    t.send(torch.full((100,), float(rank)), nxt)
    h.wait()
    out["p2p_ok"] = torch.equal(buf, torch.full((100,), float(prv)))
    out["send_sent"] = t.meter.by_kind["send"]["bytes_sent"]
    out["recv_recv"] = t.meter.by_kind["recv"]["bytes_recv"]
    return out


def test_ops_results_and_bytes(pool4):
    n = 4
    for out in pool4.run(_ops):
        assert out["mean_ok"] and out["gather_ok"] and out["known_ok"] and out["bcast_ok"] and out["p2p_ok"]
        assert out["allreduce_sent"] == pytest.approx(2 * (n - 1) / n * 4000)
        # padded to the largest block (4 floats) + the size exchange (one int64 per rank), then 3-float blocks
        lan = parse_network("lan")
        expect = ring_allgather(lan, n, 16).sent + ring_allgather(lan, n, 8).sent + ring_allgather(lan, n, 12).sent
        assert out["gather_sent"] == pytest.approx(expect)
        assert out["send_sent"] == 400 and out["recv_recv"] == 400


def _busy(seconds: float) -> None:
    """Real compute (not sleep) for about `seconds`."""
    a = torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a * 1e-3)


def _emulated(rank, world_size, nbytes):
    t = Transport()
    x = torch.zeros(nbytes // 4)
    t.all_reduce(x)  # warm-up (connections), not measured
    t0 = time.perf_counter()
    t.all_reduce(x)
    sync_s = time.perf_counter() - t0
    predicted = ring_allreduce(t.collective_link, world_size, nbytes).time
    # overlap: compute while an async all-reduce is on the emulated wire
    t.barrier()
    t0 = time.perf_counter()
    h = t.all_reduce(x, async_op=True)
    _busy(predicted)
    h.wait()
    overlap_s = time.perf_counter() - t0
    # queueing: two async transfers on one link take two transfer times
    t.barrier()
    t0 = time.perf_counter()
    h1, h2 = t.all_reduce(x.clone(), async_op=True), t.all_reduce(x.clone(), async_op=True)
    h1.wait()
    first = time.perf_counter() - t0
    h2.wait()
    both = time.perf_counter() - t0
    totals = t.meter.totals()
    return {"sync": sync_s, "predicted": predicted, "overlap": overlap_s, "first": first, "both": both,
            "transfer": ring_allreduce(t.collective_link, world_size, nbytes).transfer, "emulated": totals["emulated_s"]}


def test_emulated_time_follows_alpha_beta_and_overlaps_compute(pool2):
    link = "custom:bandwidth=80mbit,latency=20ms"
    nbytes = 1_000_000
    for out in pool2.run(_emulated, nbytes, network=link):
        p = out["predicted"]
        assert p == pytest.approx(2 * (2 * 0.02) + nbytes * 8 / 80e6)  # a round trip per ring step
        assert p <= out["sync"] < p * 1.25 + 0.05
        # compute ran for ~p and the transfer took ~p: about max(compute, comm), far from their sum
        assert out["overlap"] < 1.5 * p + 0.05, out
        # the second transfer queued behind the first on the same link
        assert out["both"] >= out["first"] + 0.9 * out["transfer"]
        assert out["emulated"] > 3 * p


def _one_to_three(rank, world_size, nbytes):
    """Rank 0 sends `nbytes` to ranks 1, 2, 3 at once; everyone reports when it was done (host clock)."""
    import torch.distributed as dist
    t = Transport()
    x = torch.full((nbytes // 4,), float(rank))
    for peer in range(1, world_size):      # warm-up: connections, not measured
        if rank == 0:
            t.send(torch.zeros(1), peer)
        elif rank == peer:
            t.recv(torch.zeros(1), 0)
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(t0, 0)
    if rank == 0:
        hs = [t.isend(x, peer) for peer in range(1, world_size)]
        for h in hs:
            h.wait()
        done, ok = time.perf_counter(), True
    else:
        buf = torch.empty_like(x)
        t.recv(buf, 0)
        done, ok = time.perf_counter(), torch.equal(buf, torch.zeros_like(buf))
    return done - float(t0), ok, t.meter.totals()["bytes_sent"]


def test_one_to_many_sends_charge_the_senders_link(pool4):
    """A rank sending to three peers at once pushes the messages out one after another: its last byte leaves
    after three transfer times, and no receiver has its data before the sender pushed it out (before the fix
    the sender finished at ~3 transfers while every receiver had its data after ~1)."""
    nbytes, link = 1_000_000, parse_network("custom:bandwidth=80mbit,latency=10ms")
    out = pool4.run(_one_to_three, nbytes, network="custom:bandwidth=80mbit,latency=10ms")
    transfer = nbytes * link.beta
    sender = out[0][0]
    received = sorted(o[0] for o in out[1:])
    assert all(o[1] for o in out)
    assert out[0][2] == 3 * nbytes + 4 * 3      # the data (and the warm-up), not the 8-byte timestamps
    assert sender >= 3 * transfer
    # the i-th message out of the sender's link reaches its receiver no earlier than i transfers + α
    for i, t in enumerate(received, start=1):
        assert t >= i * transfer + link.alpha - 1e-3, (i, received, sender)
    assert received[-1] >= sender


def test_link_profiles_and_custom_specs():
    wan = parse_network("wan")
    assert wan.bandwidth == 100e6 and wan.latency == 0.05 and wan.beta == pytest.approx(8e-8)
    assert not parse_network("lan").emulated
    c = parse_network("custom:bandwidth=200mbit,latency=25ms,jitter=5ms")
    assert (c.bandwidth, c.latency, c.jitter) == (200e6, 0.025, 0.005)
    assert parse_network("custom:latency=1s").latency == 1.0
    assert Link(bandwidth=1e9).alpha == 0.0


@pytest.mark.parametrize("spec", ["moon", "custom:", "custom:bandwidth=x", "custom:speed=1", "custom:latency",
                                  "custom:loss=2"])
def test_bad_network_specs(spec):
    from thinwire.errors import UserError
    with pytest.raises(UserError):
        parse_network(spec)


class _GlooWork:
    """A stand-in for a gloo collective's work: its future completes when the test says so."""

    def __init__(self):
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut

    def is_completed(self):
        return self.fut.done()


def _bare_transport(link):
    """The parts of a Transport a Handle uses, without a process group (single process)."""
    from thinwire.comm.emulation import DeliveryQueue, LinkClock
    from thinwire.comm.meter import Meter
    from thinwire.trace import NULL
    t = object.__new__(Transport)
    t.link, t.clock, t.meter, t.tracer = link, LinkClock(link), Meter(), NULL
    t.delivery = DeliveryQueue()
    return t


@pytest.mark.parametrize("link, expected", [
    (Link(), ["second", "first"]),                              # unemulated: each completes with gloo's
    (Link(bandwidth=1e12, name="fast"), ["first", "second"]),   # emulated wire: FIFO, in issue order
])
def test_a_collective_gloo_finished_first_is_held_only_on_an_emulated_wire(link, expected):
    from thinwire.comm.handle import Handle
    from thinwire.net import Cost
    t = _bare_transport(link)
    works = [_GlooWork(), _GlooWork()]
    handles = [Handle(t, "all_reduce", [w], Cost(0.0, 0.0, 8.0, 8.0), torch.zeros(2)) for w in works]
    delivered = []
    for h, label in zip(handles, ("first", "second")):
        h.add_done_callback(lambda _h, label=label: delivered.append(label))
    works[1].fut.set_result([torch.zeros(2)])     # gloo's second thread finishes the small bucket first
    assert handles[1].is_completed() is (not link.emulated)
    works[0].fut.set_result([torch.zeros(2)])
    assert delivered == expected and all(h.is_completed() for h in handles)
