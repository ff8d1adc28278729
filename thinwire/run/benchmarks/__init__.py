"""Benchmarks behind `thinwire bench NAME`: one module each, with `register(subparsers)` adding its parser.

Each prints numbers and ratios against a baseline measured in the same run (memcpy, PyTorch DDP, the
uncompressed algorithm); `--json` prints them machine-readably.
"""
from __future__ import annotations

import json
import os


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str, dpi: int = 110) -> None:
    """Lay out, write and close a figure."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json(data, directory: str, name: str, indent: int = 1) -> str:
    """`data` as JSON in directory/name (the directory made if need be); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    return path


def emit(data, out: str | None, as_json: bool) -> None:
    """Write `data` as JSON to the file `out` (if given); print it too with `--json`."""
    if out:
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    if as_json:
        print(json.dumps(data, indent=1))
