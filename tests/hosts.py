"""Two hosts on one machine, for tests of what crosses machines: network namespaces "a" and "b", each with its
own address on the veth pair between them and its own loopback, so that a process in one reaches the other only
at that address, as two machines on a LAN do.

    with TwoHosts() as hosts:     # in a test: the session fixture `two_hosts` (tests/conftest.py)
        hosts.addr["a"]           # "10.233.0.1": host a's address, the only one at which b reaches a
        hosts.ifname["a"]         # the interface that holds it (what GLOO_SOCKET_IFNAME would name)
        p = hosts.popen("a", [sys.executable, "-m", "thinwire", ...], stdout=subprocess.PIPE)
        hosts.run("b", ["ss", "-ltnH"])           # subprocess.run inside host b (capture_output, text)
        s = hosts.socket("a")                     # a TCP socket living in host a: bind/connect act there
        hosts.free_port("a")                      # a port free on host a
        hosts.listening("a")                      # ["10.233.0.1:29500", ...]: host a's listening TCP sockets
        hosts.shape("custom:bandwidth=50mbit")    # both directions; "lan": unshaped again

- `popen(host, argv, **kwargs)` is `subprocess.Popen(["ip", "netns", "exec", NS, *argv], **kwargs)` (the
  environment is this process's unless `env=` is given; `cwd`, pipes, `text` as usual). The process starts a
  session of its own and dies with this process; at `close` every process still in either host is killed
  (`ip netns pids`: torchrun's workers too, which start sessions of their own).
- `shape(network)` shapes what each host sends to the profile's bandwidth (the kernel's `tbf` qdisc on both veth
  ends; "lan" and other profiles without a bandwidth: unshaped). A profile with latency, jitter or loss is a
  ValueError: that needs the `netem` qdisc, which this machine's kernel lacks. The veth pair's own one-way delay
  is tens of microseconds.
- `unavailable()`: None where the two hosts can be made here, else why not (one line: not Linux, not root, no
  `ip`/`tc`); the fixture also skips, with the error's line, when `ip netns add` fails.

The namespaces are named `twh<pid>a` and `twh<pid>b` (and so are the veth ends); `close` removes them (also on a
failure while building), and a new TwoHosts first removes any whose process is gone (a killed run's), as
thinwire.launcher.netem does for its own.
"""
from __future__ import annotations

import ipaddress
import os
import socket as _socket
import subprocess

from thinwire.errors import UserError
from thinwire.launcher import netem
from thinwire.launcher.worker import die_with_parent
from thinwire.net import parse_network

NET = "10.233.0"
WHAT = "two hosts"


def unavailable() -> str | None:
    return netem.available(tun=False)


class TwoHosts:
    def __init__(self):
        tag = f"twh{os.getpid()}"
        self.ns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.ifname = dict(self.ns)     # each veth end is named after its namespace (at most 15 characters)
        self.addr = {"a": f"{NET}.1", "b": f"{NET}.2"}
        self.hosts = ("a", "b")
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def __enter__(self) -> "TwoHosts":
        netem.remove_stale(namespaces=r"twh(\d+)[ab]", links=r"twh(\d+)[ab]")
        try:
            for h in self.hosts:
                netem.add_namespace(self.ns[h], what=WHAT)
                self._made.append(self.ns[h])
            a, b = self.ifname["a"], self.ifname["b"]
            netem.sh("ip", "link", "add", a, "type", "veth", "peer", "name", b, what=WHAT)
            for h in self.hosts:
                ex = ("ip", "netns", "exec", self.ns[h])
                netem.sh("ip", "link", "set", self.ifname[h], "netns", self.ns[h], what=WHAT)
                netem.sh(*ex, "ip", "addr", "add", f"{self.addr[h]}/24", "dev", self.ifname[h], what=WHAT)
                netem.sh(*ex, "ip", "link", "set", self.ifname[h], "up", what=WHAT)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], start_new_session=True,
                             preexec_fn=die_with_parent, **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def socket(self, host: str, kind: int = _socket.SOCK_STREAM) -> _socket.socket:
        with netem.inside(self.ns[host]):
            return _socket.socket(_socket.AF_INET, kind)

    def free_port(self, host: str) -> int:
        with self.socket(host) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def listening(self, host: str) -> list[str]:
        """"ADDRESS:PORT" of every listening TCP socket in `host` (read from its /proc/net/tcp and tcp6)."""
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in self.run(host, ["cat", table]).stdout.splitlines()[1:]:
                cols = line.split()
                if len(cols) < 4 or cols[3] != "0A":      # 0A: LISTEN
                    continue
                hexip, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexip)                 # kernel byte order: 32-bit words, each little-endian
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(f"{ipaddress.ip_address(raw)}:{int(hexport, 16)}")
        return found

    def shape(self, network: str) -> None:
        link = parse_network(network)
        if link.latency or link.jitter or link.loss:
            raise ValueError(f"{network}: the veth pair shapes bandwidth only (tbf); latency, jitter and loss need "
                             f"the netem qdisc, which this kernel lacks (thinwire.launcher.netem.Emulation delays "
                             f"packets in a forwarder of its own instead)")
        for h in self.hosts:
            netem.set_rate(self.ns[h], self.ifname[h], link.bandwidth, what=WHAT)

    def close(self) -> None:
        for ns in reversed(self._made):     # every process still in a host goes with it (torchrun's workers too)
            netem.remove_namespace(ns)
        self._made.clear()
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._procs.clear()


def open_two_hosts() -> tuple[TwoHosts | None, str | None]:
    """(hosts, None), or (None, why not) in one line where this machine cannot make them."""
    why = unavailable()
    if why:
        return None, why
    try:
        return TwoHosts().__enter__(), None
    except UserError as e:
        return None, str(e).splitlines()[0].removeprefix(f"{WHAT}: ")
