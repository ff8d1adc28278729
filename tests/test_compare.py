"""`thinwire compare`: cell specs and presets (pure logic), a tiny matrix end to end on lan with 2 real gloo
workers (thinwire cells and PyTorch peers), interruption/resume, and the real-network mode (root only)."""
from __future__ import annotations

import json
import os
import time

import pytest

from thinwire.cli.compare import _networks, split_cells
from thinwire.errors import UserError
from thinwire.run import compare as cmp
from thinwire.run import presets


# -- pure logic ------------------------------------------------------------------------------------------------
def test_cell_specs_parse():
    c = presets.parse_cell("bsp+topk:ratio=0.01,memory=residual")
    assert (c.algorithm, c.compressor, c.memory, c.params) == ("bsp", "topk", "residual", {"ratio": 0.01})
    c = presets.parse_cell("dts:delay=4,period=2")
    assert (c.algorithm, c.compressor, c.params) == ("dts", None, {"delay": 4, "period": 2})
    d = presets.parse_cell({"algorithm": "bsp", "compressor": "fp16", "params": {}})
    assert d.label == "bsp+fp16" and d.compressor == "fp16"
    assert presets.parse_cell("ddp-powersgd").peer and not presets.parse_cell("bsp").peer
    with pytest.raises(UserError):
        presets.parse_cell("bsp:ratio")
    with pytest.raises(UserError):
        presets.parse_cell({"compressor": "topk"})
    assert split_cells("bsp,dts:delay=4,period=4,ddp") == ["bsp", "dts:delay=4,period=4", "ddp"]
    assert split_cells("bsp+topk:ratio=0.01,memory=residual,ddp-fp16") == ["bsp+topk:ratio=0.01,memory=residual",
                                                                           "ddp-fp16"]
    assert split_cells("a;b:x=1,y=2") == ["a", "b:x=1,y=2"]
    assert _networks("lan,wan,custom:bandwidth=1gbit,latency=5ms") == ["lan", "wan",
                                                                      "custom:bandwidth=1gbit,latency=5ms"]


def test_strict_cells_raise_and_presets_skip_with_notes():
    with pytest.raises(UserError, match="valid:"):
        presets.resolve(["no-such-algorithm"], strict=True)
    with pytest.raises(UserError, match="parameter"):
        presets.resolve(["bsp:no_such_param=1"], strict=True)
    cells, notes = presets.resolve(["bsp", "no-such-algorithm", "bsp:no_such_param=1", "ddp"], strict=False)
    assert [c.label for c in cells] == ["bsp", "bsp:no_such_param=1", "ddp"]
    assert cells[1].params == {}
    assert any("no-such-algorithm" in n for n in notes) and any("no_such_param" in n for n in notes)
    for name in presets.names():  # every preset resolves to something runnable today
        pr = presets.get(name)
        cells, _ = presets.resolve(pr.cells, strict=False)
        assert cells and all(c.peer or c.algorithm for c in cells)
    with pytest.raises(UserError, match="quick"):
        presets.get("nope")
    assert "bsp" in [c.label for c in presets.resolve(presets.get("quick").cells, strict=False)[0]]


# -- end to end ------------------------------------------------------------------------------------------------
CELLS = ["bsp", "bsp+fp16", "ddp", "ddp-fp16", "ddp-powersgd", "ddp-postlocalsgd:period=2,warmup=2"]


@pytest.fixture(scope="module")
def matrix(pool2, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cmp"))
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan"], cells=CELLS, epochs=1.0,
                            target=0.5)
    t0 = time.perf_counter()
    results = cmp.compare(cfg, out, progress=False, pool=pool2)
    return out, results, time.perf_counter() - t0


