"""`adpsgd`: asynchronous decentralized parallel SGD (Lian et al. [216]; catalog §2.2.3 (c)).

AD-PSGD's worker loop: read the model x̂_i and compute g = ∇F_i(x̂_i); atomically average with one peer,
x_i, x_j ← (x_i + x_j)/2; apply x_i ← x_i - γ g. The gradient is computed on the model read *before* the
averaging, so the averaging runs while the gradient is computed: no global barrier, each worker waits only for
its current peer.

Here, deadlock-free and deterministic: peers are a matching drawn per step (topology `random`: a random perfect
matching from (seed, step); `ring`: alternating even/odd edges), so every pair posts its isend/irecv together and
nobody waits for a third worker. At the end of step t a worker sends its model x_{t+1} to the peer of step t+1;
the exchange travels while step t+1's gradient is computed on x_{t+1}; step t+1 then sets
x ← (x_{t+1} + x_peer)/2 (the atomic pairwise average, bitwise identical on both peers) and applies the gradient.
`close()` completes the last exchange, then measures consensus and averages (see _gossip).
"""
from __future__ import annotations

from . import register
from ._gossip import Gossip


@register("adpsgd")
class ADPSGD(Gossip):
    """AD-PSGD: pairwise model averaging overlapped with the next gradient (random or ring matching)."""

    compression = False
    topologies = ("random", "ring")

    def __init__(self, topology: str = "random", consensus_every: int = 0, final_average: bool = True,
                 architecture: str | None = None):
        super().__init__(topology, consensus_every, final_average, architecture)
        self.pending = None
        self.pairings = 0

    def gossip_setup(self):
        self._start(0)

    def _start(self, step: int) -> None:
        peer = self.topology.matching(step)[self.rank]
        if peer < 0:
            self.pending = None
            return
        snap = self.flat_params().clone()
        handles, bufs = self.start_exchange(snap, [peer], [peer])
        self.pending = (handles, snap, bufs[peer])

    def _finish(self) -> None:
        if self.pending is None:
            return
        from ..comm.collectives import wait_all
        handles, snap, theirs = self.pending
        wait_all(handles)
        self.set_flat_params((snap + theirs) / 2)  # the atomic pairwise average
        self.pending = None
        self.pairings += 1

    def step(self):
        self._finish()
        self.optimizer_step()
        self.after_step()
        self._start(self.t)

    def drain(self):
        self._finish()

    def metrics(self):
        return {**super().metrics(), "pairings": self.pairings}

    def state_dict(self):
        """Completes the exchange in flight (every rank calls this at the same step) and starts it again."""
        self._finish()
        self._start(self.t)
        return {**super().state_dict(), "pairings": self.pairings}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.pairings = state["pairings"]
