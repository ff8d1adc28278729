"""The Transport's control-plane verbs (`agree_max`, `share`, `regroup_to`): what the Trainer's start-up checks and
recovery run, on the transport's group, neither metered nor emulated."""
from __future__ import annotations

import torch

from thinwire.comm import Transport


def _control(rank, world_size):
    t = Transport(network="custom:bandwidth=10mbit,latency=100ms")     # emulated: nothing is charged to it
    agreed = t.agree_max(torch.tensor([float(rank), -float(rank)], dtype=torch.float64))
    shared = [torch.full((3,), float(rank)), torch.full((2,), rank + 10.0)]
    t.share(shared, src=1)
    t.regroup_to(list(range(world_size)))     # every member: a new group of the same ranks
    after = t.agree_max(torch.tensor([float(rank)]))
    return {"agreed": agreed.tolist(), "shared": [s.tolist() for s in shared], "after": after.item(),
            "rank": t.rank, "size": t.world_size, "totals": t.meter.totals()}


def test_control_plane_verbs_agree_share_and_regroup_unmetered():
    from thinwire.launcher import Pool
    with Pool(2) as pool:       # its own processes: the groups it forms are the first of their kind there
        results = pool.run(_control)
    for rank, out in enumerate(results):
        assert out["agreed"] == [1.0, 0.0]                      # the max of [r, -r] over ranks 0 and 1
        assert out["shared"] == [[1.0] * 3, [11.0] * 2]         # rank 1's tensors, on every rank
        assert out["after"] == 1.0 and (out["rank"], out["size"]) == (rank, 2)
        assert out["totals"]["bytes_sent"] == 0 and out["totals"]["emulated_s"] == 0


def _long_sync(rank, world_size):
    """Two steps around one all-reduce that a 1 Mbit/s emulated link needs ~6 s to deliver (750 KB)."""
    import time

    from thinwire.comm import progress
    t = Transport(network="custom:bandwidth=1mbit,latency=50ms")
    progress.report(1)
    t0 = time.monotonic()
    out = t.all_reduce(torch.ones(187_500))
    progress.report(2)
    return time.monotonic() - t0, float(out[0]), t.meter.totals()["emulated_s"]


def test_a_sync_that_occupies_a_thin_link_is_no_false_failure():
    """The control plane never waits behind the data plane: heartbeats beat from their own thread into shared
    memory and membership goes through the launcher's store, neither on the emulated link. A sync that occupies a
    thin link for several times the progress and liveness bounds (a 2 s watchdog and a 2 s heartbeat bound, a
    ~6 s all-reduce) is busy, not stuck: the emulated link tells the watchdog the transfer moves (`progress.moving`),
    and the run ends with its result, no rank named."""
    from thinwire.launcher import Pool
    with Pool(2, progress_timeout=2.0, stall_timeout=2.0) as pool:
        for took, value, emulated in pool.run(_long_sync):
            assert value == 2.0 and emulated > 4.0 and took > 4.0, (took, emulated)
