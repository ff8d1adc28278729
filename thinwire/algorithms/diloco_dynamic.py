"""Dynamic local updates for DiLoCo (`diloco dynamic=true`): each worker's inner steps per round follow its speed,
so the round's syncs arrive together and no worker waits for a slower one (Liu et al. 2024, "Asynchronous
Local-SGD Training for Language Modeling", arXiv 2401.09135, §4.2, Dynamic Local Updates:
H_i = ⌊H · v_i / max_j v_j⌋, v_i worker i's steps per second; here rounded, at least F, a multiple of F).

Worker i's round r has H_i inner steps (the fastest worker's H is `period`), its fragments synced every
K_i = H_i / F of them, each pseudo-gradient taken τ_i = round(τ · H_i / H) steps before its merge; every worker
merges the same fragments in the same order, so the syncs (collectives) match. The merge weights each replica by
the samples of its round (Decoupled DiLoCo's token-weighted merge): its pseudo-gradient is sent as
w_i Δ_i with w_i = n H_i / Σ_j H_j, so the exchange's mean is Σ_j H_j Δ_j / Σ_j H_j. With equal speeds every
H_i = H and w_i = 1: DiLoCo.

Speeds are measured: the busy time of each round (the worker's own steps, each from its training forward to its
end, the waits of its merges excluded: an evaluation between steps is no step's work), gathered at the round's
planned end with a small all-gather that is left in flight and read at the next round's end, so it costs no
latency. Each worker sends its decayed average (steps and busy time of every round, each older round at half the
weight of the next), so one noisy round (a machine shared with other work) does not set the periods on its own.
A round's H_i thus come from the speeds of the round before the last. The first round would then run at equal H
and the second from it; instead the first round is re-planned early: at step p = ⌊H / 8⌋ (≥ 2) every worker
sends its speed over its steps since the first, and the step r_i by which it will read the others': 2p plus the
steps of its own that a small all-gather takes in the link's model, (n − 1) α, so that a fast worker need not
wait out a slow one's step p and the gather's latency. It reads them at the first step from 2p on where they have
arrived, at the latest at r_i (waiting there), and every H_i is then at least r_i + τ_i + 1, so no worker has
passed its first sync when it learns its H_i (r_i is at most the full round's first sync, less one). The second
round follows these speeds too. `rates` (fixed relative speeds per worker) replaces the measurement: the schedule
is then reproducible, and a checkpoint resumes bitwise.

A merge waits only where it must. Measured speeds still leave the workers' syncs starting apart: a machine's
other work, a worker's evaluation, one step's rounding. Their average arrives when the last of them started plus
the link's time, which a worker that started first would wait for at its merge, τ_i steps after its start. With
measured speeds and an overlap (τ > 0), a merge is instead taken on the first step from its planned one on where
its average has arrived, and at the latest on the step before this worker's next sync starts (that Δ_i must
start from the merged θ): the worker goes on with its inner steps meanwhile, as Streaming DiLoCo's overlap does
for τ steps (Douillard et al. 2025, arXiv 2501.18512, §2.3). The steps between a worker's sync starts stay
H_i, so the weights stay its samples. `late_merges` counts the merges taken after their planned step. With
`rates`, or τ = 0 (DiLoCo's blocking sync), every merge is at its planned step.

A stop the training loop asks for (`request_stop`) travels in the same gather; the round's end that reads a set
flag ends the run on every worker at once (`finished`; `close` merges a sync still in flight, so every worker has
merged the same fragments). A round's planned end is also where a checkpoint is cut, each worker at its own step
(each round's first sync starts after its first step; a sync still in flight is stored with its average): `cut`
names it with a number every worker shares, the fastest worker's steps so far (Σ over the rounds of max_j H_j).
"""
from __future__ import annotations

import math
import time

import torch


