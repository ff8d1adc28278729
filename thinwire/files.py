"""Files written whole or not at all (a utility every layer may import)."""
from __future__ import annotations

import os


def atomic_write(path: str, data: str | bytes) -> None:
    """Write `data` (text or bytes) to `path` through a temporary file and a rename: never half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)
