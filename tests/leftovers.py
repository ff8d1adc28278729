"""Finding processes a run left behind: every process spawned by a run inherits its environment tag."""
from __future__ import annotations

import os


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (e.g. `THINWIRE_TEST_TAG=...`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found
