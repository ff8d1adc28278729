"""`thinwire bench gpu` (issue 31): bad arguments and a machine without CUDA are one line and exit status 2; on
the CPU (`--device cpu`) its parts run the same code at tiny sizes. The whole dry run (with a 4-worker race)
takes minutes on a 2-core machine: `tools/gpu_check.sh` with DRY=1 runs it; here the fast parts run."""
from __future__ import annotations

import json

import pytest
import torch

from thinwire.cli import main


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_arguments_are_one_line_before_any_work(capsys, tmp_path):
    out = tmp_path / "never"
    assert main(["bench", "gpu", "--device", "tpu", "--out", str(out)]) == 2
    assert "cuda, cpu" in _one_line(capsys)
    assert main(["bench", "gpu", "--device", "cpu", "--parts", "compressors,kernels", "--out", str(out)]) == 2
    assert "valid: compressors, overhead, race" in _one_line(capsys)
    assert main(["bench", "gpu", "--device", "cpu", "--budget", "0", "--out", str(out)]) == 2
    assert "--budget" in _one_line(capsys)
    assert not out.exists()


def test_without_cuda_the_gpu_bench_is_one_line(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "gpu", "--out", str(tmp_path / "never")]) == 2
    line = _one_line(capsys)
    assert "no CUDA device" in line and "--device cpu" in line
    assert not (tmp_path / "never").exists()


def test_the_compressor_part_runs_on_the_cpu(capsys, tmp_path):
    assert main(["bench", "gpu", "--device", "cpu", "--parts", "compressors", "--numel", "4096",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "x memcpy" in text and "topk" in text and "compressors: ok" in text
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    rows = report["parts"]["compressors"]["result"]["compressors"]
    assert report["device"] == "cpu" and len(rows) > 20 and not [r for r in rows if "error" in r]


def test_the_overhead_part_times_every_case(monkeypatch):
    from thinwire.bench import gpu
    tiny = {"lm": {"context": 8, "width": 16, "layers": 1, "heads": 2}, "batch": 1, "warmup": 1, "steps": 1,
            "passes": 2}
    rows, text = gpu.overhead_part("cpu", tiny)
    assert [r["case"] for r in rows] == [name for name, _, _ in gpu.OVERHEAD]
    assert not [r for r in rows if "error" in r], rows
    by = {r["case"]: r for r in rows}
    assert by["plain"]["x_plain"] == 1.0 and by["ddp"]["x_ddp"] == 1.0 and by["plain (SGD)"]["x_plain"] == 1.0
    assert "target" in by["tw bsp"] and "target" in by["tw diloco H=1000 (local steps)"]
    assert "x DDP" in text and "plain" in text
    assert all(len(r["passes"]) == 2 and min(r["passes"]) <= r["ms"] <= max(r["passes"]) for r in rows)


def test_bench_compressors_sets_a_parameter_where_it_is_taken(capsys):
    assert main(["bench", "compressors", "--only", "randomk,qsgd", "--set", "ratio=0.25", "--numel", "4096",
                 "--repeat", "1", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["compressors"]}
    assert rows["randomk"]["params"] == {"ratio": "0.25"} and rows["randomk"]["payload_bytes"] == 4096
    assert "params" not in rows["qsgd"] and "error" not in rows["qsgd"]
