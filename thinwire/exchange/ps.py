"""The parameter server's exchange: push (compressed, with error feedback) and pull, on `thinwire.comm.ps` messages.

Worker (`PSWorker`, and a `PSExchange` per codec). `PSExchange.start(bucket, key)` is an `Exchange` whose
collective is a push to the servers: its program (on the engine, in submission order, so a bucket is pushed as
soon as backward hands it over: WFBP as in BytePS) cuts the bucket into the servers' slices, passes each through
the memory and compressor (`Exchange.encode`), packs the payload (`wire.pack`) and sends it with a header naming
the codec, the compression step and the model version the gradient was computed on. Its future is the server's
answer, decoded in push order: the bucket's parameters, or with a compressed downlink the worker's copy plus the
decoded update.

Server (`PSServer`). It decodes each push with the codec's `Compressor.context` (what every rank knows),
aggregates with the compressor's own algebra (`aggregate`; the vote for sign compressors) and applies a rule per
bucket:
- "sync": round r of a bucket is applied when every active worker's r-th push of it is in; the mean (Tang, Shi,
  Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A Comprehensive Survey", arXiv
  2003.06307, eq. 6) goes to `update`, and every contributor is answered with the new slice;
- "async": each push is applied as it arrives, x <- x - γ G_i(x_{t-τ}) (Tang et al. eq. 8 in its operational
  form: its printed delay indices disagree), τ = the updates of the bucket applied since the worker's copy;
- "backup": the first n - n_b fresh pushes of a round are averaged (Chen, Pan, Monga, Bengio, Jozefowicz 2016,
  "Revisiting Distributed Synchronous SGD", arXiv 1604.00981); a push computed on an older
  model arrives late and is dropped (answered with the current slice);
- "quorum": the round is released when `quorum` pushes are in, or `grace` seconds after its first push (at least
  one), whatever comes first (Decoupled DiLoCo, Douillard et al. 2026, arXiv 2604.21428: a minimum quorum and a
  grace window); a push that missed a round is not dropped: it opens or joins the next one.
Under any rule, a push older than `max_staleness` updates of its bucket is dropped the same way ("backup": 0).
`update(bucket, param, mean, info)` is the algorithm's (the worker's optimizer, or model averaging), with
info = {"taus": staleness of each contribution, "workers": who contributed, "aux": their headers' aux, "weights",
"parts"}. With `weight` (a push header's aux -> its weight) the contributions of a round are merged as
Σ w_i d_i / Σ w_i (d_i each one decoded, "parts"), else averaged by the codec's algebra ("weights" and "parts"
None). A reply's codec field carries `note(worker, bucket)` where the algorithm gives one (e.g. the fastest
worker's speed), else 0. With `final`, once every worker is done each is answered with the model
(`PSWorker.done(final=True)`).

Compressed downlink (`downlink=`): the server sends each worker C(x - x̂_w), x̂_w that worker's copy, and both
sides add scale·C(...) to x̂_w: server-side error feedback, two-sided as in DoubleSqueeze (Tang et al. 2019). It
converges only with a contraction, E‖C(v) − v‖² < ‖v‖² (Stich & Karimireddy 2019, "The error-feedback
framework"), so `downlink_scale` scales an unbiased compressor of variance ω by 1/(1 + ω) (ibid., Remark 6) and a
biased one by its least-squares factor E⟨C(v), v⟩/E‖C(v)‖² (`compress.base.contractive_scale`).
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any, Callable, NamedTuple

import torch

from ..comm.engine import Future
from ..comm.ps import DONE, PUSH, REPLY, REPLY_TAGS, Header, Mailbox, PSLayout, ServerLoop, send
from ..compress import Compressor, Payload
from ..compress.base import contractive_scale
from ..errors import UserError
from . import wire
from .exchange import Exchange

DROPPED = -1       # a reply's aux: the push was dropped (a backup round finished without it, or too stale)
FINAL = -2         # a reply's aux: the model once every worker is done (PSWorker.done(final=True))


class Push(NamedTuple):
    """A push as the server holds it until it is applied: its codec, payload, version and header aux."""
    codec: int
    payload: Payload
    version: int
    aux: int


def check_uplink(compressor: Compressor) -> None:
    if compressor.aggregation == "custom":
        raise UserError(f"compressor {compressor.name!r} needs rounds summed over every rank and cannot push to a "
                        f"parameter server; use one whose payload travels (aggregation allreduce, allgather or "
                        f"majority: e.g. none, fp16, topk, qsgd, signsgd)")


def downlink_scale(compressor: Compressor) -> float:
    """The factor a compressed downlink applies to C(x - x̂) so that server-side error feedback converges (see the
    module docstring; `compress.base.contractive_scale`)."""
    check_uplink(compressor)
    return contractive_scale(compressor, "downlink compressor", "the server-side error feedback would grow")[0]


def _key(bucket_key: Any, k: int, down: bool = False):
    """The compressor key of server k's slice of a bucket (its memory and shared seeds follow it)."""
    return (bucket_key, k, "down") if down else (bucket_key, k)


