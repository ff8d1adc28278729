"""A workload's training data as each worker sees it: its own shard, cut into mini-batches on the model's device.

A workload's data (`Workload.data`) is one of
- tensors `(x_train, y_train, x_test, y_test)` (the built-in workloads): `ShardLoader` over the rank's rows;
- `(train, test)`, each a map-style dataset (`torch.utils.data.Dataset`, a list: `len()` and indexing by
  position, each item an `(x, y)` sample): `DatasetLoader` over the rank's positions;
- or `train` an iterable of `(x, y)` samples that can be iterated again every epoch (an `IterableDataset`; a
  generator object runs once), or a callable `(rank, world_size) -> iterable of samples`: `StreamLoader`.

Sharding: rows and positions are dealt out by rank (`rank::world_size`: disjoint, every worker a mix of the
whole); an iterable's samples likewise (sample i to rank i mod world_size), unless it is a callable, which gets
`(rank, world_size)` and yields its own shard. Batches: `batch_size` samples, reshuffled every epoch by
(seed, rank, epoch) for tensors and datasets (an iterable keeps its own order), the last incomplete batch of an
epoch dropped; samples are stacked by `torch.utils.data.default_collate` (tensors, numbers, dicts, tuples).
Every loader is resumable (`state_dict`, `load_state_dict`).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..errors import UserError


def is_dataset(part) -> bool:
    """A map-style dataset: `len()` and indexing by position (a torch `Dataset` with both, a list, a tuple)."""
    return not isinstance(part, IterableDataset) and hasattr(part, "__getitem__") and hasattr(part, "__len__")


def check_part(part, what: str) -> None:
    """`part` (the training or the test data of a workload in `(train, test)` form) is a dataset, an iterable
    or (training only) a callable; a DataLoader is refused: thinwire batches and shards the samples itself."""
    if isinstance(part, DataLoader):
        raise UserError(f"{what} is a DataLoader: pass its dataset (loader.dataset); thinwire shards it by rank "
                        f"and batches it with the workload's batch_size")
    if isinstance(part, (str, bytes)) or not (is_dataset(part) or hasattr(part, "__iter__") or callable(part)):
        raise UserError(f"{what} must be a torch Dataset, an iterable of (x, y) samples or a function "
                        f"(rank, world_size) -> iterable, got {type(part).__name__}")


def collate(samples: list):
    """A batch of `(x, y)` samples: (stacked x, stacked y)."""
    try:
        x, y = default_collate(samples)
    except (TypeError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"samples must be (x, y) pairs of tensors (or numbers) of one shape: {first}") from None
    return x, y


def to_device(batch: Any, device: torch.device):
    """`batch` (a tensor, or dicts / lists / tuples of them) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def samples(part, rank: int = 0, world_size: int = 1):
    """The samples of `part` that rank `rank` of `world_size` trains on, in order."""
    if is_dataset(part):
        return (part[i] for i in range(rank, len(part), world_size))
    if callable(part) and not hasattr(part, "__iter__"):
        return iter(part(rank, world_size))
    return itertools.islice(iter(part), rank, None, world_size)


def materialize(part) -> tuple:
    """Every sample of `part` stacked into one `(x, y)` (a held-out set, evaluated whole)."""
    got = list(samples(part))
    if not got:
        raise UserError("the test data is empty")
    return collate(got)


def per_worker(part, world_size: int) -> int:
    """How many training samples the smallest worker's shard holds (an iterable without `len()` is counted)."""
    if is_dataset(part) or (hasattr(part, "__len__") and not callable(part)):
        return len(part) // world_size
    return min(sum(1 for _ in samples(part, r, world_size)) for r in range(world_size))


class ShardLoader:
    """Mini-batches of one rank's shard, reshuffled every epoch by (seed, rank, epoch); resumable."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0, rank: int = 0):
        if batch_size < 1:
            raise UserError("batch size must be >= 1")
        if len(x) < batch_size:
            raise UserError(f"a worker's shard of {len(x)} samples is smaller than the batch size {batch_size}; "
                            f"use a smaller --batch-size or fewer --workers")
        self.x, self.y, self.batch_size, self.seed, self.rank = x, y, batch_size, seed, rank
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        """This epoch's order, drawn from a host generator (the same on every device) and kept where the shard
        is: batches are then cut on the shard's device, with no host copy per step."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.epoch)
        return torch.randperm(len(self.x), generator=g, device="cpu").to(self.x.device)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch_size > len(self.x):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()


class DatasetLoader(ShardLoader):
    """`ShardLoader`'s batches of positions in a map-style dataset (the rank's `rank::world_size`), each batch's
    samples read, stacked and moved to `device`."""

    def __init__(self, dataset, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu"):
        positions = torch.arange(rank, len(dataset), world_size)
        super().__init__(positions, positions, batch_size, seed, rank)
        self.dataset, self.device = dataset, torch.device(device)

    def next(self):
        positions, _ = super().next()
        return to_device(collate([self.dataset[i] for i in positions.tolist()]), self.device)


class StreamLoader:
    """Batches of one rank's samples of an iterable (or of what a callable `(rank, world_size)` yields), in its
    order; at its end the next epoch iterates it again. Resumes by iterating to the batch it stopped at."""

    def __init__(self, source, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu"):
        if batch_size < 1:
            raise UserError("batch size must be >= 1")
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        self.seed = seed        # (recorded, like the other loaders'; the iterable keeps its own order)
        self.device = torch.device(device)
        self.epoch, self.pos = 0, 0
        self._it = samples(source, rank, world_size)

    def next(self):
        batch = list(itertools.islice(self._it, self.batch_size))
        if len(batch) < self.batch_size:        # the epoch's end: the incomplete batch is dropped
            self.epoch, self.pos = self.epoch + 1, 0
            self._it = samples(self.source, self.rank, self.world_size)
            batch = list(itertools.islice(self._it, self.batch_size))
            if len(batch) < self.batch_size:
                raise UserError(f"a worker's part of the training data holds {len(batch)} samples, fewer than the "
                                f"batch size {self.batch_size}; use a smaller --batch-size or fewer --workers")
        self.pos += 1
        return to_device(collate(batch), self.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], 0
        self._it = samples(self.source, self.rank, self.world_size)
        for _ in range(state["pos"]):
            self.next()
