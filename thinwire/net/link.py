"""A network link: bandwidth, one-way latency, jitter and loss; named profiles and `custom:` specs."""
from __future__ import annotations

import bisect
import itertools
import math
import re
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError


@dataclass(frozen=True)
class Link:
    """One worker's link. `bandwidth` in bits/s (None: unlimited), latencies in seconds.

    α (per-message start-up cost) is the one-way latency; β (seconds per byte) is 8 / bandwidth.
    `loss` is the probability that a message is lost once and resent after a retransmission timeout.

    Args:
        bandwidth: bits per second (None: unlimited).
        latency: one-way latency, seconds.
        jitter: the spread of the latency, seconds.
        loss: the probability that a message is lost once and resent, in [0, 1).
        name: what reports call it.
    """

    bandwidth: float | None = None
    latency: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    name: str = "custom"

    def __post_init__(self):
        if self.bandwidth is not None and not 0 < self.bandwidth < math.inf:
            raise UserError(f"bandwidth must be a finite number > 0, got {self.bandwidth}")
        if not (0 <= self.latency < math.inf and 0 <= self.jitter < math.inf):
            raise UserError(f"latency and jitter must be finite and >= 0, got {self.latency}, {self.jitter}")
        if not 0 <= self.loss < 1:
            raise UserError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 0.0 if self.bandwidth is None else 8.0 / self.bandwidth

    @property
    def emulated(self) -> bool:
        """Whether anything is emulated (a bandwidth, a latency, jitter or loss)."""
        return self.bandwidth is not None or self.latency > 0 or self.jitter > 0 or self.loss > 0

    @property
    def rto(self) -> float:
        """Retransmission timeout charged for a lost message (TCP's floor is 200 ms)."""
        return max(0.2, 4 * self.latency)

    def handshaking(self) -> "Link":
        """The link as a collective that hands each chunk to a peer only once the peer is ready to receive it
        (gloo's all-reduce, all-gather and broadcast) sees it: every step starts with a round trip, so its
        start-up cost α is twice the one-way latency. Measured under the real-network mode: a 2-rank gloo
        all-reduce at 50 ms one-way takes 4 one-way latencies, a broadcast 2 (BENCHMARKS.md)."""
        return replace(self, latency=2 * self.latency)

    def to_dict(self) -> dict:
        """The link's fields, as a dict (for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        return self.name


# name -> (bandwidth bit/s, one-way latency s, description)
PROFILES: dict[str, tuple[float | None, float, str]] = {
    "lan": (None, 0.0, "no emulation: loopback as it is"),
    "dc": (10e9, 0.05e-3, "data centre: 10 Gbit/s, 0.05 ms one-way"),
    "cluster": (1e9, 0.1e-3, "cheap cluster: 1 Gbit/s, 0.1 ms one-way"),
    "wan": (100e6, 50e-3, "wide area: 100 Mbit/s, 50 ms one-way"),
    "world": (50e6, 150e-3, "across the world: 50 Mbit/s, 150 ms one-way"),
    "home": (10e6, 100e-3, "a consumer link: 10 Mbit/s, 100 ms one-way"),
}

# what a `custom:` spec may ask for: beyond these, an emulated run would sit idle for hours
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e13      # 1 kbit/s .. 10 Tbit/s
MAX_LATENCY = 60.0                            # one-way latency and jitter (s); the Earth-Moon latency is 1.3 s

_UNITS_BW = {"": 1, "bit": 1, "bps": 1, "kbit": 1e3, "kbps": 1e3, "mbit": 1e6, "mbps": 1e6,
             "gbit": 1e9, "gbps": 1e9, "k": 1e3, "m": 1e6, "g": 1e9}
_UNITS_T = {"": 1e-3, "ms": 1e-3, "s": 1.0, "us": 1e-6}


def _number(text: str, units: dict, what: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise UserError(f"malformed {what} {text!r}; e.g. " + ("200mbit, 1gbit" if units is _UNITS_BW else "25ms, 0.1s"))
    return float(m.group(1)) * units[m.group(2)]


def parse_bandwidth(text: str) -> float:
    """A bandwidth such as `200mbit`, `1gbit`, `50e6` (bits/s)."""
    return _number(text, _UNITS_BW, "bandwidth")


def parse_network(spec: "str | Link | None") -> Link:
    """A profile name (`lan`, `dc`, `cluster`, `wan`, `world`, `home`),
    `custom:bandwidth=200mbit,latency=25ms,jitter=5ms,loss=0.01` (each key optional), or a two-tier network
    `islands:2x2,inside=dc,across=world` or `islands:2+4,...` (an `Islands`).

    Args:
        spec: the name or spec (None: "lan"), or a `Link`, returned as it is.

    Returns:
        The `Link`; a malformed spec is a `UserError`.
    """
    if isinstance(spec, Link):
        return spec
    if spec is None:
        spec = "lan"
    if not isinstance(spec, str):
        raise UserError(f"network must be a profile name or a Link, got {type(spec).__name__}")
    if spec in PROFILES:
        bw, lat, _ = PROFILES[spec]
        return Link(bandwidth=bw, latency=lat, name=spec)
    if spec.startswith("custom:"):
        fields: dict = {}
        for item in filter(None, spec.removeprefix("custom:").split(",")):
            if "=" not in item:
                raise UserError(f"malformed network {spec!r}: {item!r} is not key=value")
            key, value = (s.strip() for s in item.split("=", 1))
            if key == "bandwidth":
                fields[key] = parse_bandwidth(value)
            elif key in ("latency", "jitter"):
                fields[key] = _number(value, _UNITS_T, key)
            elif key == "loss":
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise UserError(f"malformed loss {value!r}; e.g. 0.01") from None
            else:
                raise UserError(f"malformed network {spec!r}: unknown key {key!r}; valid: bandwidth, latency, jitter, loss")
        if not fields:
            raise UserError(f"malformed network {spec!r}; e.g. custom:bandwidth=200mbit,latency=25ms,jitter=5ms")
        if "bandwidth" in fields and not MIN_BANDWIDTH <= fields["bandwidth"] <= MAX_BANDWIDTH:
            raise UserError(f"bandwidth in {spec!r} must be in 1kbit..10000gbit (1e3..1e13 bit/s), "
                            f"got {fields['bandwidth']:g} bit/s")
        for key in ("latency", "jitter"):
            if key in fields and not fields[key] <= MAX_LATENCY:
                raise UserError(f"{key} in {spec!r} must be in 0..60s, got {fields[key]:g} s")
        return Link(name=spec, **fields)
    if spec.startswith("islands:"):
        return parse_islands(spec)
    raise UserError(f"unknown network {spec!r}; valid: {', '.join(PROFILES)}, custom:bandwidth=...,latency=...,jitter=...,"
                    f"loss=..., islands:AxB,inside=NET,across=NET (or islands:A+B,...)")


@dataclass(frozen=True)
class Islands(Link):
    """`islands` islands of `size` workers on fast links (`inside`), a thin link between islands: the Link fields.

        islands:2x2,inside=dc,across=world

    is 2 islands of 2 workers, `dc` inside an island, `world` between them; `islands:2+4,...` two islands of
    different sizes, 2 and 4 workers (`sizes`; `size` is then the largest, and `islands:AxB` is `sizes` B, A times).

    Ranks are laid out island by island (ranks 0..m0-1 are island 0, the next m1 island 1, ...). A message between
    two ranks of one island is charged on `inside`, any other on `across`. Each worker has its own path across, as
    on a flat network (a flat `world` is `islands:4x1,across=world`): its traffic to another site queues behind its
    own earlier traffic to other sites, not behind its island's neighbours'. Its own bandwidth, latency, jitter and
    loss are the thin link's, so code that sees a network as one link (a scheduler's heuristics, a planner asked
    about the bottleneck) sees the link that decides: a collective over ranks of several islands steps at the pace
    of its slowest hop. `path(members)` is the link a group's collectives cross, `between(a, b)` a message's, and
    `crosses(a, b)` whether it goes over the thin link (the bytes a report counts apart). Inside/across are profile
    names or `BANDWIDTH@LATENCY` (`10mbit@100ms`)."""

    islands: int = 1
    size: int = 1
    inside: Link = field(default_factory=Link)
    sizes: tuple = field(default=(), repr=False)   # each island's workers (given: sets `islands` and `size`)

    def __post_init__(self):
        super().__post_init__()
        for v in self.sizes:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"workers per island must be integers >= 1, got {v!r}")
        if self.sizes:
            object.__setattr__(self, "sizes", tuple(self.sizes))
            object.__setattr__(self, "islands", len(self.sizes))
            object.__setattr__(self, "size", max(self.sizes))
        for what, v in (("islands", self.islands), ("workers per island", self.size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{what} must be an integer >= 1, got {v!r}")
        if not self.sizes:
            object.__setattr__(self, "sizes", (self.size,) * self.islands)

    @property
    def workers(self) -> int:
        return sum(self.sizes)

    @property
    def equal(self) -> bool:
        """Whether every island has `size` workers (`islands:AxB`)."""
        return min(self.sizes) == self.size

    def ranks(self, i: int) -> range:
        """The global ranks of island i."""
        start = sum(self.sizes[:i])
        return range(start, start + self.sizes[i])

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.equal:          # (`islands` and `size` say it all)
            del out["sizes"]
        return out

    @property
    def across(self) -> Link:
        """The thin link between islands, as a plain Link."""
        return Link(self.bandwidth, self.latency, self.jitter, self.loss, name=self.name.partition("across=")[2]
                    or "across")

    @property
    def emulated(self) -> bool:
        return super().emulated or self.inside.emulated

    def island(self, rank: int) -> int:
        """The island of global rank `rank`."""
        return bisect.bisect_right(list(itertools.accumulate(self.sizes)), rank)

    def crosses(self, a: int, b: int) -> bool:
        """Whether a message between global ranks a and b goes over the thin link."""
        return self.island(a) != self.island(b)

    def between(self, a: int, b: int) -> Link:
        """The link a message between global ranks a and b crosses."""
        return self.across if self.crosses(a, b) else self.inside

    def path(self, members) -> Link:
        """The link the collectives of a group of these global ranks cross: `inside` when they are all in one
        island, else the thin link (a collective steps at the pace of its slowest hop)."""
        return self.inside if len({self.island(r) for r in members}) <= 1 else self.across

    def ring_crossing(self, members, me: int) -> bool:
        """Whether member `me` (an index into `members`, global ranks in ring order) sends over the thin link in a
        ring collective: its right neighbour is in another island."""
        return len(members) > 1 and self.crosses(members[me], members[(me + 1) % len(members)])

    def tree_crossings(self, members, me: int, src: int) -> int:
        """How many messages member `me` (an index into `members`, global ranks) sends over the thin link in a
        binomial-tree broadcast from member `src`: to its children of `tree_broadcast`, rel + 2^k for each round
        k where rel < 2^k (rel = me - src mod n), those in another island."""
        n, rel = len(members), (me - src) % len(members)
        children = [(rel + (1 << k) + src) % n for k in range((n - 1).bit_length()) if rel < (1 << k) and rel + (1 << k) < n]
        return sum(self.crosses(members[me], members[c]) for c in children)

    def handshaking(self) -> "Islands":
        return replace(self, latency=2 * self.latency, inside=self.inside.handshaking())

    def check_workers(self, n: int, what: str = "--workers") -> None:
        if n == self.workers:
            return
        if self.equal:
            raise UserError(f"network {self.name} has {self.islands} islands of {self.size} workers = "
                            f"{self.workers}; {what} is {n} (give {what} {self.workers}, or islands:AxB with A·B = {n})")
        raise UserError(f"network {self.name} has islands of {'+'.join(map(str, self.sizes))} workers = "
                        f"{self.workers}; {what} is {n} (give {what} {self.workers}, or island sizes summing to {n})")


def _tier(text: str, key: str, spec: str) -> Link:
    """A profile name or BANDWIDTH@LATENCY (e.g. `10mbit@100ms`)."""
    if text in PROFILES:
        return parse_network(text)
    if "@" in text:
        bw, _, lat = text.partition("@")
        return Link(bandwidth=parse_bandwidth(bw), latency=_number(lat, _UNITS_T, "latency"), name=text)
    raise UserError(f"malformed network {spec!r}: {key}={text!r} is neither a profile ({', '.join(PROFILES)}) "
                    f"nor BANDWIDTH@LATENCY (e.g. 10mbit@100ms)")


def parse_islands(spec: str) -> Islands:
    """`islands:AxB[,inside=NET][,across=NET]`: A islands of B workers; `islands:A+B+...`: islands of A, B, ...
    workers (at least two), ranks in that order (inside: `dc`, across: `world` unless given)."""
    body = spec.removeprefix("islands:")
    shape, *items = [s.strip() for s in body.split(",")]
    m = re.fullmatch(r"(\d+)x(\d+)", shape)
    if not m and not re.fullmatch(r"\d+(\+\d+)+", shape):
        raise UserError(f"malformed network {spec!r}: expected islands:AxB (A islands of B workers) or islands:A+B "
                        f"(islands of A and B workers), e.g. islands:2x2,inside=dc,across=world")
    tiers = {"inside": "dc", "across": "world"}
    for item in filter(None, items):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in tiers:
            raise UserError(f"malformed network {spec!r}: {item!r}; valid keys: inside, across")
        tiers[key] = value
    inside, across = (_tier(tiers[k], k, spec) for k in ("inside", "across"))
    shape = {"islands": int(m.group(1)), "size": int(m.group(2))} if m else \
        {"sizes": tuple(int(v) for v in shape.split("+"))}
    written = f"{m.group(1)}x{m.group(2)}" if m else "+".join(map(str, shape["sizes"]))
    name = f"islands:{written},inside={tiers['inside']},across={tiers['across']}"
    return Islands(bandwidth=across.bandwidth, latency=across.latency, jitter=across.jitter, loss=across.loss,
                   name=name, inside=inside, **shape)
