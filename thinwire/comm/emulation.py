"""One rank's emulated link: a queue for its sending side and one for its receiving side.

An operation occupies the link for its transfer time (the β term): a second transfer queues behind the first, so
bandwidth is not free because an operation is asynchronous; the latency (α) of a point-to-point message does not
occupy it. Collectives run at most `COLLECTIVE_SLOTS` at a time, as gloo runs a process group's collectives on its
two worker threads (under the real-network mode, three in flight took far longer than one). Jitter and loss add to
an operation's delivery time but never reorder deliveries on one link.

A point-to-point message is charged on both ends: a send occupies the sender's link from the moment it is issued
(`schedule(issued, ..., tx only)`: sends to three peers at once go out one after another), and the message carries
the time its last byte left, so the receiver's link cannot end its window before then (`not_before`): no receiver
gets data before the sender pushed it out (`Transport.send` / `recv`). The clock is the host's monotonic
`time.perf_counter`, which every process of one host shares: emulated links model ranks on one host.

The emulated wire is FIFO for a process group's collectives, though gloo runs them on two threads and may finish
the second first: each group's `DeliveryQueue` puts them on the link in issue order, each once its own real part
and every earlier one's are done. Unemulated, each completes with gloo's (as DDP's own futures do: a small bucket
is not held behind a large one).
"""
from __future__ import annotations

import collections
import random
import threading

from ..net import COLLECTIVE_SLOTS, Cost, Link


class LinkClock:
    def __init__(self, link: Link, rank: int = 0, seed: int = 0):
        self.link = link
        self.tx_free = self.rx_free = 0.0  # when each direction of the link is done with its transfers
        self.last_tx = self.last_rx = 0.0  # per direction: a send is not held behind a receive's latency
        self._collectives: list[float] = []  # deliveries of the latest collectives, at most COLLECTIVE_SLOTS
        self._rng = random.Random(seed * 100003 + rank)  # timing only: never touches results
        self._lock = threading.Lock()

    def schedule(self, ready: float, cost: Cost, tx: bool = True, rx: bool = True, latency: bool = True,
                 not_before: float = 0.0) -> float:
        """Delivery time (perf_counter clock) of an op whose real part completed at `ready`. `not_before`: the
        transfer on this link cannot end before it (a received message's last byte left its sender then)."""
        link = self.link
        if not link.emulated:
            return ready
        with self._lock:
            start = max(ready, self.tx_free if tx else 0.0, self.rx_free if rx else 0.0,
                        not_before - cost.transfer)
            if tx and rx and len(self._collectives) >= COLLECTIVE_SLOTS:  # all of gloo's threads are busy
                start = max(start, self._collectives[-COLLECTIVE_SLOTS])
            busy_until = start + cost.transfer
            delivery = busy_until + (cost.latency if latency else 0.0)
            if link.jitter and latency:
                delivery += self._rng.uniform(-1.0, 1.0) * link.jitter
            if link.loss and latency:
                messages = max(1, round(cost.latency / link.alpha)) if link.alpha else 1
                if self._rng.random() < 1.0 - (1.0 - link.loss) ** messages:
                    delivery += link.rto
            # delay, never reorder (within a direction: point-to-point sends queue behind sends, receives
            # behind receives; a collective, both ways, behind everything)
            delivery = max(delivery, start, self.last_tx if tx else 0.0, self.last_rx if rx else 0.0)
            if tx and rx:
                self._collectives = (self._collectives + [delivery])[-COLLECTIVE_SLOTS:]
            if tx:
                self.tx_free, self.last_tx = busy_until, delivery
            if rx:
                self.rx_free, self.last_rx = busy_until, delivery
            return delivery


class DeliveryQueue:
    """The collectives of one process group (one `Transport`) not yet on its emulated link, in issue order.

    Its items are `Handle`s (`thinwire.comm.handle`): `arrived()` (the real op is done), `schedule()` (take the
    delivery time from the link) and `fire()` (run the callbacks waiting for that time)."""

    def __init__(self):
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def enqueue(self, handle) -> None:
        """`handle` (a collective just issued) is put on the link after those already queued."""
        with self._lock:
            self._waiting.append(handle)

    def drain(self) -> None:
        """Put on the link, in issue order, every collective whose real part and predecessors are done."""
        done = []
        with self._lock:
            while self._waiting and self._waiting[0].arrived():
                h = self._waiting.popleft()
                h.schedule()
                done.append(h)
        for h in done:
            h.fire()

    def clear(self) -> None:
        """Forget the collectives queued (their group was abandoned: `Transport.regroup`)."""
        with self._lock:
            self._waiting.clear()
