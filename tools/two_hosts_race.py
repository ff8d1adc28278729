"""The same race on two hosts and emulated on one machine: each cell's mean step, time to target and bytes.

Two network namespaces on a veth pair (`tests/hosts.py`, root and `ip`/`tc` needed) with the link shaped to
BANDWIDTH each way (the kernel's `tbf`: no latency), one worker per host under torchrun running `thinwire compare`;
then the same `thinwire compare` with `--workers 2 --network custom:bandwidth=BANDWIDTH` on this machine. The cells'
parameters are fixed (the race under torchrun plans for the link as it is, `lan`).

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
                    f"custom:bandwidth={bandwidth}", "--out", f"{out}/emu"], env=env, check=True,
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
