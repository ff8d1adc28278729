"""The same race on two hosts and emulated on one machine: each cell's mean step, time to target and bytes.

Two network namespaces on a veth pair (`tests/hosts.py`, root and `ip`/`tc` needed) with the link shaped to
BANDWIDTH each way (the kernel's `tbf`: no latency), one worker per host under torchrun running `thinwire compare`;
then the same `thinwire compare` with `--workers 2 --network custom:bandwidth=GOODPUT` on this machine, GOODPUT being
the link measured as docs/race-your-model.md asks users to measure theirs (iperf3's receiver rate: TCP's payload
through the shaper, which also carries the headers; here one TCP stream from host a to host b for 5 s, timed at the
receiver). The cells' parameters are fixed (the race under torchrun plans for the link as it is, `lan`).

    python tools/two_hosts_race.py [BANDWIDTH [WORKLOAD]]     # default: 50mbit wide-mlp (BENCHMARKS.md)

Set TCP_NO_SLOW_START_AFTER_IDLE=1 to turn TCP's slow start after idle off in both hosts. Results go to
/tmp/two_hosts/<bandwidth>-<workload>/{a/r,emu}.
"""
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from hosts import TwoHosts  # noqa: E402

ALGORITHMS = "bsp;localsgd:period=4"
# host b counts what arrives from the first byte to the end of the stream and prints bit/s (iperf3's receiver rate)
RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind(("", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = len(c.recv(1 << 16)); t0 = time.perf_counter(); n = 0
while (k := len(c.recv(1 << 20))):
    n += k
print(8 * n / (time.perf_counter() - t0))
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); block = bytes(1 << 16); end = time.time() + 5
while time.time() < end:
    c.sendall(block)
c.close()
"""


def goodput(hosts) -> float:
    """Bits per second of TCP payload from host a to host b through the shaped link."""
    port = str(hosts.free_port("b"))
    rx = hosts.popen("b", [sys.executable, "-c", RECEIVER, port], stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    hosts.run("a", [sys.executable, "-c", SENDER, hosts.addr["b"], port], check=True)
    return float(rx.communicate(timeout=30)[0])


def main(bandwidth: str = "50mbit", workload: str = "wide-mlp") -> None:
    race = ["compare", "--workload", workload, "--algorithms", ALGORITHMS, "--budget", "30"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "THINWIRE_NO_PROGRESS": "1"}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    out = f"/tmp/two_hosts/{bandwidth}-{workload}"
    shutil.rmtree(out, ignore_errors=True)
    for h in "ab":
        os.makedirs(f"{out}/{h}")
    print(time.strftime("%H:%M:%S"), "load", os.getloadavg(), flush=True)
    with TwoHosts() as hosts:
        hosts.shape(f"custom:bandwidth={bandwidth}")
        rate = goodput(hosts)
        print(f"goodput a -> b: {rate / 1e6:.2f} Mbit/s through a {bandwidth} shaper", flush=True)
        if os.environ.get("TCP_NO_SLOW_START_AFTER_IDLE"):
            for h in "ab":
                hosts.run(h, ["sysctl", "-w", "net.ipv4.tcp_slow_start_after_idle=0"])
        port = str(hosts.free_port("a"))
        procs = [hosts.popen(h, [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                                 "--master-addr", hosts.addr["a"], "--master-port", port, "-m", "thinwire", *race,
                                 "--out", "r"], cwd=f"{out}/{h}", env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i, h in enumerate("ab")]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("\n".join(o[-2000:] for o in outs))
    print(time.strftime("%H:%M:%S"), "load", os.getloadavg(), flush=True)
    subprocess.run([sys.executable, "-m", "thinwire", *race, "--workers", "2", "--network",
                    f"custom:bandwidth={rate / 1e6:.3f}mbit", "--out", f"{out}/emu"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    print(time.strftime("%H:%M:%S"), "load", os.getloadavg(), flush=True)
    for name, d in (("two hosts", f"{out}/a/r"), ("emulated", f"{out}/emu")):
        with open(f"{d}/results.json") as f:
            r = json.load(f)
        print(name, "reference step (ms)", [round(b["step_time_s"] * 1e3, 2) for b in r["baseline"]["runs"]])
        for c in r["cells"]:
            print(f"  {c['label']:20s} mean step {c['mean_step_s'] * 1e3:8.2f} ms  time to target "
                  f"{c['time_to_target_s']}  MB/step {c['bytes_sent_per_worker_per_step'] / 1e6:.4f}  "
                  f"steps {c['steps']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
