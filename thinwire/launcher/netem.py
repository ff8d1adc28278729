"""Real-network mode (`thinwire compare --netem`; Linux, root): every worker in its own network namespace, on a
link shaped for real, so unmodified programs (PyTorch DDP) face the same network as thinwire.

This kernel has no `netem` qdisc (`has_netem_qdisc()` checks that `tc qdisc add ... netem` fails before we use the
fallback), so the link is built from what it has:

    worker r (namespace twPIDnR)                                forwarder process (ours)
      data:    tw0 (TUN, 10.232.0.R+1/24) --tbf rate-->  reads the packet, holds it for the one-way delay
                                                          (+ jitter, never reordering a pair), writes it to
                                                          the destination namespace's tw0
      control: ctl0 (veth, 10.231.0.R+1/24) <-> bridge twbPID (10.231.0.254) in the root namespace: the
               launcher's rendezvous store only, not shaped

Rate: the kernel's `tbf` qdisc on each worker's tw0 (egress). Delay and jitter: the forwarder, a small Python
process holding one TUN device per namespace. gloo is pinned to tw0 (`GLOO_SOCKET_IFNAME`), so all worker-to-
worker traffic crosses the shaped link, and the Transport runs with no in-process emulation (`lan`).

Clean-up: namespaces, bridge and forwarder are removed on exit, on Ctrl-C, on SIGTERM and on failure; stale ones
left by a killed run (their PID is gone) are removed at the next start.

The pieces are public for other namespaces built the same way (tests/hosts.py: two hosts on a veth pair): `sh`
runs a command, `add_namespace` makes one with its loopback up, `set_rate` shapes an interface with tbf,
`inside` puts this thread in a namespace for a block, `remove_namespace` kills what runs in one and removes it,
`remove_stale` removes what a killed run left.
"""
from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import partial

from ..errors import UserError
from ..net import parse_network
from .pool import Pool
from .worker import die_with_parent

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 16000          # large packets: fewer for the user-space forwarder to move
DATA_NET, CTL_NET = "10.232.0", "10.231.0"


def sh(*cmd: str, check: bool = True, what: str = "--netem") -> subprocess.CompletedProcess:
    """Run `cmd`; with `check`, a failure is a one-line UserError starting with `what`."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise UserError(f"{what}: `{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def has_netem_qdisc() -> bool:
    """True when the kernel knows the netem qdisc (tried on a throw-away namespace's loopback)."""
    ns = f"twprobe{os.getpid()}"
    if sh("ip", "netns", "add", ns, check=False).returncode != 0:
        return False
    try:
        return sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                  check=False).returncode == 0
    finally:
        sh("ip", "netns", "del", ns, check=False)


def available(tun: bool = True) -> str | None:
    """None when the real-network mode (with `tun=False`: namespaces shaped by tc, no TUN device) can run here,
    else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if os.geteuid() != 0:
        return f"needs root (network namespaces{', TUN devices' if tun else ''}, tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"needs the `{tool}` command (iproute2)"
    if tun and not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


def _setns(path: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path}) failed")
    finally:
        os.close(fd)


@contextmanager
def inside(ns: str):
    """This thread in network namespace `ns` for the block: sockets and TUN devices made there stay there."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/var/run/netns/{ns}")
        yield
    finally:
        ctypes.CDLL("libc.so.6", use_errno=True).setns(home, CLONE_NEWNET)
        os.close(home)


