"""Under torchrun, `thinwire train` runs as one worker of the job: two "nodes" on localhost, c10d rendezvous."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun comes with torch"
    port = _free_port()
    env = {**os.environ, "THINWIRE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [torchrun, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=thinwire-test", "--max_restarts=0",
           "-m", "thinwire", "train", "--workload", "linreg", "--steps", "8", "--json", "--out", str(tmp_path)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), [o[1][-2000:] for o in outs]
    summaries = [json.loads(o[0][o[0].index("{"):]) for o in outs if "{" in o[0]]
    assert len(summaries) == 1  # only global rank 0 reports
    s = summaries[0]
    assert s["workers"] == 4 and s["steps"] == 8 and s["bytes_sent_per_worker"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["workers"] == 4