def test_matrix_end_to_end(matrix):
    out, results, _ = matrix
    on_disk = json.load(open(os.path.join(out, "results.json")))
    assert [r["label"] for r in on_disk["cells"]] == CELLS
    assert on_disk["baseline"]["throughput_samples_s"] > 0
    for r in on_disk["cells"]:
        assert r["status"] == "ok", r.get("error")
        for k in ("config", "final_accuracy", "best_accuracy", "time_to_target_s", "steps",
                  "bytes_sent_per_worker_per_step", "nominal_bytes_per_worker_per_step", "exposed_comm_s",
                  "throughput_samples_s", "scalability", "predicted_step_time_s", "curve"):
            assert k in r, k
        assert r["steps"] > 0 and r["config"]["workers"] == 2
        assert r["final_accuracy"] > 0.5 and r["scalability"] > 0
        assert r["curve"][0][1] >= 0 and r["curve"][-1][2] == pytest.approx(r["final_accuracy"])
    by = {r["label"]: r for r in on_disk["cells"]}
    nominal = by["bsp"]["nominal_bytes_per_worker_per_step"]
    # byte accounting: thinwire's meter and the peers' counted all-reduces agree on the fp32 and fp16 volumes
    assert by["bsp"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal, rel=0.02)
    assert by["ddp"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal, rel=0.02)
    assert by["ddp-fp16"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal / 2, rel=0.02)
    assert by["bsp+fp16"]["bytes_sent_per_worker_per_step"] == pytest.approx(nominal / 2, rel=0.05)
    assert by["ddp-powersgd"]["bytes_sent_per_worker_per_step"] < nominal / 2
    assert by["ddp-postlocalsgd:period=2,warmup=2"]["bytes_sent_per_worker_per_step"] < nominal
    assert all(by[p]["peer"] for p in ("ddp", "ddp-fp16", "ddp-powersgd")) and not by["bsp"]["peer"]
    # the same workload, seed and shards: plain DDP and thinwire's bsp train the same model
    assert by["ddp"]["final_accuracy"] == pytest.approx(by["bsp"]["final_accuracy"], abs=0.02)


def test_report_and_plots(matrix):
    out, results, _ = matrix
    report = open(os.path.join(out, "report.md")).read()
    assert "**Winner: `" in report and "| rank | contestant |" in report
    assert "PyTorch peer" in report and "bucket" in report
    for png in ("accuracy_vs_time.png", "accuracy_vs_bytes.png"):
        path = os.path.join(out, png)
        assert os.path.getsize(path) > 10_000 and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        assert png in report


def test_interrupted_matrix_keeps_cells_and_resumes(matrix, pool2, tmp_path, monkeypatch):
    src, results, _ = matrix
    out = str(tmp_path)
    cfg = cmp.CompareConfig(workload="digits-mlp", workers=2, networks=["lan", "dc"], cells=["bsp", "ddp-fp16"],
                            epochs=1.0, target=0.5)
    state = cmp.new_results(cfg)
    state["baseline"] = results["baseline"]
    real = cmp.Harness.run_cell
    calls = []

    def interrupt_on_third(self, cell, network):
        calls.append(cmp.cell_key(cell.label, network))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, cell, network)

    monkeypatch.setattr(cmp.Harness, "run_cell", interrupt_on_third)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(state, f)
    with pytest.raises(KeyboardInterrupt):
        cmp.compare(None, out, resume=True, progress=False, pool=pool2)
    kept = json.load(open(os.path.join(out, "results.json")))
    assert [r["key"] for r in kept["cells"]] == ["bsp @ lan", "ddp-fp16 @ lan"]
    assert os.path.exists(os.path.join(out, "report.md"))  # a partial report of what is done
    first = {r["key"]: r["train_s"] for r in kept["cells"]}
    monkeypatch.setattr(cmp.Harness, "run_cell", real)
    done = cmp.compare(None, out, resume=True, progress=False, pool=pool2)
    assert [r["key"] for r in done["cells"]] == ["bsp @ lan", "ddp-fp16 @ lan", "bsp @ dc", "ddp-fp16 @ dc"]
    assert {r["key"]: r["train_s"] for r in done["cells"][:2]} == first  # kept, not re-run
    assert os.path.exists(os.path.join(out, "time_to_target_vs_network.png"))
    with pytest.raises(UserError, match="nothing to resume"):
        cmp.compare(None, str(tmp_path / "empty"), resume=True)