class DynamicRounds:
    """Worker `rank`'s schedule of rounds among `world` workers (see the module doc)."""

    def __init__(self, transport, period: int, fragments: int, overlap: int, rates: list[float] | None = None):
        self.t, self.period, self.fragments, self.overlap = transport, period, fragments, overlap
        self.rank, self.world = transport.rank, transport.world_size
        self.rates = rates
        self.speeds = list(rates) if rates is not None else [1.0] * self.world   # known speeds (relative)
        self.start = 0                       # the step that ended the last round (its planned last merge)
        self.floats = rates is None and overlap > 0     # a merge waits only where it must (module doc)
        self.awaiting: tuple[int, int] | None = None   # (fragment, its planned merge step) of the sync in flight
        self.late = 0                        # merges taken after their planned step (their sync arrived later)
        self.periods = [period] * self.world  # H_j of the current round
        self.stop_wanted = False            # the loop asked to stop (sent with the next gather)
        self.finished = False               # a round's end read a stop: every worker ends after it
        self.history: list[list[int]] = []  # H_j of every round (the replay's schedule)
        self.cut: int | None = None         # after a round's last step: the fastest worker's steps (module doc)
        if rates is not None:               # known from the start: the first round follows them too
            self._plan()
        self._gather = None                 # the all-gather of the last round's end, read at the next
        self._got: list | None = None       # ... or its values, where a checkpoint waited for it
        self._busy, self._steps, self._last = 0.0, 0, None
        self._decayed = (0.0, 0.0)          # (busy s, steps) of the rounds before, each older one halved
        probe = max(2, period // 8)         # the first round's early speed gather (module doc), where it fits
        self._latest_read = period // fragments - self._lead(period) - 1    # (before a full round's first sync)
        self.probe = probe if rates is None and self._latest_read >= 2 * probe else 0
        self._read_by = 0                   # the step by which this worker reads the probe (module doc)

    # -- the schedule ----------------------------------------------------------------------------------
    @property
    def own(self) -> int:
        return self.periods[self.rank]

    @property
    def lead(self) -> int:
        """τ_i: the steps a fragment's pseudo-gradient is taken before its merge, scaled like H_i."""
        return self._lead(self.own)

    def _lead(self, period: int) -> int:
        return min(period // self.fragments - 1, round(self.overlap * period / self.period))

    def merging(self, step: int) -> int | None:
        """The fragment whose merge is planned after step `step` in this round, or None."""
        local, k = step - self.start, self.own // self.fragments
        return None if local <= 0 or local % k or local > self.own else (local // k - 1) % self.fragments

    def starting(self, step: int) -> int | None:
        return self.merging(step + self.lead)

    def started(self, fragment: int, step: int) -> None:
        """Step `step` started `fragment`'s sync: its merge is planned τ_i steps later."""
        self.awaiting = (fragment, step + self.lead)

    def merge_now(self, step: int, arrived: bool) -> int | None:
        """(after step `step`; `arrived`: the sync in flight has) The fragment to merge now, or None. A round's
        planned end comes first: the gather read, the next round's H_j set. The sync in flight merges at its
        planned step, or with measured speeds at the first step from then on where it has arrived, at the latest
        the step before the next sync starts."""
        if step == self.start + self.own:
            self._end_round(step)
        if self.awaiting is None:
            return None
        f, planned = self.awaiting
        if step < planned or (self.floats and not arrived and step + 1 < self._next_start(planned)):
            return None
        self.awaiting, self.late = None, self.late + (step > planned)
        return f

    def _next_start(self, after: int) -> int:
        """The first step after `after` that starts a sync, in the current round's plan."""
        k = self.own // self.fragments
        starts = [self.start + (g + 1) * k - self.lead for g in range(self.fragments)]
        return min((s for s in starts if s > after), default=after + 1)

    @property
    def weight(self) -> float:
        """w_i = n H_i / Σ_j H_j: the exchange's mean then weights each replica by the samples of its round."""
        return self.world * self.own / sum(self.periods)

    # -- busy time -----------------------------------------------------------------------------------------
    def stepped(self, step: int, merge_s: float = 0.0, began: float | None = None) -> None:
        """Step `step` ended (`merge_s`: the time its merge waited, not the worker's own work; `began`: when its
        training forward began, so that what the loop does between steps, an evaluation, is not counted; without
        it, the time since the last step ended)."""
        now = time.perf_counter()
        if self._last is not None:      # (from the second step: the first one's includes the warm-up)
            self._busy += now - (self._last if began is None else began) - merge_s
            self._steps += 1
        self._last = now
        if self.probe and self.start == 0 and not self.history:
            if step == self.probe:                          # the first round's speeds, sent early ...
                speed = self._speed()
                self._read_by = min(2 * self.probe + math.ceil(self._gather_s() * speed), self._latest_read)
                self._send(speed, False, self._read_by)
            elif self._read_by and step >= 2 * self.probe and (step == self._read_by or self._gather.is_completed()):
                self.drain()                                # ... and read: the first round re-planned
                got, self._got, self._read_by = self._got, None, 0
                self.speeds = [max(v[0], 1e-9) for v in got]
                self._plan(least=[int(v[2]) for v in got])
                self._last = time.perf_counter()            # (a wait is no one's work)
        self.cut = sum(max(h) for h in self.history) if self.history and step == self.start else None

    def _speed(self) -> float:
        """This worker's steps per second of its own work, the older rounds decayed (see the module doc)."""
        busy, steps = self._decayed[0] + self._busy, self._decayed[1] + self._steps
        return steps / busy if busy > 0 and steps else 0.0

    def _gather_s(self) -> float:
        """A small all-gather's time in the link's model, (n − 1) α (0 where the link is not modelled)."""
        link = getattr(self.t, "collective_link", None)
        return (self.world - 1) * link.alpha if link is not None else 0.0

    def _send(self, speed: float, stop: bool, *more: float) -> None:
        mine = torch.tensor([speed, float(stop), *more], dtype=torch.float64, device=self.t.device)
        self._gather = self.t.all_gather(mine, sizes=[mine.numel()] * self.world, async_op=True)

    def _end_round(self, step: int) -> None:
        """The round's planned end, at `step`: read the last gather (speeds, stop flags), start this round's, and
        set the next round's H_j."""
        self.drain()
        got, self._got = self._got, None
        if got is not None:
            if self.rates is None:
                self.speeds = [max(v[0], 1e-9) for v in got]
            self.finished = any(v[1] > 0 for v in got)
        self._send(self._speed(), self.stop_wanted)
        self._decayed = ((self._decayed[0] + self._busy) / 2, (self._decayed[1] + self._steps) / 2)
        self._busy, self._steps = 0.0, 0
        self.history.append(list(self.periods))
        self.start = step
        self._plan()

    def _plan(self, least: list[int] | None = None) -> None:
        """H_j = ⌊H v_j / max v⌉, at least F and a multiple of F (Liu et al. 2024 §4.2, rounded); re-planned
        within a round, every H_j leaves its first sync (τ_j steps before its first merge) after step `least[j]`,
        where worker j read the plan."""
        fastest, f = max(self.speeds), self.fragments
        periods = [max(f, round(self.period * s / fastest / f) * f) for s in self.speeds]
        for j in range(self.world if least else 0):
            while periods[j] < self.period and periods[j] // f - self._lead(periods[j]) <= least[j]:
                periods[j] += f
        self.periods = periods

    def drain(self) -> None:
        """Wait for the gather in flight; its values are read at the next round's end (every worker reads them
        there, whenever it waited)."""
        if self._gather is not None:
            self._got = torch.stack([t.reshape(-1) for t in self._gather.wait()]).tolist()   # host: once per round
            self._gather = None

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.drain()
        return {"start": self.start, "periods": list(self.periods), "speeds": list(self.speeds),
                "awaiting": None if self.awaiting is None else list(self.awaiting), "late": self.late,
                "history": [list(h) for h in self.history], "got": self._got, "decayed": list(self._decayed)}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.periods = int(state["start"]), [int(p) for p in state["periods"]]
        self.speeds = [float(s) for s in state["speeds"]]
        self.awaiting = None if state.get("awaiting") is None else tuple(state["awaiting"])
        self.late = int(state.get("late", 0))
        self.history = [list(h) for h in state["history"]]
        self._got = state["got"]
        self._decayed = tuple(state.get("decayed", (0.0, 0.0)))
