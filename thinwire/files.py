"""Files: written whole or not at all, JSON and PNG outputs, and directories checked before any work starts
(utilities every layer may import)."""
from __future__ import annotations

import json
import os
import tempfile

from .errors import UserError


def atomic_write(path: str, data: str | bytes) -> None:
    """Write `data` (text or bytes) to `path` through a temporary file and a rename: never half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)


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


def check_writable_file(path, flag: str) -> None:
    """`path` is a file this process may write (or create): not a directory, in a directory it can write in."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise UserError(f"{flag} needs a file name, got {path!r}")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path!r} names a directory, not a file")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)


def check_writable_dir(path, flag: str) -> None:
    """`path` is a directory this process can write in, or one it can create: else a UserError naming `flag`.
    Run before any worker starts, so that no result is lost to a bad path after training. Creates nothing
    (a probe file in the nearest existing directory comes and goes)."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise UserError(f"{flag} needs a directory name, got {path!r}")
    probe, missing = os.path.abspath(path), []
    while not os.path.lexists(probe):
        probe, name = os.path.split(probe)
        missing.append(name)
    if not os.path.isdir(probe):
        what = "names a file" if probe == os.path.abspath(path) else f"lies under the file {probe!r}"
        raise UserError(f"{flag} {path!r} {what}, not a directory")
    try:
        longest = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    if any(len(name.encode()) > longest for name in missing):
        raise UserError(f"{flag} {path!r}: a name in it is longer than {longest} bytes")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".thinwire-probe-")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {probe!r} ({e.strerror or e})") from None
