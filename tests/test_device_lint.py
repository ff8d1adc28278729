"""A lint for issue 20: in the hot-path modules, every tensor constructor names its device.

A constructor without `device=` makes a CPU tensor, which breaks (or silently copies through the host) the first
time it meets a CUDA gradient. Where the CPU is meant (a host-side entropy coder, a table built once and moved,
an empty buffer regrown on first use), the call says `device="cpu"` with a comment saying why, so the choice is
visible in review; random draws from a host generator say `device=gen.device` and move the result."""
from __future__ import annotations

import ast
import pathlib

import thinwire

ROOT = pathlib.Path(thinwire.__file__).parent
HOT = ["compress", "exchange", "sched", "algorithms"]
FILES = ["comm/collectives.py", "comm/transport.py", "trainer.py"]
CONSTRUCTORS = {"zeros", "ones", "empty", "full", "arange", "tensor", "randn", "randperm", "rand", "randint",
                "linspace", "eye", "as_tensor"}


def hot_files() -> list[pathlib.Path]:
    out = [p for d in HOT for p in sorted((ROOT / d).glob("*.py"))]
    return out + [ROOT / f for f in FILES]


def offenders(source: str) -> list[tuple[int, str]]:
    """(line, call) of each torch.<constructor>(...) call without a device= keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


def test_the_lint_finds_a_constructor_without_a_device():
    src = "import torch\na = torch.zeros(3, dtype=torch.int64)\nb = torch.zeros(3, device=x.device)\n" \
          "c = torch.randint(2, (4,), generator=g)\nd = x.new_zeros(3)\ne = torch.zeros_like(x)\n"
    assert offenders(src) == [(2, "torch.zeros"), (4, "torch.randint")]


def test_hot_path_constructors_name_their_device():
    files = hot_files()
    assert len(files) > 40 and all(f.exists() for f in files)
    bad = [f"{f.relative_to(ROOT.parent)}:{line}: {call} without device=" for f in files
           for line, call in offenders(f.read_text())]
    assert not bad, "tensor constructors without a device in hot-path modules:\n" + "\n".join(bad)
