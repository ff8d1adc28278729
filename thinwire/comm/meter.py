"""Byte and time accounting of a Transport: per operation kind, in total, and per training step."""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

FIELDS = ("ops", "bytes_sent", "bytes_recv", "real_s", "emulated_s", "bytes_across")


@dataclass
class Meter:
    """Counters of one rank's traffic: `bytes_sent` / `bytes_recv`, what it puts on / takes off the wire under the
    algorithm that runs (a ring all-reduce sends 2(n-1)/n of the payload, an all-gather n-1 blocks, padding and size
    headers included); of those, `bytes_across` over a two-tier network's thin link (`Islands`); `emulated_s`, each
    op's emulated network time (α + β, jitter, loss); `real_s`, the loopback time; `wait_s`, the time the caller was
    blocked waiting (the exposed, non-overlapped part)."""

    by_kind: dict = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(FIELDS, 0.0)))
    wait_s: float = 0.0
    _last: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, sent: float, recv: float, real_s: float = 0.0, emulated_s: float = 0.0,
               across: float = 0.0) -> None:
        with self._lock:
            row = self.by_kind[kind]
            for k, v in zip(FIELDS, (1, sent, recv, real_s, emulated_s, across)):
                row[k] += v

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def totals(self) -> dict:
        with self._lock:
            out = {k: sum(row[k] for row in self.by_kind.values()) for k in FIELDS}
            out["wait_s"] = self.wait_s
        return out

    @property
    def bytes_sent(self) -> float:
        return self.totals()["bytes_sent"]

    def mark_step(self) -> dict:
        """Close a training step: returns what was counted since the previous mark."""
        now = self.totals()
        delta = {k: now[k] - self._last.get(k, 0.0) for k in now}
        self._last = now
        return delta

    def to_dict(self) -> dict:
        with self._lock:
            kinds = {k: dict(v) for k, v in self.by_kind.items()}
        return {"total": self.totals(), "by_kind": kinds}
