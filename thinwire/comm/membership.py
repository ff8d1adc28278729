"""Who is still in the job: the membership a worker learns from its launcher when a worker is lost.

With `on_failure="continue"` the launcher does not stop the job when a worker dies: it publishes the new
membership (the surviving original ranks, generation 1, 2, ...) in its rendezvous store, and a watcher thread in
every worker hands it to `announce`. From then on, a wait on an operation of the old group raises `PeerLost`
(at once if it was blocked, or as soon as its error shows), and the `Trainer` forms a new group of the
survivors at that synchronization point and goes on (`thinwire.trainer.Trainer.step`).
"""
from __future__ import annotations

import threading

from ..errors import WorkerError


class PeerLost(WorkerError):
    """A worker of this group was lost; `members` are the surviving original ranks of `generation`."""

    def __init__(self, generation: int, members: list[int], lost: list[int]):
        self.generation, self.members, self.lost = generation, list(members), list(lost)
        super().__init__(lost[0] if lost else -1, f"lost worker(s) {lost}; continuing with ranks {members} "
                                                  f"(membership generation {generation})")


class _Membership:
    def __init__(self):
        self.world: list[int] | None = None   # the original ranks, once a launcher publishes changes (watching)
        self.generation = 0
        self.members: list[int] = []
        self._lost: list[int] | None = None
        self._changed = threading.Condition()

    @property
    def watching(self) -> bool:
        return self.world is not None

    def watch(self, world_size: int) -> None:
        self.world, self.members = list(range(world_size)), list(range(world_size))

    def reset(self) -> None:
        """A new run of an elastic pool: generations count from 0 again, every change comes with its lost ids."""
        with self._changed:
            self.world, self.generation, self.members, self._lost = [], 0, [], None

    def announce(self, generation: int, members: list[int], lost: list[int] | None = None) -> None:
        """Generation `generation` has `members`; `lost`: who left since the last one (default: the original
        ranks not among the members). An elastic job's members are ids that grow (`thinwire.comm.elastic`)."""
        with self._changed:
            if generation > self.generation:
                self.generation, self.members = generation, list(members)
                self._lost = None if lost is None else list(lost)
                self._changed.notify_all()

    def lost(self, since: int) -> PeerLost | None:
        """The change since membership generation `since`, if any."""
        if self.generation <= since:
            return None
        lost = self._lost if self._lost is not None else sorted(set(self.world or []) - set(self.members))
        return PeerLost(self.generation, self.members, lost)

    def wait_change(self, since: int, timeout: float) -> PeerLost | None:
        """Wait up to `timeout` s for a change after `since` (an operation failed: was a peer lost?)."""
        with self._changed:
            self._changed.wait_for(lambda: self.generation > since, timeout)
        return self.lost(since)

    def explain(self, error: BaseException, since: int, timeout: float = 30.0) -> PeerLost | None:
        """The loss that `error` (an operation on a group of membership generation `since` failed) stands for, or
        None. A peer's going away shows in the survivors' operations (gloo's "Connection closed by peer") and in
        the launcher's announcement, in either order: the announcement may have come already (the operation was
        issued after it, on the old group), or it comes within `timeout` s."""
        if isinstance(error, PeerLost):
            return error
        return self.wait_change(since, timeout) if self.watching else None


MEMBERSHIP = _Membership()
