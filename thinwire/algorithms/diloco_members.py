"""DiLoCo's side of a change of membership (`Membership`, a mixin of `thinwire.algorithms.diloco.DiLoCo`): a lost
worker (`recover`: the sync in flight dropped, θ and the outer optimizer taken from the new rank 0 where the
survivors' differ) and an elastic job's newcomer (it joins at a fragment's merge, with θ, the outer optimizer's
state and the counters of rank 0; its inner optimizer starts afresh).
"""
from __future__ import annotations

import torch

from ..comm.elastic import broadcast_state
from ..errors import UserError
from ..tensors import copy_each


class Membership:
    """The membership hooks of `Algorithm` for DiLoCo (the state it reads is DiLoCo's: θ per segment `anchor`, the
    outer optimizer, the fragment schedule)."""

    @torch.no_grad()
    def recover(self):
        """A worker was lost: the sync in flight is dropped; θ and the outer optimizer's state are taken from the
        new rank 0 where the survivors' differ (a sync that completed on some survivors only cannot leave them
        apart; where a digest of them agrees, nothing crosses the link); each survivor's inner model (its own
        where the Trainer kept the survivors' work, else the new rank 0's) differs from θ and goes into the next
        sync of each fragment; the schedule goes on from the agreed step."""
        if self.island is not None:
            raise UserError("diloco replicas=island does not go on after a lost worker (its island's data parallel "
                            "group lost a member): use on_failure='stop' and resume from a checkpoint")
        self._pending, self._pending_fragment = [], None
        if self.eager_rounds is not None:
            self.eager_rounds.reset()
        for a in self.anchor:
            a.grad = None
        # where the survivors disagree: one message (not one per tensor: a round trip each on a slow link), and a
        # newcomer of an elastic job pulled into the loss's generation, whose outer optimizer has no state yet,
        # takes it whole
        if not self.ctx.failures[-1]["alike"]:
            got = broadcast_state(self.transport, {"anchor": self.anchor, "outer": self.outer.state_dict()}, 0)
            copy_each(self.anchor, got["anchor"])
            self.outer.load_state_dict(got["outer"])
        self.steps = self.ctx.failures[-1]["step"]
        self._dirty = [True] * self.fragments

    def replicated(self):
        """θ and the outer optimizer's state (its momentum; a newcomer's has none yet, so it differs)."""
        outer = self.outer.state_dict()["state"]
        return self.anchor + [v for k in sorted(outer) for v in outer[k].values() if torch.is_tensor(v)]

    # -- elastic jobs: a newcomer joins at a fragment's merge ---------------------------------------------
    def join_boundary(self, step):
        """A step that merged a fragment (nothing is in flight then: at most one fragment is, until its merge)."""
        return self.merging(self.steps) is not None and not self._pending

    def join_after(self, step):
        return step + self.period // self.fragments

    def join_next(self, step):
        """The next merge whose fragment's pseudo-gradient is taken after this step (τ steps before the merge)."""
        if self.eager or self.island is not None:
            return None
        m = self.steps + 1
        while self.merging(m) is None or m - self.overlap <= self.steps:
            m += 1
        return step + m - self.steps

    def newcomer_state(self):
        return {"anchor": self.anchor, "outer": self.outer.state_dict(), "steps": self.steps, "syncs": self.syncs,
                "dirty": list(self._dirty)}

    @torch.no_grad()
    def take_newcomer_state(self, state):
        """θ and the outer optimizer's state of rank 0; the newcomer's inner model is θ in every fragment (it
        joins each fragment's schedule at that fragment's next merge), the counters and flags rank 0's."""
        copy_each(self.anchor, state["anchor"])
        self.outer.load_state_dict(state["outer"])
        for k, a in enumerate(self.anchor):
            self.frags.local(k).copy_(a)
        self.steps, self.syncs, self._dirty = int(state["steps"]), int(state["syncs"]), list(state["dirty"])
