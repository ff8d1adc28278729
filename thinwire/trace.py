"""A Chrome trace (chrome://tracing, Perfetto) of one worker: complete events ("ph": "X") on named tracks.

Each worker records its own spans with `time.perf_counter()` (a system-wide monotonic clock on Linux, so the
workers' tracks line up); the launcher's side merges the workers' event lists into one file, one process per
worker (`pid` = rank) and one thread per kind of activity.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

TRACKS = ("compute", "compress", "communicate", "emulated", "wait", "optimizer")


class Tracer:
    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict] = []

    def complete(self, name: str, start: float, end: float, track: str = "compute", **args) -> None:
        if not self.enabled:
            return
        tid = TRACKS.index(track) if track in TRACKS else len(TRACKS)
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "cat": track,
              "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6}
        if args:
            ev["args"] = args
        self.events.append(ev)

    @contextmanager
    def span(self, name: str, track: str = "compute", **args):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, start, time.perf_counter(), track, **args)


NULL = Tracer(enabled=False)


def write_chrome_trace(path: str, events_by_rank: list[list[dict]]) -> None:
    """Merge the workers' events into one trace file, written atomically."""
    events: list[dict] = []
    for rank, evs in enumerate(events_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}})
        for tid, track in enumerate(TRACKS):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
        events.extend(evs or [])
    t0 = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] -= t0
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
