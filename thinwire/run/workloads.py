"""Workloads: a model, bundled offline data split into disjoint shards by rank, a loss and a target.

| name | data | model | metric / target |
| --- | --- | --- | --- |
| `digits-mlp` | scikit-learn's 8x8 digits (1437 train / 360 test, split fixed by seed 0) | MLP 64-128-10 (9.6 k params) | test accuracy >= 0.95 |
| `digits-cnn` | same | 2 conv + 1 linear (11 k params) | test accuracy >= 0.95 |
| `wide-mlp` | same | MLP 64-1024-1024-10 (1.1 M params): communication-heavy on `wan` | test accuracy >= 0.93 |
| `mnist1d-cnn` | MNIST-1D (4000 train / 1000 test, generated offline by the `mnist1d` package) | 1-D CNN (29 k params) | test accuracy >= 0.80 |
| `linreg` | synthetic least squares, float64 (2048 x 16) | linear, no bias | test MSE <= 0.01 (noise floor 1e-4) |
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from ..registry import Registry

registry = Registry("workload")


@dataclass
class Workload:
    name: str
    data: tuple  # x_train, y_train, x_test, y_test
    build: Callable[[], nn.Module]
    metric: str = "accuracy"          # "accuracy" (higher is better) or "loss" (lower is better)
    target: float = 0.95
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    epochs: float = 5.0
    doc: str = ""
    dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build().to(self.dtype)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.metric == "accuracy":
            return F.cross_entropy(output, target)
        return F.mse_loss(output.reshape(-1), target.reshape(-1))

    def shard(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank's disjoint part of the training set (interleaved after a fixed permutation)."""
        x, y = self.data[0], self.data[1]
        return x[rank::world_size], y[rank::world_size]

    def steps_per_epoch(self, world_size: int, batch_size: int | None = None) -> int:
        per = len(self.data[0]) // world_size
        return max(1, per // (batch_size or self.batch_size))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        out = model(self.data[2])
        model.train(was)
        if self.metric == "accuracy":
            return float((out.argmax(1) == self.data[3]).float().mean())
        return float(F.mse_loss(out.reshape(-1), self.data[3].reshape(-1)))

    def reached(self, value: float, target: float | None = None) -> bool:
        t = self.target if target is None else target
        return value >= t if self.metric == "accuracy" else value <= t

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model().parameters())


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
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.epoch)
        return torch.randperm(len(self.x), generator=g)

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


# -- data ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def digits_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 360
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def _cache_dir() -> str:
    d = os.environ.get("THINWIRE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "thinwire"))
    os.makedirs(d, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def mnist1d_data():
    """MNIST-1D by its own generator (mnist1d.data.make_dataset, default arguments: deterministic, offline),
    cached on disk after the first generation (written atomically)."""
    path = os.path.join(_cache_dir(), "mnist1d-default.npz")
    if not os.path.exists(path):
        from mnist1d.data import get_dataset_args, make_dataset
        args = get_dataset_args()
        data = make_dataset(args)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, x=data["x"], y=data["y"], x_test=data["x_test"], y_test=data["y_test"])
        os.replace(tmp, path)
    d = np.load(path)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    i = lambda a: torch.tensor(a, dtype=torch.int64)
    return f(d["x"]), i(d["y"]), f(d["x_test"]), i(d["y_test"])


@functools.lru_cache(maxsize=None)
def linreg_data(n: int = 2048, d: int = 16, noise: float = 0.01):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    y = (x @ w).reshape(-1) + noise * torch.randn(n, generator=g, dtype=torch.float64)
    n_test = n // 4
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


# -- models ----------------------------------------------------------------------------------------------
def _mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4 // 1, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Mnist1dCNN(nn.Module):
    def __init__(self, channels: int = 32):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.fc = nn.Linear(channels * 5, 10)

    def forward(self, x):
        x = x.view(x.shape[0], 1, -1)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.fc(x.flatten(1))


@registry.register("digits-mlp")
def digits_mlp() -> Workload:
    """scikit-learn digits, MLP 64-128-10; target test accuracy 0.95."""
    return Workload("digits-mlp", digits_data(), lambda: _mlp(64, 128, 10), target=0.95, lr=0.2, epochs=6,
                    doc=digits_mlp.__doc__)


@registry.register("digits-cnn")
def digits_cnn() -> Workload:
    """scikit-learn digits, small CNN; target test accuracy 0.95."""
    return Workload("digits-cnn", digits_data(), DigitsCNN, target=0.95, lr=0.05, epochs=8, doc=digits_cnn.__doc__)


@registry.register("wide-mlp")
def wide_mlp() -> Workload:
    """Communication-heavy: scikit-learn digits, MLP 64-1024-1024-10 (1.1 M params); target accuracy 0.93."""
    return Workload("wide-mlp", digits_data(), lambda: _mlp(64, 1024, 1024, 10), target=0.93, lr=0.05,
                    epochs=4, doc=wide_mlp.__doc__)


@registry.register("mnist1d-cnn")
def mnist1d_cnn() -> Workload:
    """MNIST-1D generated offline, 1-D CNN; target test accuracy 0.80."""
    return Workload("mnist1d-cnn", mnist1d_data(), Mnist1dCNN, target=0.80, lr=0.05, epochs=20,
                    batch_size=32, doc=mnist1d_cnn.__doc__)


@registry.register("linreg")
def linreg() -> Workload:
    """Synthetic least squares in float64 (for exact equivalence tests); target test MSE 0.01."""
    return Workload("linreg", linreg_data(), lambda: nn.Linear(16, 1, bias=False), metric="loss", target=0.01,
                    lr=0.05, momentum=0.0, epochs=5, batch_size=16, dtype=torch.float64, doc=linreg.__doc__)


def get(name: str) -> Workload:
    return registry.get(name)
