"""A Chrome trace (chrome://tracing, Perfetto) of one worker: complete events ("ph": "X") on named tracks.

Each worker records its own spans with `time.perf_counter()` (a system-wide monotonic clock on Linux, so the
workers' tracks line up); the launcher's side merges the workers' event lists into one file, one process per
worker (`pid` = rank) and one thread per kind of activity.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext

from .files import atomic_write

TRACKS = ("compute", "compress", "communicate", "emulated", "wait", "optimizer", "forward", "backward")
ORDER = ("forward", "backward", "compute", "compress", "communicate", "emulated", "wait", "optimizer")
LANE = 100   # overlapping spans of one track go to extra threads tid + LANE·k, so every thread is well nested


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

    def span(self, name: str, track: str = "compute", **args):
        """A context manager timing its block as one event (nothing at all, not even a generator, when the
        tracer is off: the training path opens spans on every step)."""
        return self._span(name, track, args) if self.enabled else _OFF

    @contextmanager
    def _span(self, name: str, track: str, args: dict):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, start, time.perf_counter(), track, **args)


_OFF = nullcontext()
NULL = Tracer(enabled=False)


def nest(events: list[dict]) -> list[dict]:
    """Move spans that overlap without nesting (asynchronous transfers in flight together) from their
    track's thread to the first lane (tid + LANE·k) where they nest, so viewers draw every span."""
    out = [e for e in events if e.get("ph") != "X"]
    lanes: dict[int, list[list[float]]] = {}     # tid -> per lane: stack of open span ends
    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e["dur"])):
        start, end, tid = e["ts"], e["ts"] + e["dur"], e.get("tid", 0)
        stacks = lanes.setdefault(tid, [])
        for k, stack in enumerate(stacks + [[]]):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                if k == len(stacks):
                    stacks.append(stack)
                stack.append(end)
                out.append(dict(e, tid=tid + LANE * k))
                break
    return out


def write_chrome_trace(path: str, events_by_rank: list[list[dict]]) -> None:
    """Merge the workers' events into one trace file, written atomically."""
    # times from the first event on, before nesting: shifting after it would round ts + dur differently
    # (perf_counter in µs is ~1e10 after a few hours of uptime, where a float64 step is ~2e-6 µs)
    t0 = min((e["ts"] for evs in events_by_rank for e in evs or [] if "ts" in e), default=0.0)
    events: list[dict] = []
    for rank, evs in enumerate(events_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}})
        evs = nest([dict(e, ts=e["ts"] - t0) if "ts" in e else e for e in evs or []])
        for tid in sorted({e.get("tid", 0) for e in evs} | set(range(len(TRACKS)))):
            base = TRACKS[tid % LANE] if tid % LANE < len(TRACKS) else "other"
            name = base if tid < LANE else f"{base} {tid // LANE + 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
            order = ORDER.index(base) if base in ORDER else len(ORDER)
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"sort_index": order * LANE + tid // LANE}})
        events.extend(evs)
    atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