# -- worker side ------------------------------------------------------------------------------------------
class PushFuture(Future):
    """The server's answer to one push of a bucket (a flat tensor, the bucket's layout)."""

    def __init__(self, worker: "PSWorker", b: int, sends: list, replies: list):
        self.worker, self.b, self._sends, self._replies = worker, b, sends, replies
        self.accounting = (worker.t.meter, worker.t.tracer, "ps push/pull")
        self._value: torch.Tensor | None = None

    def is_completed(self) -> bool:
        return self._value is not None or (all(m.is_completed() for _, m in self._replies)
                                           and all(s.is_completed() for s in self._sends))

    def result(self) -> torch.Tensor:
        if self._value is None:
            w = self.worker
            with w._lock:                        # answers are decoded in push order
                while self._value is None:
                    w._decode_next()
        return self._value


class PSWorker:
    """A worker's end: its copy of the model as answered (per bucket), the versions it holds, the replies."""

    def __init__(self, transport, layout: PSLayout, keys: list, initial: list[torch.Tensor],
                 downlink: Compressor | None = None):
        self.t, self.layout, self.keys = transport, layout, list(keys)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.held = [x.detach().reshape(-1).clone() for x in initial]      # x̂ per bucket
        self.slices = [layout.slices(x.numel()) for x in self.held]
        K = layout.servers
        self.versions = [[0] * K for _ in self.held]   # the server version of each slice held
        self.base = [list(v) for v in self.versions]   # ... of the model the next gradients are computed on
        self.received = [[0] * K for _ in self.held]   # replies per slice: the downlink's compression step
        self.downlink = downlink
        self.boxes = [Mailbox(transport, layout.server_rank(k), REPLY_TAGS) for k in range(K)]
        self._queue: deque[PushFuture] = deque()   # pushes not decoded yet, in push order
        self._qlock = threading.Lock()      # the queue (a push, inside the engine, never waits for a decode)
        self._lock = threading.RLock()      # decoding, in push order (may wait for replies)
        self.pushes = 0
        self.staleness: Counter = Counter()           # of this worker's pushes of bucket 0 (when known)
        self.dropped = 0
        self.note = 0                                 # the codec field of server 0's last reply (PSServer's note)
        self.closed = False

    def push(self, b: int, step: int, codec: int, bodies: list, aux: int = 0) -> PushFuture:
        """Send server k's body (None: an empty slice) of bucket b, `aux` in its header (the algorithm's use);
        inside a program (the engine's order)."""
        if self.closed:
            raise RuntimeError("push after done()")
        sends, replies = [], []
        for k, body in enumerate(bodies):
            if body is None:
                continue
            sends += send(self.t, self.layout.server_rank(k), Header(PUSH, b, step, self.base[b][k], aux, codec), body)
            replies.append((k, self.boxes[k].expect()))
        fut = PushFuture(self, b, sends, replies)
        with self._qlock:
            self._queue.append(fut)
            self.pushes += b == 0
        return fut

    def _decode_next(self) -> None:
        with self._qlock:
            fut = self._queue[0]
        b = fut.b
        for s in fut._sends:
            s.result()
        got = [(k, *msg.result()) for k, msg in fut._replies]
        every = wire.unpack_all([body for _, _, body in got])      # the K servers' headers in one host read
        for (k, header, _), tensors in zip(got, every):
            lo, hi = self.slices[b][k]
            if self.downlink is None:
                self.held[b][lo:hi] = tensors[0]
            else:
                scale = tensors.pop()
                ctx = self.downlink.context((hi - lo,), self.held[b].dtype, _key(self.keys[b], k, True),
                                            self.received[b][k])
                sent = self.downlink.decompress(Payload(tensors, ctx)).reshape(-1).to(self.held[b].dtype)
                self.held[b][lo:hi] += sent.mul_(scale.reshape(()))      # (kept on the device)
            self.received[b][k] += 1
            self.versions[b][k] = header.version
            if k == 0:
                self.note = header.codec
            if b == 0 and k == 0:
                if header.aux == DROPPED:
                    self.dropped += 1
                elif header.aux != FINAL:
                    self.staleness[header.aux] += 1
        fut._value = self.held[b].clone()
        with self._qlock:
            self._queue.popleft()

    def commit(self) -> None:
        """The model now holds the answers decoded so far: the next gradients are computed on these versions."""
        with self._lock:
            self.base = [list(v) for v in self.versions]

    def drain(self) -> None:
        """Wait for the answers to every push in flight (in push order)."""
        with self._lock:
            while self._queue:
                self._decode_next()

    def done(self, final: bool = False) -> list[PushFuture]:
        """Drain, then tell every server this worker is finished. `final` (servers with `final=True`): the futures
        of every bucket's model as the servers hold it once every worker is done, decoded as answers are."""
        if self.closed:
            return []
        self.drain()
        hs = []
        for k in range(self.layout.servers):
            hs += send(self.t, self.layout.server_rank(k), Header(DONE), None)
        futs = []
        for b in range(len(self.held) if final else 0):
            replies = [(k, self.boxes[k].expect()) for k, (lo, hi) in enumerate(self.slices[b]) if hi > lo]
            futs.append(PushFuture(self, b, [], replies))
        with self._qlock:
            self._queue.extend(futs)
        for h in hs:
            h.wait()
        self.closed = True
        return futs

    def state_dict(self) -> dict:
        """At a quiescent point (drained): the copy it holds, the versions, the downlink steps, the counters."""
        self.drain()
        return {"held": [h.clone() for h in self.held], "versions": self.versions, "base": self.base,
                "received": self.received, "pushes": self.pushes, "staleness": dict(self.staleness),
                "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        for mine, saved in zip(self.held, state["held"]):
            mine.copy_(saved)
        self.versions = [list(v) for v in state["versions"]]
        self.base = [list(v) for v in state["base"]]
        self.received = [list(v) for v in state["received"]]
        self.pushes, self.dropped = int(state["pushes"]), int(state["dropped"])
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})

    def metrics(self) -> dict:
        out = {"ps_pushes": self.pushes, **_staleness(self.staleness)}
        if self.dropped:
            out["dropped"] = self.dropped
        return out


class PSExchange(Exchange):
    """An `Exchange` whose collective is a push to the parameter servers and the pull of their answer: `start(t,
    key)` returns the future of the server's answer for the bucket named `key` (see the module docstring). It
    keeps the exchange's compressor, memory, per-key steps and state; `bind` attaches the worker's end."""

    def __init__(self, transport, compressor="none", memory="none", codec: int = 0, **options):
        super().__init__(transport, compressor, memory, **options)      # (never serial: `start`)
        check_uplink(self.compressor)
        self.codec = codec
        self.worker: PSWorker | None = None

    def bind(self, worker: PSWorker) -> None:
        self.worker = worker
        self.memory.setup(worker.layout.workers)      # the ranks that push: not the servers

    def start(self, tensor: torch.Tensor, key: Any = None, shapes=None, inplace: bool = False, aux: int = 0):
        """The server's answer for the bucket `key` (a future); `aux` goes in the push's header. Never serial: the
        answer waits for the other workers' pushes, and the pushes of later buckets must not wait for it."""
        return self.transport.run(self.program(tensor, key, shapes, inplace, aux), label="ps push/pull",
                                  background=self.background)

    def program(self, tensor: torch.Tensor, key: Any = None, shapes=None, inplace: bool = False, aux: int = 0):
        x = tensor.detach().reshape(-1)
        w = self.worker
        b = w.index[key]
        step = self._begin(x, key)
        bodies = [None if hi == lo else wire.pack(self.encode(x[lo:hi], _key(key, k), step).tensors)
                  for k, (lo, hi) in enumerate(w.slices[b])]     # None: server k's slice is empty
        return w.push(b, step, self.codec, bodies, aux)
        yield  # noqa: unreachable - a program that never waits: the answer is its future


