"""Hierarchical DiLoCo on a two-tier network (`thinwire.net.Islands`): `diloco` with `replicas="island"` makes each
island one DiLoCo replica.

The replica is trained by synchronous data parallelism inside (every inner step all-reduces the gradients over the
island's fast links, as `bsp` does; the island's workers hold the same model), and the outer sync crosses the thin
link once per island: the island's workers hold the same pseudo-gradient, so worker j of each island averages the
j-th of m equal shards of it with worker j of the other islands (over the thin link, through the training's
compressor and error feedback), then the island all-gathers the averaged shards over its fast links (the DiLoCo
paper's setting: "islands" of well-connected devices, Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105, §1; the data parallelism inside each replica torchft's DiLoCo leaves
to the user). The bytes that cross the thin link per sync are those of one model per island, spread over its
workers' links. M, the number of replicas averaged, is the number of islands. On a flat network (or islands of one
worker) it is the flat algorithm.

Contract: `island_groups(transport)` gives (the island's transport, the transport of the islands' j-th workers),
or None; `DiLoCo` builds its outer exchange on the second and an uncompressed one for the gradients on the first,
and sends a piece of Δ as this worker's shard (`IslandReplica.start`, keyed and sized by `shard`).
"""
from __future__ import annotations

import torch

from ..comm import subgroup
from ..comm.engine import Future
from ..errors import UserError


def island_groups(transport):
    """(this island's transport, the transport of the islands' j-th workers) on a two-tier network with islands
    of several workers; None elsewhere (flat DiLoCo). Every rank makes every group, in the same order."""
    net = transport.islands
    if net is None or net.size == 1:
        return None
    if transport.members != list(range(net.workers)):
        raise UserError("diloco replicas=island needs the whole job's group (no regrouped survivors)")
    m, me = net.size, transport.rank
    islands = [subgroup(range(i * m, (i + 1) * m)) for i in range(net.islands)]
    columns = [subgroup(range(j, net.workers, m)) for j in range(m)]
    return transport.sub(islands[me // m]), transport.sub(columns[me % m])


class _Gathered(Future):
    """The mean of a piece's Δ: this worker's shard averaged across the islands (`fut`), then the island's shards
    all-gathered over its fast links (on `result`, when the merge asks for it)."""

    def __init__(self, fut, inside, sizes: list[int]):
        self.fut, self.inside, self.sizes = fut, inside, sizes
        self._value = None

    def is_completed(self) -> bool:
        return self._value is not None or self.fut.is_completed()

    def result(self):
        if self._value is None:
            mine = self.fut.wait()          # (each wait counts its own exposed time)
            self._value = torch.cat(self.inside.all_gather(mine.reshape(-1), sizes=self.sizes))
        return self._value


class IslandReplica:
    """This worker's part of its island's replica; `inside`: the island's transport."""

    def __init__(self, inside):
        self.inside = inside

    def start(self, exchange, delta: torch.Tensor, key: str):
        """(the future of what crosses the thin link, the future of the piece's mean Δ): this worker's shard of the
        island's Δ averaged across the islands by `exchange`, the island gathering the rest."""
        shards = delta.tensor_split(self.inside.world_size)
        mine = shards[self.inside.rank]
        sent = exchange.start(mine.clone(), key=f"{key}#{self.inside.rank}", shapes=[tuple(mine.shape)])
        return sent, _Gathered(sent, self.inside, [t.numel() for t in shards])

    def shard(self, key: str, n: int) -> tuple[str, int]:
        """(key, numel) of this worker's shard of a piece of `n` elements keyed `key` (its exchange state)."""
        m, j = self.inside.world_size, self.inside.rank
        return f"{key}#{j}", n // m + (1 if j < n % m else 0)
