"""Parameter-server messaging (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep Learning: A
Comprehensive Survey", arXiv 2003.06307, §IV-A): roles, shards, framed messages, the server's loop.

Roles. The world's last K ranks are servers, ranks 0..n-1 workers (`PSLayout`). Each bucket of gradients (the
scheduler's, the same on every rank) is cut into K contiguous slices (sizes differing by at most one); server k
owns slice k of every bucket, so every server gets 1/K of every push (as BytePS partitions its keys).

Messages. A fixed int64 header (`Header`: kind, bucket, clock, version, aux, codec, nbytes) and, when nbytes > 0,
a body: one uint8 buffer (`thinwire.exchange.wire.pack`'s; this layer never looks inside). Each part is a
Transport.isend/irecv (metered, queued on the emulated link). A receiver posts a header's receive ahead and the
body's as soon as the header's bytes are in (`Mailbox`), in order, so a message costs one latency, not two.
Compression, error feedback and the payload algebra are the exchange layer's (`thinwire.exchange.ps`).

Server loop. `ServerLoop.run(handle)` streams every worker's messages in order to `handle(worker, header, body)`
and sends the replies it queues (`reply`) one after another on the server's link: the k-th of n replies reaches
its worker after k transfers, so the PS broadcast costs n·Nβ at the server, as incast does on the way in.
A worker the launcher announces lost (`on_failure="continue"`, `thinwire.comm.membership`) is done: `handle` gets
a DONE from it, its stream is dropped and nothing more is sent to it; the others are served on.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, NamedTuple

import torch

from ..errors import UserError
from .engine import Future, Task
from .handle import Handle
from .membership import MEMBERSHIP, PeerLost

PUSH, DONE, REPLY = 1, 2, 3
PUSH_TAGS, REPLY_TAGS = (7101, 7102), (7103, 7104)      # (header, body)
_POLL_S = 2e-4


class Header(NamedTuple):
    kind: int
    bucket: int = 0
    clock: int = 0
    version: int = 0
    aux: int = 0          # the sender's use: e.g. the staleness of the gradient a reply answers
    codec: int = 0        # the sender's use: which codec encoded the body
    nbytes: int = 0       # the body's size (0: none)


def shard_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """K contiguous [lo, hi) ranges covering 0..numel, sizes differing by at most one (the first are larger)."""
    base, extra = divmod(numel, k)
    cuts = [i * base + min(i, extra) for i in range(k + 1)]   # the first `extra` ranges hold one more
    return list(zip(cuts, cuts[1:]))


class PSLayout:
    """Who is a server, and which slice of each bucket each server owns (servers >= 1: `PSMixin` checks it)."""

    def __init__(self, numel: int, world_size: int, servers: int = 1):
        if world_size - servers < 1:
            raise UserError(f"{servers} server rank(s) leave no worker in a world of {world_size}; "
                            f"give --workers n --servers K (world = n + K, n >= 1)")
        if servers > numel:
            raise UserError(f"{servers} servers for {numel} parameters: at most one server per parameter")
        self.servers, self.workers = servers, world_size - servers

    def slices(self, numel: int) -> list[tuple[int, int]]:
        """The [lo, hi) slice of a bucket of `numel` elements that each server owns (some may be empty)."""
        return shard_bounds(numel, self.servers)

    def server_rank(self, k: int) -> int:
        return self.workers + k

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def shard_of(self, rank: int) -> int:
        return rank - self.workers


# -- messages ---------------------------------------------------------------------------------------------
def send(transport, dst: int, header: Header, body: torch.Tensor | None, tags=PUSH_TAGS) -> list[Future]:
    """Send one message (header, its nbytes the body's size, then the body if any) to `dst`; its parts' futures."""
    header = header._replace(nbytes=0 if body is None else body.numel())
    # the header goes where the group's collectives run (the receiver posts its buffer there, before any body)
    out = [transport.isend(torch.tensor(list(header), dtype=torch.int64, device=transport.device), dst, tag=tags[0])]
    if header.nbytes:
        out.append(transport.isend(body.reshape(-1).contiguous(), dst, tag=tags[1]))
    return out


def _arrived(fut: Future) -> bool:
    """Whether a receive's bytes are in its buffer (its emulated delivery may be later)."""
    if isinstance(fut, Task):
        fut = fut.unwrap()      # the task itself until its program returned: not arrived
    return isinstance(fut, Handle) and fut.arrived()


class Message(Future):
    """One incoming message: the result is (Header, body or None) once both parts are delivered."""

    def __init__(self, box: "Mailbox", head: Future, buf: torch.Tensor):
        self.box, self.head, self._buf = box, head, buf
        self.accounting = head.accounting
        self.header: Header | None = None
        self.body: Future | None = None
        self.posted = threading.Event()       # the header is in and the body's receive (if any) is posted

    def is_completed(self) -> bool:
        self.box.pump()
        return self.posted.is_set() and self.head.is_completed() and (self.body is None or self.body.is_completed())

    def result(self):
        while not self.posted.wait(0.002):    # set by the header's arrival callback, or by a pump
            self.box.pump()
        self.head.result()
        return self.header, (self.body.result() if self.body is not None else None)


class Mailbox:
    """The messages from one peer on one pair of tags, in order. `expect()` posts a header's receive; the body's
    receive is posted (in order: bodies of one tag match in posting order) as soon as its header's bytes are in.
    With `stream=True` the next header's receive is posted then too, unless the header says DONE: `queue` holds
    the messages in order, the first one always posted."""

    def __init__(self, transport, peer: int, tags, stream: bool = False):
        self.t, self.peer, self.tags, self.stream = transport, peer, tags, stream
        self.queue: deque[Message] = deque()         # (stream) every message not yet taken, in order
        self._waiting: deque[Message] = deque()      # headers whose body is not posted yet, in order
        self._lock = threading.RLock()

    def expect(self) -> Message:
        with self._lock:
            buf = torch.empty(len(Header._fields), dtype=torch.int64, device=self.t.device)
            head = self.t.irecv(buf, self.peer, tag=self.tags[0])
            msg = Message(self, head, buf)
            self._waiting.append(msg)
            if self.stream:
                self.queue.append(msg)
        if isinstance(head, Handle):
            head.on_arrival(lambda _h: self.pump())
        return msg

    def pump(self) -> None:
        """Post the bodies whose headers are in, in order (and, streaming, the next headers' receives)."""
        with self._lock:
            while self._waiting and _arrived(self._waiting[0].head):
                msg = self._waiting.popleft()
                msg.header = Header(*msg._buf.tolist())      # host: once per message (its body's size)
                if msg.header.nbytes:
                    msg.body = self.t.irecv(torch.empty(msg.header.nbytes, dtype=torch.uint8, device=self.t.device),
                                            self.peer, tag=self.tags[1])
                msg.posted.set()
                if self.stream and msg.header.kind != DONE:
                    self.expect()


class ServerLoop:
    """A server's receive/answer loop over the workers' streams of messages (see the module docstring)."""

    def __init__(self, transport, workers: int):
        self.t = transport
        self.workers = workers
        self._outbox: deque = deque()
        self._sending: list[Future] = []
        self._sending_to: int | None = None
        self.lost: set[int] = set()        # workers the launcher announced lost
        self._generation = 0               # the membership generation last looked at

    def reply(self, dst: int, header: Header, body: torch.Tensor | None) -> None:
        """Queue a reply; it leaves once the replies queued before it left this server's link."""
        if dst not in self.lost:
            self._outbox.append((dst, header, body))
        self._pump_out()

    def quiet(self) -> bool:
        """No reply queued or on the way."""
        return not self._outbox and self._sent()

    def _sent(self) -> bool:
        return self._sending_to in self.lost or all(h.is_completed() for h in self._sending)

    def _pump_out(self) -> bool:
        """Send the next queued reply once the previous one left; whether a reply left or started."""
        if not self._sent():
            return False
        progressed = bool(self._sending or self._outbox)
        while self._outbox and self._outbox[0][0] in self.lost:
            self._outbox.popleft()
        self._sending_to = self._outbox[0][0] if self._outbox else None
        self._sending = send(self.t, *self._outbox.popleft(), REPLY_TAGS) if self._outbox else []
        return progressed

    def _losses(self) -> None:
        """Add the workers lost since the last look (the launcher's announcements) to `lost`."""
        if MEMBERSHIP.watching and MEMBERSHIP.generation != self._generation:
            self._generation = MEMBERSHIP.generation
            members = set(MEMBERSHIP.members)
            self.lost |= {w for w in range(self.workers) if self.t.global_of(w) not in members}

    def run(self, handle: Callable[[int, Header, torch.Tensor | None], None],
            tick: Callable[[], bool] | None = None) -> None:
        """Hand every worker's messages, in order per worker, to `handle(worker, header, body)` until every
        worker sent DONE, then send what is queued. `tick()` runs between rounds (True: it did something)."""
        boxes = {w: Mailbox(self.t, w, PUSH_TAGS, stream=True) for w in range(self.workers)}
        for box in boxes.values():
            box.expect()
        while boxes or not self.quiet():
            progressed = bool(tick()) if tick is not None else False
            self._losses()
            for w in self.lost & set(boxes):
                del boxes[w]
                handle(w, Header(DONE), None)
            for w in list(boxes):
                q = boxes[w].queue
                while q and q[0].is_completed():
                    try:
                        header, body = q.popleft().result()
                    except (PeerLost, RuntimeError):       # the worker died mid-message: lost, if announced
                        MEMBERSHIP.wait_change(self._generation, 30.0)
                        self._losses()
                        if w not in self.lost:
                            raise
                        header, body = Header(DONE), None
                    handle(w, header, body)
                    progressed = True
                    if header.kind == DONE:
                        del boxes[w]
                        break
            progressed |= self._pump_out()
            if not progressed:
                time.sleep(_POLL_S)
