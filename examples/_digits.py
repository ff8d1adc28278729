"""The data every example trains on: scikit-learn's 8x8 digits (bundled with scikit-learn, no download)."""
import torch
from sklearn.datasets import load_digits


def digits():
    """(x, y): 1797 images as 64 floats in [0, 1], and their labels."""
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)


def mlp():
    torch.manual_seed(0)                    # the same initial model on every worker
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()
