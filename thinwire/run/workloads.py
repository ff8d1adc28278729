"""Workloads: a model, bundled offline data split into disjoint shards by rank, a loss and a target.

| name | data | model | metric / target |
| --- | --- | --- | --- |
| `digits-mlp` | scikit-learn's 8x8 digits (1437 train / 360 test, split fixed by seed 0) | MLP 64-128-10 (9.6 k params) | test accuracy >= 0.95 |
| `digits-cnn` | same | 2 conv + 1 linear (11 k params) | test accuracy >= 0.95 |
| `wide-mlp` | same | MLP 64-1024-1024-10 (1.1 M params): communication-heavy on `wan` | test accuracy >= 0.93 |
| `mnist1d-cnn` | MNIST-1D (4000 train / 1000 test, generated offline by the `mnist1d` package) | 1-D CNN (29 k params) | test accuracy >= 0.80 |
| `linreg` | synthetic least squares, float64 (2048 x 16) | linear, no bias | test MSE <= 0.01 (noise floor 1e-4) |
| `stdlib-lm` | the interpreter's stdlib source as bytes (`lm.corpus`, fingerprinted) | byte transformer (1.07 M params), AdamW | validation loss <= 2.25 nats/byte |
| `mnist1d-resnet` | MNIST-1D, 40 000 train / 2 000 test, generated offline | 1-D ResNet (0.54 M params) | test accuracy >= 0.95 |

Each workload has a default optimizer (`make_optimizer`); docs/workloads.md says how the new targets were chosen.
Each is a `Workload` (public as `tw.Workload`), as is a user's: `get("my_module:make")` imports it, builds it and
checks it on one batch (`thinwire.run.user`); its data may be datasets or iterables (`thinwire.run.data`).
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from ..optim import MuonWithAdamW, muon_split
from ..registry import Registry
from . import lm, user
from .data import DatasetLoader, ShardLoader, StreamLoader, check_part, is_dataset, materialize, per_worker, to_device


class WorkloadRegistry(Registry):
    """The built-in workloads by name, and a workload of the user's by its spec, `module:function` or
    `path/to/file.py:function` (`thinwire.run.user`: imported, built and checked once per process)."""

    def lookup(self, name: str):
        if user.is_spec(name):
            wl = user.load(name, Workload)
            return lambda: wl
        if name not in self:
            raise UserError(f"unknown workload {name!r}; valid: {', '.join(self.names())}, or one of yours as "
                            f"module:function (a function returning a thinwire.Workload)")
        return super().lookup(name)


registry = WorkloadRegistry("workload")


# Optimizers a workload can be trained with, and the settings each starts from before the workload's own
# (`Workload.optim`) and, for its default optimizer, its `lr`/`momentum`. "momentum" is SGD's heavy-ball
# coefficient and AdamW's beta1 (the decay of its first-moment average: Adam's momentum), and Muon's momentum.
# "muon": Muon on the hidden weight matrices, AdamW on the rest (thinwire.optim.MuonWithAdamW, MuLoCo's inner
# optimizer); it starts from the workload's AdamW settings (learning rate, beta2, weight decay: Muon's update is
# scaled to AdamW's RMS), with Muon's own momentum 0.95 (torch.optim.Muon's default; AdamW's part keeps beta1 0.9).
OPTIMIZERS = {
    "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "momentum": 0.9, "beta2": 0.999, "weight_decay": 0.01},  # torch.optim.AdamW's defaults
    "muon": {"momentum": 0.95},
}


def check_optimizer(name: str, what: str = "optimizer") -> None:
    """`name` is a name in OPTIMIZERS: else a UserError `{what} must be one of sgd, adamw, got ...`."""
    if name not in OPTIMIZERS:
        raise UserError(f"{what} must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


METRICS = ("accuracy", "loss")


@dataclass
class Workload:
    """A model, its data, its loss and the metric it races to (`tw.Workload`). The built-in workloads are
    instances; `make()` in a module of yours returns one, and `--workload my_module:make` (or
    `path/to/file.py:make`) races it (docs/race-your-model.md).

    Args:
        name: what the results call it.
        data: tensors `(x_train, y_train, x_test, y_test)`, or `(train, test)`: each a `torch.utils.data.Dataset`
            (or a list) of `(x, y)` samples, or an iterable of them; `train` may also be a function
            `(rank, world_size) -> iterable` that shards itself. thinwire deals the rest out by rank
            (`thinwire.run.data`); every worker evaluates the whole test set.
        build: a function of no arguments returning the model (`torch.nn.Module`); each worker calls it after
            seeding torch with the run's seed, so every worker starts from the same weights.
        metric: "accuracy" (higher is better: the share of `argmax(model(x)) == y`, or `eval_fn`'s) or "loss"
            (lower is better: `loss_fn` on the test set, or `eval_fn`'s).
        target: the metric's value a race runs to.
        batch_size: samples per worker per step.
        lr: the default optimizer's learning rate.
        momentum: its momentum (SGD), beta1 (AdamW).
        epochs: passes over the training set of a run given no --steps, --epochs or --budget.
        doc: one line for `thinwire list`.
        dtype: the model's parameter type (`build()`'s result is cast to it).
        extra: anything the results should record about the workload.
        optimizer: "sgd", "adamw" or "muon", or a function returning a `torch.optim.Optimizer`: it is given the
            model's parameters (`torch.optim.AdamW` itself, or a `functools.partial` of it, will do), or the
            model where its first argument is named `model`. `--lr` and `--momentum` then override its groups'.
        optim: per optimizer name, settings over its defaults (`OPTIMIZERS`) when the run names another.
        loss_fn: `(model output, y) -> scalar loss` tensor (default: cross-entropy for "accuracy", MSE for
            "loss"); the output may be anything the model returns (a Hugging Face model's output object).
        eval_fn: `(model, x_test, y_test) -> float`, the metric on the test set (default: see `metric`).
        derived: name -> function of the metric's value, other readings of it (e.g. bits per byte).
    """
    name: str
    data: tuple  # (x_train, y_train, x_test, y_test) or (train, test): see the class doc
    build: Callable[[], nn.Module]
    metric: str = "accuracy"          # "accuracy" (higher is better) or "loss" (lower is better)
    target: float = 0.95
    batch_size: int = 32
    lr: float = 0.1                   # the default optimizer's learning rate
    momentum: float = 0.9             # and its momentum (AdamW: beta1)
    epochs: float = 5.0
    doc: str = ""
    dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)
    optimizer: str | Callable = "sgd"  # the default optimizer, a name in OPTIMIZERS, or a factory
    optim: dict = field(default_factory=dict)   # name -> settings over OPTIMIZERS[name] (e.g. another's lr)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (output, target) -> loss
    eval_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], float] | None = None  # (model, x_test, y_test)
    derived: dict = field(default_factory=dict)  # name -> f(metric value), e.g. bits per byte from a loss
    _held_out: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (x_test, y_test) there
    _sizes: dict = field(default_factory=dict, repr=False, compare=False)     # world size -> smallest shard

    def __post_init__(self):
        if isinstance(self.optimizer, str):
            check_optimizer(self.optimizer, f"workload {self.name}: optimizer")
        elif not callable(self.optimizer):
            raise UserError(f"workload {self.name}: optimizer must be one of {', '.join(OPTIMIZERS)} or a function "
                            f"returning a torch.optim.Optimizer, got {self.optimizer!r}")
        if self.metric not in METRICS:
            raise UserError(f"workload {self.name}: metric must be accuracy (higher is better) or loss (lower is "
                            f"better), got {self.metric!r}")
        if not callable(self.build):
            raise UserError(f"workload {self.name}: build must be a function returning the model, got "
                            f"{type(self.build).__name__}")
        self.data = tuple(self.data) if isinstance(self.data, (tuple, list)) else self.data
        if self.tensors:
            self.data = tuple(torch.as_tensor(d) if isinstance(d, np.ndarray) else d for d in self.data)
        elif isinstance(self.data, tuple) and len(self.data) == 2:
            check_part(self.data[0], f"workload {self.name}: the training data")
            if callable(self.data[1]) and not hasattr(self.data[1], "__iter__"):
                raise UserError(f"workload {self.name}: the test data must be a dataset or an iterable of (x, y) "
                                f"samples (every worker evaluates all of it), not a function")
            check_part(self.data[1], f"workload {self.name}: the test data")
        else:
            raise UserError(f"workload {self.name}: data must be (x_train, y_train, x_test, y_test) tensors or "
                            f"(train, test) datasets, got {type(self.data).__name__}"
                            + (f" of {len(self.data)}" if isinstance(self.data, tuple) else ""))

    @property
    def tensors(self) -> bool:
        """Its data is tensors (x_train, y_train, x_test, y_test), rather than (train, test) datasets."""
        return (isinstance(self.data, tuple) and len(self.data) == 4
                and all(isinstance(d, (torch.Tensor, np.ndarray)) for d in self.data))

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build().to(self.dtype)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        if self.metric == "accuracy":
            return F.cross_entropy(output, target)
        return F.mse_loss(output.reshape(-1), target.reshape(-1))

    def optimizer_settings(self, optimizer: str | None = None) -> tuple[str, dict]:
        """(name, settings) of `optimizer` (default: the workload's own) before any override; a factory's are
        ("custom", the workload's `lr` and `momentum`)."""
        name = self.optimizer if optimizer is None else optimizer
        if callable(name):
            return "custom", {"lr": self.lr, "momentum": self.momentum, "weight_decay": 0.0}
        check_optimizer(name)
        if name == "muon":      # the workload's AdamW settings, Muon's momentum
            settings = {**self.optimizer_settings("adamw")[1], **OPTIMIZERS["muon"], **self.optim.get("muon", {})}
            return name, settings
        settings = {**OPTIMIZERS[name], **self.optim.get(name, {})}
        if name == self.optimizer:
            settings.update(lr=self.lr, momentum=self.momentum)
        return name, settings

    def make_optimizer(self, parameters, lr: float | None = None, momentum: float | None = None,
                       optimizer: str | None = None) -> torch.optim.Optimizer:
        """The workload's default optimizer, or "sgd" / "adamw" / "muon" by name, over `parameters` (or a model's:
        "muon" needs the model, to tell its hidden weight matrices from its head); `lr` and `momentum` override its
        settings (for AdamW `momentum` is beta1, for Muon its momentum)."""
        if optimizer is None and callable(self.optimizer):
            return self._from_factory(parameters, lr, momentum)
        cls, kwargs = self._optimizer(lr, momentum, optimizer)
        if cls.__name__ == "MuonWithAdamW":
            if not isinstance(parameters, nn.Module):
                raise UserError("the muon optimizer needs the model (its hidden weight matrices get Muon, the rest "
                                "AdamW): pass the module")
            return cls(*muon_split(parameters), **kwargs)
        if isinstance(parameters, nn.Module):
            parameters = parameters.parameters()
        return cls(parameters, **kwargs)

    def _from_factory(self, parameters, lr: float | None, momentum: float | None) -> torch.optim.Optimizer:
        """The workload's optimizer factory's optimizer over the model (where its first argument is named
        `model`) or its parameters, with `lr` and `momentum` (beta1 where it has betas) set on every group."""
        factory = self.optimizer
        try:
            first = next(iter(inspect.signature(factory).parameters), None)
        except (TypeError, ValueError):
            first = None
        if first != "model" and isinstance(parameters, nn.Module):
            parameters = list(parameters.parameters())
        opt = factory(parameters)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UserError(f"workload {self.name}: its optimizer function returned {type(opt).__name__}, not a "
                            f"torch.optim.Optimizer")
        for group in opt.param_groups:
            if lr is not None:
                group["lr"] = lr
            if momentum is not None and "momentum" in group:
                group["momentum"] = momentum
            elif momentum is not None and "betas" in group:
                group["betas"] = (momentum, *group["betas"][1:])
        return opt

    def _optimizer(self, lr, momentum, optimizer) -> tuple[type, dict]:
        """(the class, its keyword arguments) of `make_optimizer`'s optimizer."""
        name, s = self.optimizer_settings(optimizer)
        lr = s["lr"] if lr is None else lr
        momentum = s["momentum"] if momentum is None else momentum
        if name == "muon":
            return MuonWithAdamW, dict(lr=lr, weight_decay=s["weight_decay"], momentum=momentum,
                                       betas=(0.9, s["beta2"]))
        if name == "sgd":
            return torch.optim.SGD, dict(lr=lr, momentum=momentum, weight_decay=s["weight_decay"])
        return torch.optim.AdamW, dict(lr=lr, betas=(momentum, s["beta2"]), weight_decay=s["weight_decay"])

    def optimizer_stand_in(self, lr: float | None = None, momentum: float | None = None,
                           optimizer: str | None = None) -> torch.optim.Optimizer:
        """An optimizer of `make_optimizer`'s class with its settings in one parameter group of no parameters,
        never initialised (torch.optim's constructor imports torch._dynamo: seconds in a process that trains
        nothing): what an algorithm checks before any worker starts (`Algorithm.check_run`). A factory's is
        the real one, over a fresh model."""
        if optimizer is None and callable(self.optimizer):
            return self.make_optimizer(self.model(), lr, momentum)
        cls, kwargs = self._optimizer(lr, momentum, optimizer)
        if cls.__name__ == "MuonWithAdamW":     # a model with no hidden weight matrix is refused here already
            with torch.random.fork_rng(devices=[]), torch.device("meta"):   # its shapes: no memory, no RNG drawn
                muon_split(self.build())
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        stand_in = cls.__new__(cls)
        stand_in.defaults = {**defaults, **kwargs}
        stand_in.param_groups = [{**stand_in.defaults, "params": []}]
        return stand_in

    def shard(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank's disjoint part of the training tensors (interleaved after a fixed permutation)."""
        if not self.tensors:
            raise UserError(f"workload {self.name}: its data are datasets; take batches with loader()")
        x, y = self.data[0], self.data[1]
        return x[rank::world_size], y[rank::world_size]

    def loader(self, rank: int, world_size: int, batch_size: int | None = None, seed: int = 0,
               device: torch.device | str = "cpu"):
        """Rank's batches on `device` (`thinwire.run.data`): `next()` gives (x, y); resumable."""
        batch = batch_size or self.batch_size
        if self.tensors:
            x, y = self.shard(rank, world_size)
            return ShardLoader(x.to(device), y.to(device), batch, seed=seed, rank=rank)
        if is_dataset(self.data[0]):
            return DatasetLoader(self.data[0], batch, seed, rank, world_size, device)
        return StreamLoader(self.data[0], batch, seed, rank, world_size, device)

    def per_worker(self, world_size: int) -> int:
        """Training samples in the smallest worker's shard (an iterable without `len()` counted once)."""
        if world_size not in self._sizes:
            train = self.data[0]
            self._sizes[world_size] = len(train) // world_size if self.tensors else per_worker(train, world_size)
        return self._sizes[world_size]

    def check_batch_size(self, world_size: int, batch_size: int | None = None) -> None:
        """Refuse a batch larger than the smallest worker's shard (`ShardLoader` would, in every worker)."""
        batch = batch_size or self.batch_size
        smallest = self.per_worker(world_size)
        if smallest < batch:
            raise UserError(f"a worker's shard of {smallest} samples is smaller than the batch size {batch}; "
                            f"use a smaller --batch-size or fewer --workers")

    def check_target(self, target: float | None, flag: str = "--target") -> None:
        """A target this workload's metric can reach: an accuracy in [0, 1]; a loss >= 0."""
        if target is not None and self.metric == "accuracy" and not 0 <= target <= 1:
            raise UserError(f"{flag} must be an accuracy in [0, 1] for workload {self.name!r} (its metric is "
                            f"accuracy), got {target!r}")

    def steps_per_epoch(self, world_size: int, batch_size: int | None = None) -> int:
        return max(1, self.per_worker(world_size) // (batch_size or self.batch_size))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        x, y = self.held_out(next(model.parameters()).device)
        try:
            if self.eval_fn is not None:
                return float(self.eval_fn(model, x, y))
            out = model(x)
        finally:
            model.train(was)
        if self.metric == "accuracy":
            # hits / total in Python: a float32 mean reads exactly 95% as 0.94999999 < 0.95, a missed target
            return int((out.argmax(1) == y).sum()) / y.numel()
        return float(self.loss(out, y))   # the training loss on the held-out set (`loss_fn`, else MSE)

    def held_out(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out set on `device` (where the model is), copied there once (a test dataset stacked once)."""
        key = str(device)
        if key not in self._held_out:
            if self.tensors:
                x, y = self.data[2], self.data[3]
            else:
                x, y = self._held_out["stacked"] = self._held_out.get("stacked") or materialize(self.data[1])
            self._held_out[key] = (to_device(x, device), to_device(y, device))
        return self._held_out[key]

    def derived_metrics(self, value: float) -> dict:
        """The workload's other readings of a metric value (e.g. {"bits_per_byte": ...} from a loss)."""
        return {k: f(value) for k, f in self.derived.items()}

    def reached(self, value: float, target: float | None = None) -> bool:
        t = self.target if target is None else target
        return value >= t if self.metric == "accuracy" else value <= t

    def unmoved(self, values: list[float]) -> str | None:
        """One line when the metric never moved over a run's evaluations (the same value at every one of at
        least two), else None: a metric not computed from the model, or a learning rate of zero."""
        if len(values) < 2 or any(v != values[0] for v in values):
            return None
        return (f"the {self.metric} never moved: {values[0]:.6g} at all {len(values)} evaluations (is it computed "
                f"from the model's output, and does the optimizer update the model?)")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model().parameters())


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


def cache_dir() -> str:
    d = os.environ.get("THINWIRE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "thinwire"))
    os.makedirs(d, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def mnist1d_data(num_samples: int = 5000, train_split: float = 0.8):
    """MNIST-1D by its own generator (mnist1d.data.make_dataset: deterministic, offline; never its downloading
    loader), `num_samples` in all, cached on disk after the first generation (written atomically) under a name
    keyed by the generation arguments (mnist1d's defaults for the others; importing mnist1d costs seconds, so it is
    imported only to generate). With the default arguments: mnist1d's default 4000 train / 1000 test."""
    default = (num_samples, train_split) == (5000, 0.8)
    name = "mnist1d-default.npz" if default else f"mnist1d-n{num_samples}-split{train_split:g}.npz"
    path = os.path.join(cache_dir(), name)
    if not os.path.exists(path):
        from mnist1d.data import get_dataset_args, make_dataset
        args = get_dataset_args()
        args.num_samples, args.train_split = num_samples, train_split
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
        self.fc = nn.Linear(32 * 4 * 4, 10)

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
        for conv in (self.conv1, self.conv2, self.conv3):
            x = F.relu(conv(x))
        return self.fc(x.flatten(1))


class ResBlock1d(nn.Module):
    """Pre-activation residual block (He et al. 2016, "Identity Mappings in Deep Residual Networks"): two
    GroupNorm-ReLU-conv3 layers, a strided 1x1 conv on the shortcut when the shape changes. GroupNorm, not
    BatchNorm, so a model is its parameters (no running statistics that differ between workers)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.n1, self.n2 = nn.GroupNorm(8, c_in), nn.GroupNorm(8, c_out)
        self.c1 = nn.Conv1d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.c2 = nn.Conv1d(c_out, c_out, 3, padding=1, bias=False)
        self.skip = nn.Conv1d(c_in, c_out, 1, stride=stride, bias=False) if (stride, c_in) != (1, c_out) else None

    def forward(self, x):
        h = F.relu(self.n1(x))
        skip = x if self.skip is None else self.skip(h)
        return skip + self.c2(F.relu(self.n2(self.c1(h))))


class Mnist1dResNet(nn.Module):
    """1-D ResNet for MNIST-1D (length 40): a conv stem, stages of residual blocks (channels doubling and length
    halving from the second stage on), global average pooling, a linear classifier."""

    def __init__(self, channels: int = 32, blocks: tuple = (2, 2, 2)):
        super().__init__()
        self.stem = nn.Conv1d(1, channels, 3, padding=1, bias=False)
        layers, c = [], channels
        for i, n in enumerate(blocks):
            c_out = channels * 2 ** i
            for j in range(n):
                layers.append(ResBlock1d(c, c_out, stride=2 if (i > 0 and j == 0) else 1))
                c = c_out
        self.blocks = nn.Sequential(*layers)
        self.norm = nn.GroupNorm(8, c)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        h = self.blocks(self.stem(x.view(x.shape[0], 1, -1)))
        return self.fc(F.relu(self.norm(h)).mean(-1))


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


LM_SIZE = {"context": 64, "width": 128, "layers": 5, "heads": 4}
LM_EVAL_WINDOWS = 64


@registry.register("stdlib-lm")
def stdlib_lm() -> Workload:
    """Byte-level transformer LM on the Python standard library's source; target validation loss 2.25 nats/byte.

    Data: `lm.corpus()` (the interpreter's own top-level stdlib `*.py`, 4 MiB cap, every 10th file validation;
    `extra["corpus_sha256"]` fingerprints it). Samples: 64-byte windows at stride 64 (~59 k training windows),
    y = x shifted by one byte; evaluation: 64 fixed windows spread over the validation files (4 096 bytes).
    Model: `lm.ByteLM` context 64, width 128, 5 layers, 4 heads (1.07 M parameters); batch 8 windows per worker.
    Optimizer: AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0.1 (lr 2e-3 and 4e-3 trained worse, 5e-4 the
    same); `make_optimizer(optimizer="sgd")`: SGD lr 0.1, momentum 0.9 (lr 0.5 diverges, 0.2 is slower), what
    the algorithms that compensate SGD only (DTS, CD-SGD, ...) run with here. Re-checked for them (one process,
    batch 8, 200 steps, loss after 200): momentum 0.9 at lr 0.1 2.68, 0.2 2.89, 0.3 2.91; 0.95 at 0.05 2.81;
    plain SGD at the same effective rate does not do (lr 0.3 3.18, 0.5 3.43, 1.0 NaN), so they keep momentum 0.9
    and the planner keeps their staleness within its bound under momentum (`CostFamily.max_staleness`:
    DTS (t-1)p <= 3, CD-SGD k <= 2; CD-SGD at k = 5 diverges on this workload).
    Target: 2.25 nats (3.25 bits/byte). On `lan` with 4 workers, seeds 0/1/2 reached it at 450/450/525 steps
    without communication (`local`) and 225/275/225 with `bsp`; the no-communication run stops improving fast
    later (2.00-2.12 at 800-1 000 steps). At the ~0.2 s (idle) to ~0.4 s (loaded) per step measured here, the
    slowest seed of `local` is at the target after 1.7-3.5 min of training. See docs/workloads.md.
    """
    x, y, xv, yv, info = lm.lm_data(LM_SIZE["context"], LM_EVAL_WINDOWS)
    return Workload("stdlib-lm", (x, y, xv, yv), lambda: lm.ByteLM(**LM_SIZE), metric="loss", target=2.25,
                    batch_size=8, lr=1e-3, momentum=0.9, epochs=0.5, optimizer="adamw",
                    optim={"adamw": {"beta2": 0.95, "weight_decay": 0.1}, "sgd": {"lr": 0.1, "momentum": 0.9}},
                    loss_fn=lm.lm_loss, eval_fn=lm.evaluate, derived={"bits_per_byte": lm.bits_per_byte},
                    doc=stdlib_lm.__doc__, extra=dict(info))


MNIST1D_BIG = {"num_samples": 50000, "train_split": 0.8}   # 40 000 train / 10 000 test
MNIST1D_TEST = 2000                                          # the test samples evaluated (the first of the 10 000)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 500) -> float:
    """Accuracy, forward in chunks (a 1-D CNN over 2 000 samples at once is ~1.7x slower than in chunks of 500)."""
    hits = sum(int((model(x[i:i + chunk]).argmax(1) == y[i:i + chunk]).sum()) for i in range(0, len(x), chunk))
    return hits / len(x)


@registry.register("mnist1d-resnet")
def mnist1d_resnet() -> Workload:
    """MNIST-1D, 40 000 train / 2 000 test generated offline, 1-D ResNet; target test accuracy 0.9."""
    x, y, xt, yt = mnist1d_data(**MNIST1D_BIG)
    return Workload("mnist1d-resnet", (x, y, xt[:MNIST1D_TEST], yt[:MNIST1D_TEST]), lambda: Mnist1dResNet(48),
                    target=0.9, lr=0.02, momentum=0.9, epochs=10, batch_size=32, eval_fn=_accuracy,
                    doc=mnist1d_resnet.__doc__, extra={"mnist1d_args": dict(MNIST1D_BIG), "test_samples": MNIST1D_TEST})


def get(name: str) -> Workload:
    """The workload `name` (built-in) or `module:function` / `path/to/file.py:function` (yours)."""
    return registry.get(name)
