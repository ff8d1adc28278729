"""Every script in examples/ runs as its docstring says, and so does every complete program in the README and the
docs (a Python block that launches its workers under `__main__`): each to the end, printing what it promises. They
run at the same time, two at once (each waits on its launcher's start-up and its emulated link part of the time; more
would only crowd two cores), each in a temporary folder."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
AT_ONCE = 2
# script -> (the command its header documents, what its output must hold, the extra it needs)
RUNS = {
    "own_loop.py": ("python examples/own_loop.py", "accuracy 0.", None),
    "ddp_hook.py": ("python examples/ddp_hook.py", "accuracy 0.", None),
    "diloco.py": ("python examples/diloco.py", "s on the emulated wire", None),
    "lightning_diloco.py": ("python examples/lightning_diloco.py", "s on the emulated wire", "lightning"),
    "accelerate_diloco.py": ("accelerate launch --multi_gpu --num_processes 4 --num_machines 1 --mixed_precision no "
                             "--dynamo_backend no examples/accelerate_diloco.py", "30 steps", "accelerate"),
    "race.sh": ("bash examples/race.sh OUT", "report:", None),
    "my_workload.py": ("thinwire train --workload examples/my_workload.py:make --workers 2 --steps 60",
                       "final_accuracy", None),
    "hf_gpt2.py": ("thinwire train --workload examples/hf_gpt2.py:make --workers 2 --steps 30", "final_loss",
                   "transformers"),
}


def test_every_example_is_listed():
    scripts = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    assert scripts == set(RUNS)


@pytest.mark.slow
def test_every_example_and_documented_program_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "THINWIRE_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1"}
    procs, failed, runs = {}, [], dict(RUNS)

    def finish(name):
        out, _ = procs[name].communicate(timeout=600)
        if procs[name].returncode != 0 or runs[name][1] not in out:
            # the head too: a worker's own error (an abort's message) comes before the launcher's report of it
            failed.append(f"--- {name}: exit {procs[name].returncode}\n"
                          + (out if len(out) <= 6000 else f"{out[:3000]}\n[...]\n{out[-3000:]}"))

    for name, (command, _, extra) in RUNS.items():
        text = (EXAMPLES / name).read_text()
        documented = " ".join(text.replace("\\", " ").split())     # continuation lines joined
        assert command.replace(" OUT", "") in documented, f"{name}'s header does not document {command!r}"
        if extra and importlib.util.find_spec(extra) is None:
            continue            # make test installs the extras; elsewhere the two integration examples skip
        argv = command.replace("examples/", f"{EXAMPLES}/").replace("OUT", str(tmp_path / "race")).split()
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        if len(procs) >= AT_ONCE:
            finish(list(procs)[len(procs) - AT_ONCE])
        run_dir = tmp_path / name
        run_dir.mkdir()
        procs[name] = subprocess.Popen(argv, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    from test_docs import complete_programs
    for i, (where, code) in enumerate(complete_programs()):
        if len(procs) >= AT_ONCE:
            finish(list(procs)[len(procs) - AT_ONCE])
        script = tmp_path / f"doc{i}.py"
        script.write_text(code)
        runs[where] = ("", "", None)        # it runs to the end (exit 0); what it prints is its own
        procs[where] = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
    for name in list(procs)[-AT_ONCE:]:
        finish(name)
    assert not failed, "\n".join(failed)
