"""Two hosts with their own addresses (tests/hosts.py: network namespaces on a veth pair), running what
docs/multi-host.md shows: its torchrun script and commands across the two, and its elastic job on one that a
worker on the other joins; the job's store and gloo sockets listen on the address given and nowhere else.
Skipped, with the reason, where this machine cannot make network namespaces."""
from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "multi-host.md"
DOC_ADDR = "10.0.0.1"       # machine A on the page


def _page_block(lang: str, needle: str) -> str:
    blocks = [code for kind, code in re.findall(r"```(\w*)[^\n]*\n(.*?)```", PAGE.read_text(), flags=re.S)
              if kind == lang and needle in code]
    assert len(blocks) == 1, f"docs/multi-host.md: expected one {lang} block with {needle!r}"
    return blocks[0]


def _commands(block: str, first: str) -> list[str]:
    """The commands of a bash block that start with `first` (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in text.splitlines() if line.strip().startswith(first)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THINWIRE_NO_PROGRESS": "1"}


def _run_on_two_hosts(hosts, commands, cwd) -> list[str]:
    """The page's two torchrun commands, node 0 on host a (the master, its address and a free port in place of
    the page's) and node 1 on host b, each in `cwd(host)`; both must exit 0. Their outputs."""
    assert len(commands) == 2
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    port = str(hosts.free_port("a"))
    procs = []
    for host, command in zip("ab", commands):
        assert f"--node-rank {'01'[host == 'b']}" in command
        argv = [torchrun if a == "torchrun" else hosts.addr["a"] if a == DOC_ADDR else port if a == "29500" else a
                for a in shlex.split(command)]
        procs.append(hosts.popen(host, argv, cwd=cwd(host), env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    return outs


def test_torchrun_trains_across_two_hosts(two_hosts, tmp_path):
    """The page's script under the page's two torchrun commands, node 0 on host a (the master address) and node 1
    on host b: both ranks end with the same model and count the bytes they sent. (gloo would listen on the
    address the host name resolves to, 127.0.0.1 here, unless tw.init() pins it to the interface that reaches
    the master: before it did, rank 1 hung at the first collective.)"""
    hosts = two_hosts
    script = tmp_path / "train.py"
    script.write_text(_page_block("python", "tw.init()"))
    commands = _commands(_page_block("bash", "--master-port 29500 train.py"), "torchrun ")
    assert all(f"--master-addr {DOC_ADDR}" in c for c in commands)
    outs = _run_on_two_hosts(hosts, [c.replace(" train.py", f" {script}") for c in commands], lambda host: tmp_path)
    lines = [re.search(r"rank (\d) of (\d): model (\w+), ([\d.]+) MB sent", o) for o in outs]
    assert all(lines), outs
    assert sorted(int(m[1]) for m in lines) == [0, 1] and {m[2] for m in lines} == {"2"}
    assert lines[0][3] == lines[1][3]                       # one model on both hosts
    assert all(float(m[4]) > 0 for m in lines)


def test_a_race_runs_on_two_hosts(two_hosts, tmp_path):
    """The page's `thinwire compare` under torchrun, node 0 on host a and node 1 on host b (linreg, a budget of 2 s
    instead of digits-mlp and 30 s): rank 0, on host a, writes the report of the reference and both cells, each
    trained by the two hosts over their link with no emulation (no emulated time, bytes sent); host b writes
    nothing, and both end with rank 0's status."""
    hosts = two_hosts
    commands = _commands(_page_block("bash", "thinwire compare"), "torchrun ")
    assert all("--budget 30 --out results/cluster" in c for c in commands)
    for host in "ab":
        (tmp_path / host).mkdir()
    outs = _run_on_two_hosts(hosts, [c.replace("--budget 30", "--budget 2").replace("digits-mlp", "linreg")
                                     for c in commands], lambda host: tmp_path / host)
    assert "report: results/cluster/report.md" in outs[0] and "report:" not in outs[1], outs
    assert not (tmp_path / "b" / "results").exists()
    out = tmp_path / "a" / "results" / "cluster"
    r = json.loads((out / "results.json").read_text())
    assert r["matrix"]["torchrun"] and r["matrix"]["workers"] == 2 and r["matrix"]["networks"] == ["lan"]
    ref = r["baseline"]["runs"]
    assert len(ref) == 1 and ref[0]["throughput_samples_s"] > 0 and ref[0]["config"]["algorithm"] == "local"
    cells = {c["label"]: c for c in r["cells"]}
    assert set(cells) == {"bsp", "localsgd"} and all(c["status"] == "ok" for c in cells.values()), cells
    for c in cells.values():
        assert c["workers"] == 2 and len(c["steps_per_worker"]) == 2 and c["steps"] > 0
        assert c["emulated_comm_s"] == 0 and c["bytes_sent_per_worker"] > 0
        assert c["scalability"] is not None
    report = (out / "report.md").read_text()
    assert "processes torchrun started" in report and "No-communication reference" in report
    assert "`bsp`" in report and "`localsgd`" in report


JOINER = """
import os, sys, time
import torch                    # imported while the job starts: the joiner comes in early
import thinwire.run.train
from thinwire.cli import main
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
sys.exit(main(sys.argv[2:] + ["--join", open(sys.argv[1]).read()]))
"""


@pytest.fixture(scope="module")
def elastic_across(two_hosts, tmp_path_factory):
    """The page's elastic job on host a (`--listen` its address) and its `--join` from host b: 100 steps instead
    of 3000, on an emulated link with 10 ms of latency (each step of the job's two workers waits at least 20 ms:
    the joiner, which imported torch while the job started, comes in seconds before the end). Returns the job's
    summary, the joiner's stderr, the job's store port and printed address, every listening socket seen on host
    a during the run, and what connecting to that port at host a's 127.0.0.1 gave."""
    hosts = two_hosts
    tmp = tmp_path_factory.mktemp("elastic")
    block = _page_block("bash", "--listen")
    job_cmd, join_cmd = _commands(block, "thinwire train ")
    assert "--elastic" in job_cmd and "--join" in join_cmd
    port = str(hosts.free_port("a"))
    fast = ["--network", "custom:latency=10ms", "--quiet"]

    def argv(command: str) -> list[str]:
        assert command.startswith("thinwire train ") and "--steps 3000" in command and f"{DOC_ADDR}:29600" in command
        command = command.replace("--steps 3000", "--steps 100")
        command = command.replace(f"{DOC_ADDR}:29600", f"{hosts.addr['a']}:{port}")
        return command.split()[1:] + fast
    job_args = argv(job_cmd)
    join_args = argv(join_cmd)
    i = join_args.index("--join")
    join_args = join_args[:i] + join_args[i + 2:]           # the address comes from what the job prints
    go, files = tmp / "address", {n: open(tmp / n, "w+") for n in ("job.out", "job.err", "joiner.err")}
    joiner = hosts.popen("b", [sys.executable, "-c", JOINER, str(go), *join_args], cwd=tmp, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=files["joiner.err"])
    job = hosts.popen("a", [sys.executable, "-m", "thinwire", *job_args, "--json"], cwd=tmp, env=_env(),
                      stdout=files["job.out"], stderr=files["job.err"])
    printed = None
    while printed is None:
        assert job.poll() is None, (tmp / "job.err").read_text()[-3000:]
        printed = re.search(r"--join (\S+)`", (tmp / "job.err").read_text())
        time.sleep(0.05)
    (tmp / "address.tmp").write_text(printed[1])
    os.rename(tmp / "address.tmp", go)
    seen, local = set(), None
    while job.poll() is None:
        seen |= set(hosts.listening("a"))
        if local is None:
            with hosts.socket("a") as s:
                local = s.connect_ex(("127.0.0.1", int(port)))
        time.sleep(0.2)
    joiner.wait(timeout=120)
    for f in files.values():
        f.close()
    assert job.returncode == 0, (tmp / "job.err").read_text()[-3000:]
    joined = (tmp / "joiner.err").read_text()
    assert joiner.returncode == 0, joined[-3000:]
    return {"summary": json.loads((tmp / "job.out").read_text()), "joiner": joined, "port": port,
            "address": printed[1], "seen": seen, "local": local}


def test_a_worker_on_another_host_joins_an_elastic_job(two_hosts, elastic_across):
    s, joined = elastic_across["summary"], elastic_across["joiner"]
    assert elastic_across["address"] == f"{two_hosts.addr['a']}:{elastic_across['port']}"
    gens = s["elastic"]["generations"]
    assert [g["kind"] for g in gens] == ["start", "join"] and gens[1]["joined"] == [2], gens
    assert gens[1]["members"] == [0, 1, 2] and s["workers"] == 3 and s["steps"] == 100
    m = re.search(r"joined the elastic job at (\S+) as member 2: steps (\d+)\.\.100, final ([\d.]+)", joined)
    assert m and m[1] == elastic_across["address"], joined
    assert int(m[2]) < 100 and abs(float(m[3]) - s["final_accuracy"]) < 1e-4   # it trained the job's model


def test_the_elastic_store_and_gloo_listen_only_on_the_address_given(two_hosts, elastic_across):
    """Every socket listening on host a while the job ran (its store, its workers' gloo sockets) is on host a's
    address; its loopback refuses the store's port (ECONNREFUSED), though the store listens on it at the address."""
    seen, addr = elastic_across["seen"], two_hosts.addr["a"]
    assert f"{addr}:{elastic_across['port']}" in seen and len(seen) >= 3, seen    # the store and 2 workers' gloo
    assert all(a.rpartition(":")[0] == addr for a in seen), seen
    assert elastic_across["local"] == errno.ECONNREFUSED


def test_gloo_goes_on_the_interface_that_reaches_the_host(two_hosts, monkeypatch):
    """`pin_gloo`'s choice, on host a: its own address and host b's are both reached through the veth end; the
    loopback through lo; 0.0.0.0 (every interface) and an unresolvable name leave gloo's own choice."""
    from thinwire.launcher import netem
    from thinwire.launcher.worker import interface_to, pin_gloo
    with netem.inside(two_hosts.ns["a"]):
        got = {h: interface_to(h) for h in (two_hosts.addr["a"], two_hosts.addr["b"], "127.0.0.1", "0.0.0.0",
                                            "no-such-host.invalid")}
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")           # recorded, so the teardown restores what was there
        monkeypatch.delenv("GLOO_SOCKET_IFNAME")
        pin_gloo(two_hosts.addr["b"])
        pinned = os.environ.get("GLOO_SOCKET_IFNAME")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")       # the user's choice stands
        pin_gloo(two_hosts.addr["b"])
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    a = two_hosts.ifname["a"]
    assert got == {two_hosts.addr["a"]: a, two_hosts.addr["b"]: a, "127.0.0.1": "lo", "0.0.0.0": None,
                   "no-such-host.invalid": None}
    assert pinned == a


@pytest.mark.parametrize("listen, message", [
    ("10.0.0.1:http", "--listen takes HOST or HOST:PORT"),
    (":29600", "--listen takes HOST or HOST:PORT"),
    ("10.0.0.1:70000", "--listen takes HOST or HOST:PORT"),
])
def test_a_bad_listen_address_is_refused_in_one_line(listen, message):
    from thinwire.errors import UserError
    from thinwire.run.train import TrainConfig
    cfg = TrainConfig(workload="linreg", workers=1, elastic="1:2", steps=5, listen=listen)
    with pytest.raises(UserError, match=message) as e:
        cfg.validate()
    assert "\n" not in str(e.value)


def test_listen_goes_with_an_elastic_job_and_an_address_of_this_machine():
    """`--listen` without `--elastic` is refused; one that no interface here holds is refused before any worker
    starts (the store binds it first). HOST, HOST:PORT and [IPv6]:PORT are read as such."""
    from thinwire.errors import UserError
    from thinwire.run.train import TrainConfig, run_elastic
    with pytest.raises(UserError, match="--listen is where an elastic job listens"):
        TrainConfig(workload="linreg", workers=1, steps=5, listen="10.0.0.1").validate()
    read = {text: TrainConfig(workload="linreg", workers=1, elastic="1:2", listen=text).listen_address()
            for text in ("10.0.0.1", "10.0.0.1:29600", "[::1]:5", "0.0.0.0:0")}
    assert read == {"10.0.0.1": ("10.0.0.1", 0), "10.0.0.1:29600": ("10.0.0.1", 29600), "[::1]:5": ("::1", 5),
                    "0.0.0.0:0": ("0.0.0.0", 0)}
    assert TrainConfig(workload="linreg", workers=1, elastic="1:2").listen_address() == ("127.0.0.1", 0)
    from unittest import mock

    from thinwire.launcher import elastic

    class Tripwire:     # were the address not checked first, a worker would be spawned
        def __getattr__(self, name):
            raise AssertionError(f"started despite a bad address (multiprocessing {name})")
    cfg = TrainConfig(workload="linreg", workers=1, elastic="1:2", steps=5, listen="203.0.113.1", progress=False)
    with mock.patch.object(elastic, "ctx", Tripwire()), \
            pytest.raises(UserError, match=r"^cannot listen on 203\.0\.113\.1:0: no interface of this machine "
                                          r"has that address$"):
        run_elastic(cfg.validate())


def test_joining_a_store_that_is_no_elastic_job_fails_in_one_line(monkeypatch):
    """A thinwire store with no elastic job in it (a job that has not begun its run, a plain Pool's): the joiner
    waits for the job's run a few seconds, then says so in one line."""
    from thinwire.errors import UserError
    from thinwire.launcher import elastic
    from thinwire.launcher.worker import serve_store
    monkeypatch.setattr(elastic, "STORE_ANSWER_S", 1.0)
    store = serve_store("127.0.0.1", 0, 30)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=rf"^127\.0\.0\.1:{store.port} is no thinwire elastic job$"):
        elastic.join_by_hand(f"127.0.0.1:{store.port}", print)
    assert time.monotonic() - t0 >= 1.0
    del store