def add_namespace(ns: str, what: str = "--netem") -> None:
    """A network namespace named `ns` with its loopback up (and TCP's slow start after idle off: a link that
    waits between bursts keeps its window). Remove it with `ip netns del`."""
    sh("ip", "netns", "add", ns, what=what)
    ex = ("ip", "netns", "exec", ns)
    sh(*ex, "ip", "link", "set", "lo", "up", what=what)
    sh(*ex, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0", check=False)


def set_rate(ns: str, dev: str, bandwidth: float | None, what: str = "--netem") -> None:
    """Shape what `dev` in namespace `ns` sends to `bandwidth` bits/s (tbf), or leave it unshaped (None)."""
    ex = ("ip", "netns", "exec", ns)
    sh(*ex, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    if bandwidth is not None:
        burst = max(2 * MTU + 2000, int(bandwidth / 8 * 0.002))
        sh(*ex, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(bandwidth)}bit", "burst", str(burst),
           "latency", "2s", what=what)


def remove_namespace(ns: str) -> None:
    """Kill every process still in network namespace `ns` (`ip netns pids`), then remove it."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    sh("ip", "netns", "del", ns, check=False)


def remove_stale(namespaces: str = r"tw(\d+)n\d+|twprobe(\d+)", links: str = r"twb(\d+)|twv(\d+)r\d+") -> None:
    """Remove the network namespaces and the links (of this namespace) whose whole names match the patterns and
    whose maker, the process whose PID the pattern's (first matching) group reads, is gone: what a killed run
    left, with any process still running in those namespaces. The defaults: `Emulation`'s namespaces, bridge and
    veth ends, and `has_netem_qdisc`'s probe."""
    def stale(pattern: str, name: str) -> bool:
        m = re.fullmatch(pattern, name)
        pid = next((g for g in m.groups() if g), None) if m else None
        return pid is not None and not os.path.exists(f"/proc/{pid}")
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(namespaces, name):
            remove_namespace(name)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if stale(links, name):
            sh("ip", "link", "del", name, check=False)


def enter_namespace(prefix: str, rank: int, world_size: int) -> None:
    """The launcher's `worker_init` under emulation: move this worker into its namespace (before the process
    group exists, so gloo's threads are born there) and pin gloo to the shaped interface."""
    _setns(f"/var/run/netns/{prefix}n{rank}")
    os.environ["GLOO_SOCKET_IFNAME"] = "tw0"


class Emulation:
    """`slots` namespaces with shaped links; `configure(network)` sets rate/delay, `pool(world)` starts workers
    in them. Use as a context manager."""

    def __init__(self, slots: int):
        why = available()
        if why:
            raise UserError(f"--netem {why}")
        self.slots = slots
        self.tag = str(os.getpid())
        self.prefix = f"tw{self.tag}"
        self.bridge = f"twb{self.tag}"
        self.forwarder: subprocess.Popen | None = None
        self.network: str | None = None
        self._undo: list[tuple[str, ...]] = []   # the commands that remove what _build made, in order made
        self._old_term = None
        self.netem_qdisc = None

    def ns(self, r: int) -> str:
        return f"{self.prefix}n{r}"

    def __enter__(self):
        remove_stale()
        self.netem_qdisc = has_netem_qdisc()  # recorded; the forwarder handles delay either way
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # else the caller's handler unwinds
            self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._undo.append(("ip", "link", "del", self.bridge))
        sh("ip", "addr", "add", f"{CTL_NET}.254/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for r in range(self.slots):
            ns = self.ns(r)
            add_namespace(ns)
            self._undo.append(("ip", "netns", "del", ns))
            ex = ("ip", "netns", "exec", ns)
            host_end, ns_end = f"twv{self.tag}r{r}", f"twp{self.tag}r{r}"
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            sh("ip", "link", "set", ns_end, "netns", ns)
            sh("ip", "link", "set", host_end, "master", self.bridge)
            sh("ip", "link", "set", host_end, "up")
            sh(*ex, "ip", "link", "set", ns_end, "name", "ctl0")
            sh(*ex, "ip", "addr", "add", f"{CTL_NET}.{r + 1}/24", "dev", "ctl0")
            sh(*ex, "ip", "link", "set", "ctl0", "up")
        self.forwarder = subprocess.Popen(
            [sys.executable, "-c", "from thinwire.launcher.netem import forward_main; forward_main()", self.prefix,
             str(self.slots)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=die_with_parent)
        line = self.forwarder.stdout.readline().strip()
        if line != "ready":
            raise UserError(f"--netem: the forwarder did not start ({line or 'no output'})")
        for r in range(self.slots):
            ex = ("ip", "netns", "exec", self.ns(r))
            sh(*ex, "ip", "link", "set", "tw0", "mtu", str(MTU), "txqueuelen", "10000")
            sh(*ex, "ip", "addr", "add", f"{DATA_NET}.{r + 1}/24", "dev", "tw0")
            sh(*ex, "ip", "link", "set", "tw0", "up")

    def configure(self, network: str) -> None:
        """Shape every worker's link like `network`: tbf rate on tw0, delay/jitter/loss in the forwarder."""
        if network == self.network:
            return
        link = parse_network(network)
        for r in range(self.slots):
            set_rate(self.ns(r), "tw0", link.bandwidth)
        self.forwarder.stdin.write(f"{link.latency} {link.jitter} {link.loss}\n")
        self.forwarder.stdin.flush()
        if self.forwarder.stdout.readline().strip() != "ok":
            raise UserError("--netem: the forwarder stopped")
        self.network = network

    def pool(self, world: int):
        """A launcher Pool whose workers live in namespaces 0..world-1."""
        if world > self.slots:
            raise UserError(f"--netem: {world} ranks but only {self.slots} namespaces")
        return Pool(world, host=f"{CTL_NET}.254", timeout=3600.0,
                    worker_init=partial(enter_namespace, self.prefix))

    def close(self) -> None:
        if self.forwarder is not None:
            self.forwarder.kill()
            self.forwarder.wait()
            self.forwarder = None
        for cmd in reversed(self._undo):
            sh(*cmd, check=False)
        self._undo.clear()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


# -- the forwarder process ---------------------------------------------------------------------------------
def _open_tun_in(ns: str) -> int:
    """A TUN device named tw0 created inside namespace `ns` (this process returns to its own)."""
    with inside(ns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"tw0", IFF_TUN | IFF_NO_PI))
    return fd


def forward_main() -> None:
    """argv: prefix, slots. stdin lines `latency jitter loss` (seconds, seconds, probability) reconfigure;
    packets from namespace r to 10.232.0.d+1 are written to namespace d's tw0 after the one-way delay."""
    prefix, slots = sys.argv[1], int(sys.argv[2])
    fds = [_open_tun_in(f"{prefix}n{r}") for r in range(slots)]
    src_of = {fd: r for r, fd in enumerate(fds)}
    latency = jitter = loss = 0.0
    rng = random.Random(0)
    heap: list = []
    last: dict = {}
    seq = 0
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    while True:
        timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else 1.0
        readable, _, _ = select.select(fds + [stdin], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    return
                latency, jitter, loss = (float(v) for v in line.split())
                print("ok", flush=True)
                continue
            src = src_of[fd]
            for _ in range(256):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[16:19] != bytes((10, 232, 0)):
                    continue
                dst = pkt[19] - 1
                if not 0 <= dst < slots or dst == src or (loss and rng.random() < loss):
                    continue
                due = now + latency + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                due = max(due, last.get((src, dst), 0.0))  # delay, never reorder a pair's packets
                last[(src, dst)] = due
                seq += 1
                heapq.heappush(heap, (due, seq, dst, pkt))
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(heap)
            try:
                os.write(fds[dst], pkt)
            except OSError:
                pass  # the destination's queue is full: the packet is lost, TCP resends it
