"""A network link: bandwidth, one-way latency, jitter and loss; named profiles and `custom:` specs."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

from ..errors import UserError


@dataclass(frozen=True)
class Link:
    """One worker's link. `bandwidth` in bits/s (None: unlimited), latencies in seconds.

    α (per-message start-up cost) is the one-way latency; β (seconds per byte) is 8 / bandwidth.
    `loss` is the probability that a message is lost once and resent after a retransmission timeout.
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
    """A profile name (`lan`, `dc`, `cluster`, `wan`, `world`) or
    `custom:bandwidth=200mbit,latency=25ms,jitter=5ms,loss=0.01` (each key optional)."""
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
    raise UserError(f"unknown network {spec!r}; valid: {', '.join(PROFILES)}, custom:bandwidth=...,latency=...,jitter=...,loss=...")
