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


def test_control_plane_verbs_agree_share_and_regroup_unmetered(pool2):
    for rank, out in enumerate(pool2.run(_control)):
        assert out["agreed"] == [1.0, 0.0]                      # the max of [r, -r] over ranks 0 and 1
        assert out["shared"] == [[1.0] * 3, [11.0] * 2]         # rank 1's tensors, on every rank
        assert out["after"] == 1.0 and (out["rank"], out["size"]) == (rank, 2)
        assert out["totals"]["bytes_sent"] == 0 and out["totals"]["emulated_s"] == 0