def test_cli_rejects_bad_input():
    import argparse
    import subprocess
    import sys

    from thinwire.cli.compare import config_from_args
    r = subprocess.run([sys.executable, "-m", "thinwire", "compare", "--algorithms", "bsp,nope", "--network", "lan",
                        "--out", "/tmp/thinwire-never"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "valid:" in r.stderr and not os.path.exists("/tmp/thinwire-never")
    base = dict(preset=None, algorithms=None, workload=None, workers=None, network=None, epochs=None, target=None,
                budget=None, seed=0, trace=False, netem=False)
    with pytest.raises(UserError, match="quick"):
        config_from_args(argparse.Namespace(**{**base, "preset": "nope"}))
    with pytest.raises(UserError, match="--algorithms"):
        config_from_args(argparse.Namespace(**base))
    cfg = config_from_args(argparse.Namespace(**{**base, "preset": "quick", "network": "lan,wan", "workers": 2}))
    assert cfg.networks == ["lan", "wan"] and cfg.workers == 2 and cfg.workload == "wide-mlp"


# -- real-network mode -----------------------------------------------------------------------------------------
def _netem_skip():
    from thinwire.run.netem import available
    return available()


needs_root = pytest.mark.skipif(_netem_skip() is not None, reason=f"--netem: {_netem_skip()}")


def _timings(rank, world, nbytes):
    import torch
    import torch.distributed as dist
    t = torch.zeros(nbytes // 4)
    dist.barrier()
    out = []
    for _ in range(3):  # ping-pong between ranks 0 and 1: one round trip
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t[:1], 1)
            dist.recv(t[:1], 1)
        elif rank == 1:
            dist.recv(t[:1], 0)
            dist.send(t[:1], 0)
        out.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t[:1], 1)
    elif rank == 1:
        dist.recv(t, 0)
        dist.send(t[:1], 0)
    return min(out), time.perf_counter() - t0


@needs_root
def test_netem_shapes_real_links_and_cleans_up():
    import subprocess

    from thinwire.run.netem import Emulation
    with Emulation(2) as em:
        assert em.netem_qdisc is False or em.netem_qdisc is True
        prefix = em.prefix
        assert sum(prefix in ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines()) == 2
        em.configure("custom:bandwidth=20mbit,latency=20ms")
        pool = em.pool(2)
        try:
            rtt, bulk = pool.run(_timings, 1_000_000)[0]
            em.configure("lan")
            rtt_lan, _ = pool.run(_timings, 1_000_000)[0]
        finally:
            pool.close()
    assert 0.038 < rtt < 0.2          # 2 × 20 ms one-way, through the forwarder
    assert rtt_lan < 0.02
    assert bulk > 0.35                 # 1 MB at 20 Mbit/s is 0.4 s by tbf (+ one round trip)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left
    assert f"twb{prefix[2:]}" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def emulated_vs_real():
    """bsp and dts on `wan`, 4 workers, in the same namespaces: once with the Transport's in-process emulation
    over an unshaped link, once on the real shaped link with no in-process emulation."""
    from thinwire.run.compare import _PoolView
    from thinwire.run.netem import Emulation
    from thinwire.run.train import TrainConfig, run_training
    out = {}
    with Emulation(4) as em:
        pool = em.pool(4)
        try:
            for mode in ("emulated", "real"):
                em.configure("lan" if mode == "emulated" else "wan")
                view = _PoolView(pool, 300, netem=mode == "real")
                for algo in ("bsp", "dts"):
                    cfg = TrainConfig(workload="digits-mlp", algorithm=algo, workers=4, steps=16, eval_every=8,
                                      network="wan" if mode == "emulated" else "lan", progress=False)
                    out[mode, algo] = run_training(cfg, pool=view)
        finally:
            pool.close()
    return out


@needs_root
@pytest.mark.slow
def test_real_network_mode_trains_the_same(emulated_vs_real):
    for algo in ("bsp", "dts"):
        e, r = emulated_vs_real["emulated", algo], emulated_vs_real["real", algo]
        assert r["final_accuracy"] == pytest.approx(e["final_accuracy"], abs=1e-9)  # same computation
        assert r["bytes_sent_per_worker"] == e["bytes_sent_per_worker"]
        assert r["emulated_comm_s"] == 0 < e["emulated_comm_s"]  # the real link, not the model, delays it
    real_bsp = emulated_vs_real["real", "bsp"]
    assert real_bsp["train_s"] / real_bsp["steps"] > 6 * 0.05  # a ring all-reduce: >= 2(n-1) one-way latencies


@needs_root
@pytest.mark.slow
def test_emulator_step_time_within_20_percent_of_real_network(emulated_vs_real):
    for algo in ("bsp", "dts"):
        e, r = emulated_vs_real["emulated", algo], emulated_vs_real["real", algo]
        ratio = (r["train_s"] / r["steps"]) / (e["train_s"] / e["steps"])
        assert 0.8 < ratio < 1.2, (algo, ratio)
