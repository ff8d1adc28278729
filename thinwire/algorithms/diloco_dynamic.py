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

Speeds are measured: the busy time of each segment between two merges (the worker's own steps, the waits of its
merges excluded), gathered at every merge with a small all-gather that is left in flight and read at the next
merge, so it costs no latency. Each worker sends its decayed average (steps and busy time of every segment, each
older segment at half the weight of the next), so one noisy segment (a machine shared with other work) does not
set a round's periods on its own. A round's H_i come from the speeds read at the merge that ends the round before
it (the speeds of the segment before that one). The first round would then run at equal H and the second from
it; instead the first round is re-planned early: at step p = ⌊H / 8⌋ (≥ 2) every worker sends its speed over its
steps since the first, read at step 2p (a fast worker waits there for a slow one's step p, at most what an equal
round would cost it), and H_i are then at least 2p + τ_i + 1, so no worker has passed its first sync. The
second round follows these speeds too. `rates` (fixed relative speeds per worker) replaces the measurement: the
schedule is then reproducible, and a checkpoint resumes bitwise.

A stop the training loop asks for (`request_stop`) travels in the same gather; the merge that reads a set flag
ends the run on every worker at once (`finished`), at a point where every worker has merged the same fragments.
The end of a round is such a point too, with nothing in flight but the gather (each round's first sync starts
after its first step): `cut` names it with a number every worker shares, the fastest worker's steps so far
(Σ over the rounds of max_j H_j), and a checkpoint there resumes every worker at its own step.
"""
from __future__ import annotations

import time

import torch


class DynamicRounds:
    """Worker `rank`'s schedule of rounds among `world` workers (see the module doc)."""

    def __init__(self, transport, period: int, fragments: int, overlap: int, rates: list[float] | None = None):
        self.t, self.period, self.fragments, self.overlap = transport, period, fragments, overlap
        self.rank, self.world = transport.rank, transport.world_size
        self.rates = rates
        self.speeds = list(rates) if rates is not None else [1.0] * self.world   # known speeds (relative)
        self.start = 0                       # the step that ended the last round (its last merge)
        self.periods = [period] * self.world  # H_j of the current round
        self.stop_wanted = False            # the loop asked to stop (sent with the next gather)
        self.finished = False               # a merge read a stop: every worker ends after it
        self.history: list[list[int]] = []  # H_j of every round (the replay's schedule)
        self.cut: int | None = None         # after a round's last step: the fastest worker's steps (module doc)
        if rates is not None:               # known from the start: the first round follows them too
            self._plan()
        self._gather = None                 # the all-gather of the last merge, read at the next
        self._got: list | None = None       # ... or its values, where a checkpoint waited for it
        self._busy, self._steps, self._last = 0.0, 0, None
        self._decayed = (0.0, 0.0)          # (busy s, steps) of the segments before, each older one halved
        probe = max(2, period // 8)         # the first round's early speed gather (module doc), where it fits
        self.probe = probe if rates is None and period // fragments - self._lead(period) > 2 * probe else 0

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
        local, k = step - self.start, self.own // self.fragments
        return None if local <= 0 or local % k or local > self.own else (local // k - 1) % self.fragments

    def starting(self, step: int) -> int | None:
        return self.merging(step + self.lead)

    @property
    def weight(self) -> float:
        """w_i = n H_i / Σ_j H_j: the exchange's mean then weights each replica by the samples of its round."""
        return self.world * self.own / sum(self.periods)

    # -- busy time between merges ------------------------------------------------------------------------
    def stepped(self, step: int, merge_s: float = 0.0) -> None:
        """Step `step` ended (`merge_s`: the time its merge waited, not the worker's own work)."""
        now = time.perf_counter()
        if self._last is not None:
            self._busy += now - self._last - merge_s
            self._steps += 1
        self._last = now
        if self.probe and self.start == 0 and not self.history:
            if step == self.probe:                          # the first round's speeds, sent early ...
                self._send(self._speed(), False)
            elif step == 2 * self.probe:                    # ... and read: the first round re-planned
                self.drain()
                got, self._got = self._got, None
                self.speeds = [max(v[0], 1e-9) for v in got]
                self._plan(least=2 * self.probe)
                self._last = time.perf_counter()            # (the wait is no one's work)
        self.cut = sum(max(h) for h in self.history) if self.history and step == self.start else None

    def _speed(self) -> float:
        """This worker's steps per second of its own work, the older segments decayed (see the module doc)."""
        busy, steps = self._decayed[0] + self._busy, self._decayed[1] + self._steps
        return steps / busy if busy > 0 and steps else 0.0

    def _send(self, speed: float, stop: bool) -> None:
        mine = torch.tensor([speed, float(stop)], dtype=torch.float64, device=self.t.device)
        self._gather = self.t.all_gather(mine, sizes=[2] * self.world, async_op=True)

    def merged(self, step: int) -> None:
        """After the merge at `step`: read the last gather (speeds, stop flags), start this segment's, and at the
        end of a round set the next round's H_j."""
        self.drain()
        got, self._got = self._got, None
        if got is not None:
            if self.rates is None:
                self.speeds = [max(v[0], 1e-9) for v in got]
            self.finished = any(v[1] > 0 for v in got)
        self._send(self._speed(), self.stop_wanted)
        self._decayed = ((self._decayed[0] + self._busy) / 2, (self._decayed[1] + self._steps) / 2)
        self._busy, self._steps = 0.0, 0
        if step - self.start == self.own:          # the round's last merge
            self.history.append(list(self.periods))
            self.start = step
            self._plan()

    def _plan(self, least: int = 0) -> None:
        """H_j = ⌊H v_j / max v⌉, at least F and a multiple of F (Liu et al. 2024 §4.2, rounded); re-planned at
        step `least` of a round, every H_j leaves its first sync (τ_j steps before its first merge) after it."""
        fastest, f = max(self.speeds), self.fragments
        periods = [max(f, round(self.period * s / fastest / f) * f) for s in self.speeds]
        for j in range(self.world if least else 0):
            while periods[j] < self.period and periods[j] // f - self._lead(periods[j]) <= least:
                periods[j] += f
        self.periods = periods

    def drain(self) -> None:
        """Wait for the gather in flight; its values are read at the next merge (every worker reads them there,
        whenever it waited)."""
        if self._gather is not None:
            self._got = torch.stack([t.reshape(-1) for t in self._gather.wait()]).tolist()   # host: once per merge
            self._gather = None

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.drain()
        return {"start": self.start, "periods": list(self.periods), "speeds": list(self.speeds),
                "history": [list(h) for h in self.history], "got": self._got, "decayed": list(self._decayed)}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.periods = int(state["start"]), [int(p) for p in state["periods"]]
        self.speeds = [float(s) for s in state["speeds"]]
        self.history = [list(h) for h in state["history"]]
        self._got = state["got"]
        self._decayed = tuple(state.get("decayed", (0.0, 0.0)))
