"""The Trainer's resilience, acting on one `Trainer`'s components and counters (`step_count`, `failures`, `joins`):
every member starts from rank 0's model (`broadcast_model`, at start-up and after a loss); with
`on_failure="continue"` the survivors of a lost worker form a new group, agree on the step and go on (`recover`;
docs/reliability.md, "Faults injected and their outcomes"); in an elastic job (`thinwire.comm.elastic`) newcomers
join at the algorithm's synchronization boundaries and take a live member's state (`boundary`, `welcome`;
docs/reliability.md, "Workers that join a running job").

Its torch.distributed calls are the transport's control-plane verbs (`Transport.agree_max`, `Transport.share`,
`Transport.regroup_to`: neither metered nor emulated); `watched` turns an error of one into the `PeerLost` that an
elastic job's loss is, as a Transport's wait does.
"""
from __future__ import annotations

import torch

from ..comm import elastic
from ..comm.engine import ENGINE
from ..comm.membership import MEMBERSHIP, PeerLost
from ..comm.state import broadcast_state
from ..tensors import digest


class Resilience:
    """Joins and recovery for `trainer` (a `thinwire.Trainer`); `behind` counts the steps this member skips to
    rejoin the survivors' step count after a loss (nothing is applied in them)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.behind = 0

    def model_tensors(self, trained: bool = True) -> list[torch.Tensor]:
        """The model's parameters and buffers; without `trained`, the parameters that require no gradient only."""
        model = self.trainer.model
        params = [p for p in model.parameters() if trained or not p.requires_grad]
        return [t.data for t in params + list(model.buffers())]

    def broadcast_model(self) -> None:
        """Start every worker from rank 0's model (as DDP does); not counted as training traffic."""
        transport = self.trainer.transport
        if transport.world_size == 1:
            return
        with torch.no_grad():
            self.watched(transport.share, self.model_tensors())

    def watched(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` outside the Transport's metered ops (a control-plane verb, the algorithm's
        `after_join`): in an elastic job a peer lost meanwhile is a `PeerLost`, as in a Transport's wait."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if self.trainer.elastic is None:
                raise
            lost = MEMBERSHIP.wait_change(self.trainer.transport.generation or 0, 30.0)
            if lost is None:
                raise
            raise lost from e

    # -- a lost worker (on_failure="continue") --------------------------------------------------------------------
    def recover(self, lost: PeerLost, counted: int | None = None) -> None:
        """With `on_failure="continue"`, the survivors of `lost` form a new group and go on (else `lost` is raised):
        the interrupted step is abandoned everywhere, every survivor takes the new rank 0's model and optimizer
        state, and a survivor that got less far skips the steps it is behind (so every rank's loop issues the
        same operations again). A loss during the recovery starts it again, with the newer membership."""
        t = self.trainer
        if t.on_failure != "continue":
            raise lost
        counted = t.step_count + 1 if counted is None else counted
        while True:
            try:
                ENGINE.abandon(lost)
                if t.elastic is not None:     # the newest generation's own group (it may take newcomers in)
                    previous = t.elastic.members
                    rec = t.elastic.regroup(lost.generation)
                    self._regrouped(rec, previous)
                else:
                    t.transport.regroup_to(lost.members, lost.generation)
                self._resync(lost, counted)
                return
            except PeerLost as again:
                lost = again

    def _resync(self, lost: PeerLost, counted: int) -> None:
        """After a loss, on the new group: agree on the step (the most any member has counted once `counted`, this
        member's, ends; a member behind skips the steps it lacks), and every member takes rank 0's model,
        optimizer state and algorithm state. A newcomer (`counted` 0) starts at the agreed step.

        Where the algorithm `keeps_local_work` (local SGD, DiLoCo) and every member counted the same step (the
        loss met at the same synchronization, no newcomer), the survivors keep their own models and optimizer
        state instead: the work since the last boundary goes into the next average (`"kept"` in the record)."""
        t = self.trainer
        t.scheduler.discard_step()
        at = torch.tensor([float(counted), -float(counted)], dtype=torch.float64, device=t.transport.device)
        self.watched(t.transport.agree_max, at)
        agreed, least = (int(v) for v in at.tolist())      # host: once per recovery
        kept = t.algorithm.keeps_local_work and -least == agreed
        if counted == 0:
            t.step_count = agreed
        else:
            self.behind = agreed - counted
        if not kept:
            self.broadcast_model()
            # tensors and a checked JSON layout, never a pickle (comm/state.py)
            mine = t.optimizer.state_dict() if t.transport.rank == 0 else None
            if t.elastic is not None:     # (a group of its own: addressed through the transport)
                state = elastic.broadcast_state(t.transport, mine, 0)
            else:
                state = broadcast_state(mine, src=t.transport.global_of(0), group=t.transport.group,
                                        device=t.transport.device)
            t.optimizer.load_state_dict(state)
        # "step": the step every survivor has counted once this one ends (and behind ranks skipped theirs)
        record = {"lost": lost.lost, "step": agreed, "members": lost.members, "kept": kept}
        shared = t.algorithm.replicated()
        if shared:      # whether recover() need send rank 0's (one digest agreed on, not the state over the link)
            record["alike"] = self.watched(t.transport.alike, [digest(shared)])[0]
        t.failures.append(record)
        t.algorithm.recover()

    # -- elastic jobs: newcomers (docs/reliability.md, "Workers that join a running job") -----------------------
    def describe(self, params: dict) -> dict:
        """What every member of an elastic job must share, JSON-able: a newcomer that differs is refused."""
        t = self.trainer
        return {"algorithm": t.algorithm.name, "algorithm parameters": dict(sorted(params.items())),
                "compressor": t.compressor.name, "memory": t.memory.name,
                "optimizer": type(t.optimizer).__name__,
                "optimizer settings": [{k: v for k, v in sorted(g.items()) if k != "params"}
                                       for g in t.optimizer.param_groups],
                "model": [[name, list(p.shape), str(p.dtype)] for name, p in t.model.named_parameters()]}

    def boundary(self) -> None:
        """A synchronization boundary of the algorithm: admit newcomers (rank 0), switch to a join generation
        whose boundary this is (every member), or survive a loss announced since (this step is counted: it
        ended at the boundary). A newcomer lost while it takes its state is such a loss."""
        t = self.trainer
        try:
            if not t.elastic.boundary(t.step_count, t.algorithm.join_after):
                return
            t.algorithm.before_switch()          # e.g. DTS applies every average in flight
            previous = t.elastic.members
            rec = t.elastic.switch()
            self._regrouped(rec, previous)
            if rec["kind"] == "loss":               # a loss while the group formed: as any loss
                lost = sorted(set(previous) - set(rec["members"]))
                self._resync(PeerLost(t.elastic.gen, rec["members"], lost), t.step_count)
            else:
                self.welcome(rec, previous)
        except PeerLost as lost:
            self.recover(lost, t.step_count)

    def _regrouped(self, rec: dict, previous: list) -> None:
        t = self.trainer
        t.transport.regroup(t.elastic.group, t.elastic.gen)
        t.elastic.retire_old()
        t.algorithm.regrouped()
        new = [m for m in rec["members"] if m not in previous]
        if new:
            t.joins.append({"joined": new, "step": t.step_count, "members": list(rec["members"])})

    def welcome(self, rec: dict, previous: list) -> None:
        """A join generation formed: rank 0 hands each newcomer its state (point to point, tensors behind a JSON
        manifest); the others keep theirs. A newcomer pulled into a loss generation goes through the loss's
        resynchronisation with everyone instead, as does a newcomer whose generation loses a member while it
        takes its state (the members' side of that is `boundary`'s)."""
        t = self.trainer
        newcomer = not previous
        try:
            if rec["kind"] == "loss":
                self._resync(PeerLost(t.elastic.gen, rec["members"], rec.get("lost", [])), 0)
                return
            # an algorithm whose inner state is each worker's own (DiLoCo) hands θ over in its own state: the
            # newcomer's trained parameters come from there, its optimizer starts afresh at rank 0's settings
            whole = not t.algorithm.inner_state_own
            if newcomer:
                state = elastic.recv_state(t.transport, 0)
                t.step_count = int(state["step"])
                with torch.no_grad():
                    for mine, v in zip(self.model_tensors(whole), state["model"]):
                        mine.copy_(v)
                t.optimizer.load_state_dict(state["optimizer"])
                t.algorithm.take_newcomer_state(state["algorithm"])
            elif t.transport.rank == 0:
                optimizer = t.optimizer.state_dict()
                state = {"step": t.step_count, "model": self.model_tensors(whole),
                         "optimizer": optimizer if whole else {"state": {}, "param_groups": optimizer["param_groups"]},
                         "algorithm": t.algorithm.newcomer_state()}
                for r in [rec["members"].index(m) for m in rec["members"] if m not in previous]:
                    elastic.send_state(t.transport, state, r)
            self.watched(t.algorithm.after_join)
        except PeerLost as lost:
            if not newcomer:
                raise
            self.recover(lost, 0)       # with the others, from the newer generation: at the step they agree
