"""Nothing that crosses between workers is unpickled (issue 34, item 3): structured state travels as tensors and
a checked JSON layout (`thinwire.comm.state`), and no pickling collective is reachable anywhere in thinwire/."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import thinwire
from thinwire.comm import state

ROOT = pathlib.Path(thinwire.__file__).parent
PICKLING = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
            "broadcast_object", "recv_object_list", "send_object_list", "Unpickler", "dill", "marshal",
            "cloudpickle"}
# the only places that unpickle, and why it is not network bytes
UNPICKLES = {"launcher/pool.py": "the launcher's tasks and results through multiprocessing pipes to its own "
                                 "child processes on this machine",
             "launcher/elastic.py": "the same, for the elastic launcher's own child processes (a member joined by "
                                    "hand hands its result over as JSON)"}
# torch.load: files only (checkpoints, the Lightning strategy's sidecars), always with weights_only=True


def _names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.alias):
            for part in node.name.split("."):
                yield getattr(node, "lineno", 0), part
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value       # getattr(dist, "broadcast_object_list") too


def test_no_pickling_collective_or_unpickling_of_network_bytes_is_reachable():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        for line, name in _names(tree):
            if name in PICKLING:
                found.append(f"{rel}:{line}: {name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if owner == "pickle" and node.func.attr in ("loads", "load") and rel not in UNPICKLES:
                found.append(f"{rel}:{node.lineno}: pickle.{node.func.attr}")
            if owner == "torch" and node.func.attr == "load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    found.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
    assert not found, "pickling reachable:\n" + "\n".join(found)


def _adam_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_round_trips_through_the_format():
    model, opt = _adam_state()
    header, buf = state.pack(opt.state_dict())
    back = state.decode(header, buf)
    want = opt.state_dict()
    assert back["param_groups"] == want["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert set(back["state"]) == set(want["state"]) == {0, 1, 2, 3}
    for k, v in want["state"].items():
        for name, t in v.items():
            assert torch.equal(back["state"][k][name], t) and back["state"][k][name].dtype == t.dtype
    other = torch.optim.Adam(model.parameters(), lr=0.5)
    other.load_state_dict(back)
    assert other.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("header, buffer, message", [
    (b'{"__reduce__": ["os.system", ["true"]]}', 0, "unexpected"),
    (b'{"T": ["object", [2]]}', 0, "bad tensor"),
    (b'{"T": ["float32", [-1]]}', 0, "bad tensor"),
    (b'{"T": ["float32", [2]]}', 4, "the header declares 8"),
    (b'{"D": [[1.5, 2]]}', 0, "bad dict entry"),
    (b'{"L": 3}', 0, "not a list"),
    (b"\x80\x04\x95", 0, "malformed state header"),   # a pickle's opening bytes
])
def test_malformed_state_is_refused(header, buffer, message):
    with pytest.raises(ValueError, match=message):
        state.decode(header, torch.zeros(buffer, dtype=torch.uint8))


def test_state_outside_the_format_is_refused_by_the_sender():
    with pytest.raises(TypeError, match="not part of the state format"):
        state.encode({"fn": print})


def _broadcast(rank, world_size):
    _, opt = _adam_state() if rank == 0 else (None, None)
    got = state.broadcast_state(opt.state_dict() if rank == 0 else None, src=0)
    text = state.broadcast_text("http://127.0.0.1:29400" if rank == 0 else None, src=0)
    return text, {k: {n: t.tolist() for n, t in v.items()} for k, v in got["state"].items()}, \
        got["param_groups"][0]["betas"]


def test_broadcast_state_between_workers(pool2):
    (t0, s0, b0), (t1, s1, b1) = pool2.run(_broadcast)
    assert t0 == t1 == "http://127.0.0.1:29400" and s0 == s1 and b0 == b1 == (0.8, 0.9)
