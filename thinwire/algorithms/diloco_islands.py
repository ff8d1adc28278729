"""Hierarchical DiLoCo on a two-tier network (`thinwire.net.Islands`): `diloco` with `replicas="island"` makes each
island one DiLoCo replica.

The replica is trained by synchronous data parallelism inside (every inner step all-reduces the gradients over the
island's fast links, as `bsp` does; the island's workers hold the same model), and the outer sync crosses the thin
link once per island: the island's workers hold the same pseudo-gradient, so worker j of each island averages the
j-th of s equal shards of it with worker j of the other islands (over the thin link, through the training's
compressor and error feedback), then the island all-gathers the averaged shards over its fast links (the DiLoCo
paper's setting: "islands" of well-connected devices, Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105, §1; the data parallelism inside each replica torchft's DiLoCo leaves
to the user). The bytes that cross the thin link per sync are those of one model per island, spread over s of its
workers' links. M, the number of replicas averaged, is the number of islands. On a flat network (or islands of one
worker) it is the flat algorithm.

Islands of different sizes (`islands:2+4`): s is the smallest island's size (the workers j >= s of a larger
island send nothing across, and take their island's shards from its all-gather; the smallest island's workers
each carry 1/s of the model across, which bounds the sync's time however the larger ones spread theirs), and each
island's outer gradient is weighted by its share of the workers: its shard is sent times M n_i / n, so the mean
over the M islands is Σ_i (n_i / n) Δ_i, the mean over all n workers' replicas (each worker counted once, as flat
DiLoCo's mean; eager updates' own share is the weighted Δ too). Equal islands: weights 1, the plain mean of the
islands.

Contract: `island_groups(transport)` gives (this worker's `IslandReplica`, the transport of the islands' j-th
workers), or None; `DiLoCo` builds its outer exchange on the second and an uncompressed one for the gradients on
the replica's `inside` (the island's transport), and sends a piece of Δ as this worker's shard
(`IslandReplica.start`, keyed and sized by `shard`; empty for a worker j >= s).
"""
from __future__ import annotations

import torch

from ..comm import subgroup
from ..comm.engine import Future
from ..errors import UserError


def island_groups(transport):
    """(this worker's `IslandReplica`, the transport of the islands' j-th workers) on a two-tier network with
    islands of several workers; None elsewhere (flat DiLoCo). Every rank makes every group, in the same order."""
    net = transport.islands
    if net is None or net.size == 1:
        return None
    if transport.members != list(range(net.workers)):
        raise UserError("diloco replicas=island needs the whole job's group (no regrouped survivors)")
    me = transport.rank
    mine = net.island(me)
    islands = [subgroup(net.ranks(i)) for i in range(net.islands)]
    # column j: worker j of every island that has one (only j < the smallest island's size sends anything)
    columns = [subgroup([r[j] for r in map(net.ranks, range(net.islands)) if j < len(r)]) for j in range(net.size)]
    replica = IslandReplica(transport.sub(islands[mine]), net.islands, min(net.sizes),
                            net.islands * net.sizes[mine] / net.workers)
    return replica, transport.sub(columns[net.ranks(mine).index(me)])


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
    """This worker's part of its island's replica; `inside`: the island's transport; `replicas`: M, the islands;
    `shards`: the number of shards a piece of Δ is cut into (the smallest island's size); `weight`: the island's,
    M n_i / n."""

    def __init__(self, inside, replicas: int, shards: int, weight: float = 1.0):
        self.inside, self.replicas, self.shards, self.weight = inside, replicas, shards, weight

    def _split(self, delta: torch.Tensor) -> list[torch.Tensor]:
        """Δ's shards by island worker: the s shards, then an empty one for each worker j >= s."""
        shards = list(delta.tensor_split(self.shards))
        return shards + [delta[:0]] * (self.inside.world_size - self.shards)

    def start(self, exchange, delta: torch.Tensor, key: str):
        """(the future of what crosses the thin link, the future of the piece's mean Δ): this worker's shard of the
        island's Δ averaged across the islands by `exchange` (weighted), the island gathering the rest."""
        shards = self._split(delta)
        mine = shards[self.inside.rank]
        sent = exchange.start(mine.clone() if self.weight == 1.0 else mine * self.weight,
                              key=f"{key}#{self.inside.rank}", shapes=[tuple(mine.shape)])
        return sent, _Gathered(sent, self.inside, [t.numel() for t in shards])

    def shard(self, key: str, n: int) -> tuple[str, int]:
        """(key, numel) of this worker's shard of a piece of `n` elements keyed `key` (its exchange state)."""
        m, j = self.shards, self.inside.rank
        return f"{key}#{j}", 0 if j >= m else n // m + (1 if j < n % m else 0)
