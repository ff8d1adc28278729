"""Your own workload: a module whose function `make()` returns a
`thinwire.Workload` (the model, the data, the loss, the metric and its
target). Here a small convolutional net on scikit-learn's 8x8 digits (bundled
with scikit-learn: no download), served by a `torch.utils.data.Dataset`, with
its own optimizer.

    thinwire train --workload examples/my_workload.py:make \\
        --workers 2 --steps 60
    thinwire compare --workload examples/my_workload.py:make \\
        --algorithms "bsp;localsgd;diloco" --network wan --workers 4 --budget 20

thinwire imports this file in every worker and calls `make()` there (the data
never travel between processes); it deals the training samples out by rank
and batches them (`batch_size` per worker).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import thinwire as tw


class Digits(torch.utils.data.Dataset):
    """The digits as (image, label) samples: 1 497 to train on, 300 held out."""

    def __init__(self, train: bool):
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16
        y = torch.tensor(labels)
        part = slice(300, None) if train else slice(None, 300)
        self.x, self.y = x[part], y[part]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build():
    """The model; each worker builds it after seeding torch alike."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def make():
    return tw.Workload(
        name="digits-convnet",
        data=(Digits(train=True), Digits(train=False)),
        build=build,
        loss_fn=F.cross_entropy,     # (model output, labels) -> loss
        metric="accuracy",           # argmax of the output == label
        target=0.93,                 # on the held-out samples
        batch_size=32,
        epochs=5,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )
