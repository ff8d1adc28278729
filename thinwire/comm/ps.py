"""The parameter-server architecture (seed 000 §IV-A; catalog `survey-tang-catalog.md` §2.2.1).

Roles. The world's last K ranks are servers, ranks 0..n-1 are workers (`PSLayout`). The model is one flat
vector split by size into K contiguous shards (sizes differ by at most one element); server k owns shard k.

API (reusable by any algorithm that wants a PS):

    layout = PSLayout(numel, world_size, servers=K)          # layout.is_server(rank), layout.bounds[k]
    # on a server rank:
    server = PSServer(transport, layout, initial_flat_params, optimizer_template, mode="sync", staleness=0,
                      compressor=c, downlink=None)            # mode: "sync" (staleness s, s=0 is BSP),
    server.serve()                                            # "async" (lr_scale) or "backup" (backups=n_b)
    server.metrics()   # ps_updates, ps_gradients, staleness_hist/mean/max, dropped (backup)
    # on a worker rank:
    worker = PSWorker(transport, layout, initial_flat_params, compressor=c, memory=m, downlink=None)
    h = worker.push_pull(flat_grad, async_op=True)           # push a gradient, pull the parameters
    new_flat_params = h.wait()                               # the server's model after this push's rule
    worker.params                                             # the freshest model answered so far
    worker.done()                                             # drain, tell every server this worker is done
    # checkpoints: worker.drain(); worker.state_dict() / server.state_dict() at the cut that
    # server.serve(checkpoint=(every, total, save)) finds; load_state_dict() on a fresh end resumes
Several push_pull handles may be in flight; their answers are applied in push order. The server runs a clone
of `optimizer_template` (its class and param_groups[0] hyper-parameters, lr × lr_scale) on its shard.

Wire format: only tensors cross the wire. Each message is a fixed-layout int64 header (kind, clock, version,
staleness, tensor count, then (dtype code, numel) per tensor) followed by the payload tensors as 1-D tensors,
each sent with Transport.isend/irecv (so the meter counts them and the link emulation queues them). A server
receiving from n workers queues their payloads on its own receive link: incast costs n·Nβ, and its meter shows
n times a worker's bytes.

Compression. Workers compress each shard's gradient with a `thinwire.compress.Compressor` (after the memory's
error-feedback compensation); the server decompresses every contribution with the context of its own
compress() of a zero tensor of the same shape, key and step (ctx holds only what every rank knows), and
aggregates. The optional compressed downlink (`downlink=`) sends each worker C(x - x̂_w), where x̂_w is the
copy that worker holds: the residual x - x̂_w stays at the server and is sent later, i.e. server-side error
feedback, two-sided as in DoubleSqueeze (Tang et al. 2019).

Update. The server applies the worker's optimizer (its class and hyper-parameters, e.g. SGD with lr and
momentum) to its shard. "sync": clock c's update is the mean of the n workers' clock-c gradients
(seed 000 eq. 6), applied when the last one arrives; a worker that pushed clock c gets its reply once clocks
<= c - s are applied (SSP's read rule, catalog §2.1.3 [SUPP]; s = 0 is BSP). The `ssp` algorithm uses s = 0
here and keeps s pushes in flight on the worker instead, which gives the same read rule and hides latency. "async": each gradient is applied
as it arrives, x <- x - γ G_i(x_{t-τ}) (catalog §2.1.5, operational form; eq. 8 as printed is an erratum) and
τ is recorded. "backup": the first n - n_b fresh gradients of a round are averaged, later ones dropped
(catalog §2.1.2).
"""
from __future__ import annotations

import time
from collections import Counter, deque

import torch

from ..errors import UserError


PUSH, DONE, REPLY = 1, 2, 3
TAG_PUSH_HEAD, TAG_PUSH_DATA, TAG_REPLY_HEAD, TAG_REPLY_DATA = 7101, 7102, 7103, 7104
MAX_TENSORS = 8
_FIELDS = 8  # kind, clock, version, staleness, ntensors, 3 reserved
HEADER = _FIELDS + 2 * MAX_TENSORS
DROPPED, PENDING = -1, -2  # staleness field values in a reply
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64]
_POLL_S = 2e-4


def shard_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """K contiguous [lo, hi) ranges covering 0..numel, sizes differing by at most one."""
    base, extra = divmod(numel, k)
    out, lo = [], 0
    for i in range(k):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class PSLayout:
    """Who is a server and which slice of the flat parameter vector each server owns."""

    def __init__(self, numel: int, world_size: int, servers: int = 1):
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise UserError(f"a parameter server needs servers >= 1, got {servers!r}")
        if world_size - servers < 1:
            raise UserError(f"{servers} server rank(s) leave no worker in a world of {world_size}; "
                            f"give --workers n --servers K (world = n + K, n >= 1)")
        if servers > numel:
            raise UserError(f"{servers} servers for {numel} parameters: at most one server per parameter")
        self.numel, self.world_size, self.servers = numel, world_size, servers
        self.workers = world_size - servers
        self.bounds = shard_bounds(numel, servers)

    def server_rank(self, k: int) -> int:
        return self.workers + k

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def shard_of(self, rank: int) -> int:
        return rank - self.workers


# -- messages ---------------------------------------------------------------------------------------------
def _header(kind: int, clock: int = 0, version: int = 0, staleness: int = 0, tensors=()) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise UserError(f"a PS message carries at most {MAX_TENSORS} payload tensors, got {len(tensors)}")
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0], h[1], h[2], h[3], h[4] = kind, clock, version, staleness, len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise UserError(f"payload dtype {t.dtype} cannot cross the PS wire; valid: {_DTYPES}")
        h[_FIELDS + 2 * i] = _DTYPES.index(t.dtype)
        h[_FIELDS + 2 * i + 1] = t.numel()
    return h


def _layout_of(h: torch.Tensor) -> list[tuple[torch.dtype, int]]:
    return [(_DTYPES[int(h[_FIELDS + 2 * i])], int(h[_FIELDS + 2 * i + 1])) for i in range(int(h[4]))]


def _real_done(handle) -> bool:
    """Whether the real (loopback) part of a receive finished, so its buffer holds the data; the emulated
    delivery may still be pending. Lets a receiver post the follow-up receive without paying α twice."""
    handle.is_completed()
    return handle.deadline is not None


def _flat(tensors) -> list[torch.Tensor]:
    """1-D copies: the caller may reuse its buffers while a send is still in flight."""
    return [t.detach().reshape(-1).clone() for t in tensors]


class _Context:
    """Decompression context for payloads from other ranks: this rank's own compress() of zeros (the ctx
    carries only shape/dtype/shared-seed information, per thinwire.compress.base)."""

    def __init__(self, compressor):
        self.compressor = compressor

    def payload(self, tensors, numel, dtype, key, step):
        from ..compress import Payload
        template = self.compressor.compress(torch.zeros(numel, dtype=dtype), key=key, step=step)
        return Payload(list(tensors), ctx=template.ctx)


def check_compressor(compressor, where: str = "uplink") -> None:
    if compressor is not None and getattr(compressor, "aggregation", "allreduce") == "custom":
        raise UserError(f"compressor {compressor.name!r} runs its own collective and cannot go through a "
                        f"parameter server ({where}); use one with aggregation allreduce/allgather/majority "
                        f"(e.g. none, fp16, topk, qsgd)")


# -- worker side ------------------------------------------------------------------------------------------
class PushPull:
    """One push of a gradient and the pull of the parameters it is answered with (a handle)."""

    def __init__(self, worker: "PSWorker", sends: list, replies: list):
        self.worker, self._sends, self._replies = worker, sends, replies  # replies: per server [head, data|None]
        self._result = None

    def _progress(self) -> bool:
        """Post data receives whose header arrived (in FIFO order with earlier handles); True when all is in."""
        done = True
        for k, r in enumerate(self._replies):
            if r[1] is None:
                if not _real_done(r[0]):
                    done = False
                    continue
                r[1] = self.worker._post_data(k, r[0].wait())
            if not all(h.is_completed() for h in r[1]):
                done = False
        return done and all(h.is_completed() for h in self._sends)

    def is_completed(self) -> bool:
        if self._result is not None:
            return True
        if self.worker._queue and self.worker._queue[0] is not self:
            self.worker._queue[0]._progress()
            return False
        return self._progress()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while self.worker._queue[0] is not self:  # answers come back in push order
                self.worker._queue[0].wait()
            t0 = time.perf_counter()
            while not self._progress():
                time.sleep(_POLL_S)
            t1 = time.perf_counter()
            self.worker.t.meter.add_wait(t1 - t0)   # the exposed part of the round trip
            if t1 - t0 > 1e-4:
                self.worker.t.tracer.complete("wait ps push/pull", t0, t1, "wait")
            for h in self._sends:
                h.wait()
            heads = [r[0].wait() for r in self._replies]
            datas = [[h.wait() for h in r[1]] for r in self._replies]
            self._result = self.worker._apply_replies(heads, datas)
            self.worker._queue.popleft()
        return self._result


class PSWorker:
    """A worker's end of the PS: push (compressed) gradients, pull parameters."""

    def __init__(self, transport, layout: PSLayout, initial: torch.Tensor, compressor=None, memory=None,
                 downlink=None):
        from ..compress import compressors, memories
        self.t, self.layout = transport, layout
        self.compressor = compressor if compressor is not None else compressors.get("none")
        self.memory = memory if memory is not None else memories.get("none")
        self.downlink = downlink if downlink is not None and downlink.name != "none" else None
        check_compressor(self.compressor)
        check_compressor(self.downlink, "downlink")
        if hasattr(self.memory, "setup"):
            self.memory.setup(layout.workers)
        self.params = initial.detach().clone()   # x̂: the model this worker holds
        self.dtype = self.params.dtype
        self._down_ctx = _Context(self.downlink) if self.downlink else None
        self.clock = 0
        self.versions = [0] * layout.servers     # the server version of each shard this worker holds
        self.staleness = Counter()               # staleness of this worker's applied updates (when known)
        self.dropped = 0
        self._queue: deque[PushPull] = deque()
        self._closed = False

    def push_pull(self, flat_grad: torch.Tensor, async_op: bool = False):
        if self._closed:
            raise RuntimeError("push_pull after done()")
        sends, replies = [], []
        for k, (lo, hi) in enumerate(self.layout.bounds):
            dst = self.layout.server_rank(k)
            g = flat_grad[lo:hi]
            key = ("ps", k)
            comp = self.memory.compensate(g, key)
            payload = self.compressor.compress(comp, key=key, step=self.clock)
            sent = self.compressor.decompress(payload)
            self.memory.update(comp, key, sent)
            tensors = _flat(payload.tensors)
            head = _header(PUSH, self.clock, self.versions[k], 0, tensors)
            sends.append(self.t.isend(head, dst, tag=TAG_PUSH_HEAD))
            sends += [self.t.isend(x, dst, tag=TAG_PUSH_DATA) for x in tensors]
            rhead = torch.empty(HEADER, dtype=torch.int64)
            rh = self.t.irecv(rhead, dst, tag=TAG_REPLY_HEAD)
            data = None
            if self.downlink is None:  # sizes known: post the data receive now (one α, not two)
                data = [self.t.irecv(torch.empty(hi - lo, dtype=self.dtype), dst, tag=TAG_REPLY_DATA)]
            replies.append([rh, data])
        self.clock += 1
        h = PushPull(self, sends, replies)
        self._queue.append(h)
        return h if async_op else h.wait()

    def _post_data(self, k: int, head: torch.Tensor) -> list:
        src = self.layout.server_rank(k)
        return [self.t.irecv(torch.empty(n, dtype=dt), src, tag=TAG_REPLY_DATA) for dt, n in _layout_of(head)]

    def _apply_replies(self, heads, datas) -> torch.Tensor:
        for k, ((lo, hi), head, data) in enumerate(zip(self.layout.bounds, heads, datas)):
            version, staleness = int(head[2]), int(head[3])
            self.versions[k] = version
            if k == 0:
                if staleness == DROPPED:
                    self.dropped += 1
                elif staleness >= 0:
                    self.staleness[staleness] += 1
            if self.downlink is None:
                self.params[lo:hi] = data[0]
            else:
                p = self._down_ctx.payload(data, hi - lo, self.dtype, ("psdown", k, self.t.rank), version)
                self.params[lo:hi] += self.downlink.decompress(p).reshape(-1)
        return self.params.clone()

    def drain(self) -> None:
        """Wait for the answers to every push in flight (in push order)."""
        while self._queue:
            self._queue[0].wait()

    def state_dict(self) -> dict:
        """This worker's end at a quiescent point (call `drain()` first): the model it holds, its clock and
        the server versions it holds. Its memory (error feedback) is saved by the trainer."""
        if self._queue:
            raise RuntimeError("PSWorker.state_dict with pushes in flight: drain() first")
        return {"params": self.params.clone(), "clock": self.clock,
                "versions": torch.tensor(self.versions, dtype=torch.int64),
                "staleness": dict(self.staleness), "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.params.copy_(state["params"])
        self.clock = int(state["clock"])
        self.versions = [int(v) for v in state["versions"].tolist()]
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        self.dropped = int(state["dropped"])

    def done(self) -> None:
        """Drain in-flight pushes and tell every server this worker is finished."""
        if self._closed:
            return
        self.drain()
        hs = [self.t.isend(_header(DONE, self.clock), self.layout.server_rank(k), tag=TAG_PUSH_HEAD)
              for k in range(self.layout.servers)]
        for h in hs:
            h.wait()
        self._closed = True

    def metrics(self) -> dict:
        out = {"ps_pushes": self.clock}
        if self.staleness:
            total = sum(self.staleness.values())
            out["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness.items())}
            out["staleness_mean"] = sum(k * v for k, v in self.staleness.items()) / total
            out["staleness_max"] = max(self.staleness)
        if self.dropped:
            out["dropped"] = self.dropped
        return out


# -- server side ------------------------------------------------------------------------------------------
def _clone_optimizer(template: torch.optim.Optimizer, param: torch.nn.Parameter, lr_scale: float):
    """The worker's optimizer (class and hyper-parameters) over the server's shard."""
    group = {k: v for k, v in template.param_groups[0].items() if k != "params"}
    group["lr"] = group["lr"] * lr_scale
    try:
        return type(template)([param], **group)
    except TypeError:
        return torch.optim.SGD([param], lr=group["lr"], momentum=group.get("momentum", 0.0),
                               weight_decay=group.get("weight_decay", 0.0))


class PSServer:
    """A server's end: owns one shard, applies updates under a synchronization rule, replies with the shard."""

    MODES = ("sync", "async", "backup")

    def __init__(self, transport, layout: PSLayout, initial: torch.Tensor, optimizer: torch.optim.Optimizer,
                 mode: str = "sync", staleness: int = 0, backups: int = 0, compressor=None, downlink=None,
                 lr_scale: float = 1.0):
        from ..compress import compressors
        if mode not in self.MODES:
            raise UserError(f"unknown PS mode {mode!r}; valid: {', '.join(self.MODES)}")
        if staleness < 0:
            raise UserError(f"staleness must be >= 0, got {staleness}")
        if mode == "backup" and not 0 <= backups < layout.workers:
            raise UserError(f"backups must be in 0..{layout.workers - 1} (n_b of {layout.workers} workers), "
                            f"got {backups}")
        self.t, self.layout, self.mode = transport, layout, mode
        self.s, self.backups = staleness, backups
        self.k = layout.shard_of(transport.rank)
        lo, hi = layout.bounds[self.k]
        self.shard = torch.nn.Parameter(initial.detach()[lo:hi].clone())
        self.opt = _clone_optimizer(optimizer, self.shard, lr_scale)
        self.compressor = compressor if compressor is not None else compressors.get("none")
        self.downlink = downlink if downlink is not None and downlink.name != "none" else None
        check_compressor(self.compressor)
        check_compressor(self.downlink, "downlink")
        self._ctx = _Context(self.compressor)
        n = layout.workers
        # the copy each worker holds (compressed downlink only): x - x̂_w is the server-side residual
        self.held = [self.shard.detach().clone() for _ in range(n)] if self.downlink else None
        self.version = 0
        self.done = [False] * n
        self.pending: dict[int, dict[int, tuple]] = {}    # sync: clock -> worker -> (grad, base version)
        self.fresh: dict[int, torch.Tensor] = {}          # backup: worker -> grad of this round
        self.waiting: list[tuple[int, int]] = []          # sync: (worker, clock) awaiting their reply
        self.staleness = Counter()
        self.dropped = 0
        self.updates = 0
        self.gradients = 0   # worker gradients that went into an update
        self.pushes = [0] * n  # pushes handled per worker: all equal to N at step N's checkpoint
        self._outbox: deque = deque()
        self._sending: list = []

    # -- the loop ----------------------------------------------------------------------------------------
    def serve(self, checkpoint=None) -> None:
        """Answer pushes until every worker said it is done, then drain the replies.

        Per worker, messages are handled in order from a queue of [header receive, data receives]: as soon as
        a header's bytes are here (before its emulated delivery) the data receives and the next header receive
        are posted, so consecutive pushes of one worker overlap their latency instead of paying α each.

        `checkpoint=(every, total, save)`: the workers checkpoint after every `every`-th step before `total`,
        each once its own pushes are answered; the server calls `save(step)` (which joins the workers'
        checkpoint barriers) at the matching cut: every worker's `step` pushes handled and answered, none
        beyond (the workers wait in the barrier), no update pending."""
        n = self.layout.workers
        rx = {w: deque([self._post_head(w)]) for w in range(n)}
        if checkpoint is not None:
            every, total, save = checkpoint
            cut = (min(self.pushes) // every + 1) * every
        while rx or self._outbox or self._sending:
            progressed = False
            if checkpoint is not None and cut < total and self._quiet_at(cut):
                save(cut)
                cut += every
                progressed = True
            for w in list(rx):
                q = rx[w]
                last = q[-1]
                if last[1] is None and _real_done(last[0]):   # a header is in: post what follows it
                    head = last[0].wait()
                    if int(head[0]) == DONE:
                        last[1] = []
                    else:
                        last[1] = [self.t.irecv(torch.empty(m, dtype=dt), w, tag=TAG_PUSH_DATA)
                                   for dt, m in _layout_of(head)]
                        q.append(self._post_head(w))
                    progressed = True
                while q and q[0][1] is not None and all(h.is_completed() for h in q[0][1]):
                    head_h, data_hs = q.popleft()
                    head = head_h.wait()
                    if int(head[0]) == DONE:
                        del rx[w]
                        self._on_done(w)
                    else:
                        self._on_push(w, int(head[1]), int(head[2]), [h.wait() for h in data_hs])
                    progressed = True
            progressed |= self._pump()
            if not progressed:
                time.sleep(_POLL_S)

    def _post_head(self, w: int) -> list:
        return [self.t.irecv(torch.empty(HEADER, dtype=torch.int64), w, tag=TAG_PUSH_HEAD), None]

    def _decode(self, w: int, clock: int, tensors) -> torch.Tensor:
        lo, hi = self.layout.bounds[self.k]
        p = self._ctx.payload(tensors, hi - lo, self.shard.dtype, ("ps", self.k), clock)
        return self.compressor.decompress(p).reshape(-1).to(self.shard.dtype)

    def _apply(self, grad: torch.Tensor, contributions: int = 1) -> None:
        self.shard.grad = grad
        self.opt.step()
        self.version += 1
        self.updates += 1
        self.gradients += contributions

    def _record(self, base: int) -> int:
        tau = self.version - base   # updates applied since the model this gradient was computed on
        self.staleness[tau] += 1
        return tau

    def _quiet_at(self, step: int) -> bool:
        """Every worker's `step` pushes handled and answered (replies delivered), nothing pending."""
        return (all(p == step for p in self.pushes) and not self.pending and not self.waiting
                and not self.fresh and not self._outbox and all(h.is_completed() for h in self._sending))

    def state_dict(self) -> dict:
        """The server's state at a checkpoint cut (`_quiet_at`): its shard of the global model, the optimizer
        state (momentum), the update counters, the pushes handled per worker, and with a compressed downlink
        the copy each worker holds (x - x̂_w is the server-side error-feedback residual)."""
        if self.pending or self.waiting or self.fresh or self._outbox:
            raise RuntimeError("PSServer.state_dict outside a checkpoint cut (updates or replies pending)")
        return {"shard": self.flat_shard(), "optimizer": self.opt.state_dict(), "version": self.version,
                "updates": self.updates, "gradients": self.gradients, "dropped": self.dropped,
                "staleness": dict(self.staleness), "pushes": torch.tensor(self.pushes, dtype=torch.int64),
                "held": [h.clone() for h in self.held] if self.held is not None else None}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.opt.load_state_dict(state["optimizer"])
        self.version, self.updates = int(state["version"]), int(state["updates"])
        self.gradients, self.dropped = int(state["gradients"]), int(state["dropped"])
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        self.pushes = [int(p) for p in state["pushes"].tolist()]
        if self.held is not None:
            for mine, saved in zip(self.held, state["held"]):
                mine.copy_(saved)

    def _on_push(self, w: int, clock: int, base: int, tensors) -> None:
        self.pushes[w] += 1
        g = self._decode(w, clock, tensors)
        if self.mode == "async":
            tau = self._record(base)
            self._apply(g)
            self._reply(w, clock, tau)
        elif self.mode == "backup":
            if base < self.version:      # a late gradient of a finished round: dropped (catalog §2.1.2)
                self.dropped += 1
                self._reply(w, clock, DROPPED)
                return
            self.fresh[w] = (g, clock, base)
            self._try_backup_round()
        else:
            self.pending.setdefault(clock, {})[w] = (g, base)
            self.waiting.append((w, clock))
            self._try_sync()

    def _on_done(self, w: int) -> None:
        self.done[w] = True
        if self.mode == "backup":
            self._try_backup_round()
        elif self.mode == "sync":
            self._try_sync()

    def _mean(self, grads) -> torch.Tensor:
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        return total / len(grads)   # seed 000 eq. 6: (1/n) Σ_i G_i

    def _try_sync(self) -> None:
        taus = {}
        while self.version in self.pending:
            got = self.pending[self.version]
            expected = sum(1 for w in range(self.layout.workers) if not self.done[w] or w in got)
            if len(got) < expected:
                break
            clock = self.version
            for w in sorted(got):
                taus[(w, clock)] = self._record(got[w][1])
            self._apply(self._mean([got[w][0] for w in sorted(got)]), len(got))
            del self.pending[clock]
        still = []
        for w, c in self.waiting:   # SSP read rule: clocks <= c - s applied, i.e. version >= c - s + 1
            if self.version >= c - self.s + 1:
                self._reply(w, c, taus.get((w, c), PENDING))
            else:
                still.append((w, c))
        self.waiting = still

    def _try_backup_round(self) -> None:
        active = sum(1 for w in range(self.layout.workers) if not self.done[w])
        need = min(self.layout.workers - self.backups, max(active, 1))
        if not self.fresh or len(self.fresh) < need:
            return
        ws = sorted(self.fresh)
        # catalog §2.1.2: x_{t+1} = x_t - γ (1/n) Σ_{i ∈ A_t} G_i, A_t the first n arrivals
        self._apply(self._mean([self.fresh[w][0] for w in ws]), len(ws))
        for w in ws:
            self.staleness[0] += 1
        for w in ws:
            self._reply(w, self.fresh[w][1], 0)
        self.fresh = {}

    # -- replies: queued on this server's send link, one message after another ---------------------------
    def _reply(self, w: int, clock: int, staleness: int) -> None:
        if self.downlink is None:
            tensors = [self.shard.detach().clone()]
        else:
            delta = self.shard.detach() - self.held[w]
            payload = self.downlink.compress(delta, key=("psdown", self.k, w), step=self.version)
            self.held[w] += self.downlink.decompress(payload).reshape(-1)
            tensors = _flat(payload.tensors)
        head = _header(REPLY, clock, self.version, staleness, tensors)
        self._outbox.append((w, head, tensors))
        self._pump()

    def _pump(self) -> bool:
        """Start the next queued reply once the previous one left this server's link (so the k-th of n
        replies reaches its worker after k transfers: the PS broadcast costs n·Nβ at the server)."""
        if self._sending and not all(h.is_completed() for h in self._sending):
            return False
        was = bool(self._sending)
        self._sending = []
        if self._outbox:
            w, head, tensors = self._outbox.popleft()
            self._sending = [self.t.isend(head, w, tag=TAG_REPLY_HEAD)]
            self._sending += [self.t.isend(x, w, tag=TAG_REPLY_DATA) for x in tensors]
            return True
        return was

    def flat_shard(self) -> torch.Tensor:
        return self.shard.detach().clone()

    def metrics(self) -> dict:
        out = {"ps_shard": self.k, "ps_shard_size": self.shard.numel(), "ps_updates": self.updates,
               "ps_gradients": self.gradients}
        if self.staleness:
            total = sum(self.staleness.values())
            out["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness.items())}
            out["staleness_mean"] = sum(k * v for k, v in self.staleness.items()) / total
            out["staleness_max"] = max(self.staleness)
        if self.mode == "backup":
            out["dropped"] = self.dropped
        return out