# -- server side ------------------------------------------------------------------------------------------
class PSServer:
    """A server's end: its slice of every bucket, the rule that applies pushes, the replies (module docstring)."""

    RULES = ("sync", "async", "backup", "quorum")

    def __init__(self, transport, layout: PSLayout, keys: list, params: list[torch.Tensor], codecs: list,
                 update: Callable, rule: str = "sync", backups: int = 0, downlink: Compressor | None = None,
                 downlink_scale: float = 1.0, quorum: int = 0, grace: float | None = None,
                 max_staleness: int | None = None, weight: Callable[[int], float] | None = None,
                 note: Callable[[int, int], int] | None = None, final: bool = False):
        if rule not in self.RULES:
            raise UserError(f"unknown PS rule {rule!r}; valid: {', '.join(self.RULES)}")
        self.layout, self.keys, self.params = layout, list(keys), list(params)
        self.codecs, self.update, self.rule, self.backups = list(codecs), update, rule, backups
        # a round ("backup", "quorum") is released with this many pushes (fewer once workers are done)
        self.need = layout.workers - backups if rule == "backup" else quorum
        self.grace, self.weight, self.note, self.final = grace, weight, note, final
        self.max_staleness = 0 if rule == "backup" else max_staleness     # older pushes are dropped
        self.downlink, self.scale = downlink, float(downlink_scale)
        self.k = layout.shard_of(transport.rank)
        n, B = layout.workers, len(self.params)
        self.ref = next((b for b, p in enumerate(self.params) if p.numel()), None)   # counted in the metrics
        self.version = [0] * B
        self.handled = [[0] * B for _ in range(n)]       # pushes of each bucket handled, per worker
        self.pending: list[dict] = [{} for _ in range(B)]   # sync: round -> worker -> item
        self.fresh: list[dict] = [{} for _ in range(B)]     # backup, quorum: worker -> item of this round
        self.opened: list[float | None] = [None] * B        # quorum: when the round's first push came
        self.held = ([[p.detach().reshape(-1).clone() for p in self.params] for _ in range(n)]
                     if downlink is not None else None)
        self.sent = [[0] * B for _ in range(n)]          # downlink compression steps
        self.done = [False] * n
        self.updates = self.gradients = self.dropped = 0
        self.staleness: Counter = Counter()
        self.step = 0                                    # the checkpoint this server was last saved at
        self.loop = ServerLoop(transport, n)

    # -- the loop ------------------------------------------------------------------------------------------
    def serve(self, checkpoint=None, pushes_at: Callable[[int], int] = lambda step: step) -> None:
        """Answer pushes until every worker is done. `checkpoint=(every, total, save)`: the workers checkpoint
        after every `every`-th step before `total`; `save(step)` (which joins their checkpoint barrier) is called
        at the matching cut: every worker's pushes of that step (`pushes_at(step)` per bucket) handled and
        answered, none beyond (the workers wait in the barrier), nothing pending."""
        ticks = [self._expire] if self.rule == "quorum" and self.grace is not None else []
        if checkpoint is not None:
            every, total, save = checkpoint

            def cut() -> bool:
                at = (self.step // every + 1) * every       # the next checkpoint after the last one saved
                if at < total and self._quiet_at(pushes_at(at)):
                    self.step = at
                    save(at)
                    return True
                return False
            ticks.append(cut)
        self.loop.run(self._on_message, (lambda: any([t() for t in ticks])) if ticks else None)

    def _quiet_at(self, pushes: int) -> bool:
        return (all(h[b] == pushes for h in self.handled for b, p in enumerate(self.params) if p.numel())
                and not any(self.pending) and not any(self.fresh) and self.loop.quiet())

    def _on_message(self, w: int, header: Header, body) -> None:
        if header.kind == DONE:
            self.done[w] = True
            for b in range(len(self.params)):
                self._try_sync(b) if self.rule == "sync" else self._try_round(b)
            if self.final and all(self.done):      # every worker (a lost one aside) gets the final model
                for v in range(self.layout.workers):
                    for b, p in enumerate(self.params):
                        if p.numel():
                            self._reply(v, b, FINAL)
            return
        b = header.bucket
        r = self.handled[w][b]
        self.handled[w][b] += 1
        comp = self.codecs[header.codec]
        ctx = comp.context((self.params[b].numel(),), self.params[b].dtype, _key(self.keys[b], self.k), header.clock)
        item = Push(header.codec, Payload(wire.unpack(body), ctx), header.version, header.aux)
        if self.max_staleness is not None and self.version[b] - header.version > self.max_staleness:
            # "backup": a late gradient of a finished round (Chen et al. 2016); else older than the bound
            self.dropped += b == self.ref
            self._reply(w, b, DROPPED)
        elif self.rule == "async":
            self._release(b, {w: item})
        elif self.rule == "sync":
            self.pending[b].setdefault(r, {})[w] = item
            self._try_sync(b)
        else:
            if not self.fresh[b]:
                self.opened[b] = time.monotonic()
            self.fresh[b][w] = item
            self._try_round(b)

    def _try_sync(self, b: int) -> None:
        pend = self.pending[b]      # round r is released when every worker still pushing has pushed it
        while self.version[b] in pend and all(done or w in pend[self.version[b]] for w, done in enumerate(self.done)):
            self._release(b, pend.pop(self.version[b]))

    def _try_round(self, b: int, expired: bool = False) -> None:
        """Release the round of bucket b once it has `need` pushes (fewer once workers are done), or at least one
        when its grace window `expired`: "backup", Chen et al. 2016, x_{t+1} = x_t - γ (1/n) Σ_{i ∈ A_t} G_i,
        A_t the first n arrivals (fresh: τ = 0); "quorum", Decoupled DiLoCo's minimum quorum."""
        need = min(self.need, max(self.done.count(False), 1))
        if self.fresh[b] and (len(self.fresh[b]) >= need or expired):
            self._release(b, self.fresh[b])
            self.fresh[b], self.opened[b] = {}, None

    def _expire(self) -> bool:
        """(the loop's tick, "quorum") Release every round whose grace window has passed; whether one was."""
        now, released = time.monotonic(), False
        for b, t0 in enumerate(self.opened):
            if t0 is not None and now - t0 >= self.grace:
                self._try_round(b, expired=True)
                released = True
        return released

    def _mean(self, items: list[Push], weights: list[float] | None = None) -> tuple[torch.Tensor, list | None]:
        """The mean of the contributions (Tang et al. eq. 6), or their majority vote, by the codec's algebra; with
        `weights` (two contributions or more) Σ w_i d_i / Σ w_i of each one decoded, with those decoded."""
        if weights is not None and len(items) > 1:
            parts = [self.codecs[it.codec].decompress(it.payload).reshape(-1) for it in items]
            total = sum(w * d for w, d in zip(weights, parts))
            return total / sum(weights), parts
        codecs = {it.codec for it in items}
        total = None
        for c in sorted(codecs):
            comp = self.codecs[c]
            mine = [it.payload for it in items if it.codec == c]
            if comp.aggregation == "majority" and len(codecs) == 1:
                return comp.vote(mine).reshape(-1), None
            agg = comp.aggregate(mine).reshape(-1)
            total = agg if total is None else total + agg
        return total / len(items), None

    def _release(self, b: int, got: dict) -> None:
        """Apply the update of the contributions `got` (worker -> item) to bucket b, then answer each contributor
        with its staleness τ (the updates of the bucket applied since the model it computed on)."""
        ws = sorted(got)
        taus = [self.version[b] - got[w].version for w in ws]
        weights = None if self.weight is None else [self.weight(got[w].aux) for w in ws]
        mean, parts = self._mean([got[w] for w in ws], weights)
        self.update(b, self.params[b], mean.to(self.params[b].dtype),
                    {"taus": taus, "workers": ws, "aux": [got[w].aux for w in ws], "weights": weights,
                     "parts": parts})
        self.version[b] += 1
        if b == self.ref:
            self.updates += 1
            self.gradients += len(ws)
            self.staleness.update(taus)
        for w, tau in zip(ws, taus):
            self._reply(w, b, tau)

    def _reply(self, w: int, b: int, aux: int) -> None:
        x = self.params[b].detach().reshape(-1)
        if self.downlink is None:
            body = wire.pack([x])
        else:
            held = self.held[w][b]
            p = self.downlink.compress(x - held, key=_key(self.keys[b], self.k, True), step=self.sent[w][b])
            held += self.downlink.decompress(p).reshape(-1).to(held.dtype).mul_(self.scale)
            body = wire.pack(list(p.tensors) + [torch.tensor([self.scale], dtype=torch.float64, device=x.device)])
        self.sent[w][b] += 1
        note = 0 if self.note is None else self.note(w, b)
        self.loop.reply(w, Header(REPLY, b, self.handled[w][b], self.version[b], aux, note), body)

    # -- state and metrics -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """At a checkpoint cut (`serve`): the slices, versions, counters and the copies the workers hold."""
        if any(self.pending) or any(self.fresh) or not self.loop.quiet():
            raise RuntimeError("PSServer.state_dict outside a checkpoint cut (updates or replies pending)")
        return {"params": [p.detach().clone() for p in self.params], "version": list(self.version),
                "handled": [list(h) for h in self.handled], "sent": [list(s) for s in self.sent],
                "held": None if self.held is None else [[h.clone() for h in hs] for hs in self.held],
                "updates": self.updates, "gradients": self.gradients, "dropped": self.dropped,
                "staleness": dict(self.staleness), "step": self.step,
                "downlink": None if self.downlink is None else self.downlink.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                p.copy_(saved)
        self.version = list(state["version"])
        self.handled = [list(h) for h in state["handled"]]
        self.sent = [list(s) for s in state["sent"]]
        if self.held is not None:
            for mine, saved in zip(self.held, state["held"]):
                for m, s in zip(mine, saved):
                    m.copy_(s)
            self.downlink.load_state_dict(state["downlink"])
        self.updates, self.gradients = int(state["updates"]), int(state["gradients"])
        self.dropped, self.step = int(state["dropped"]), int(state["step"])
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})

    def metrics(self) -> dict:
        out = {"ps_shard": self.k, "ps_shard_size": sum(p.numel() for p in self.params), "ps_updates": self.updates,
               "ps_gradients": self.gradients, **_staleness(self.staleness)}
        if self.rule == "backup" or self.max_staleness is not None:
            out["dropped"] = self.dropped
        return out


def _staleness(hist: Counter) -> dict:
    if not hist:
        return {}
    total = sum(hist.values())
    return {"staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "staleness_mean": sum(k * v for k, v in hist.items()) / total, "staleness_max": max(hist)}
