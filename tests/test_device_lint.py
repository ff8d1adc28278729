"""A lint for issue 20: in the hot-path modules, every tensor constructor names its device, and every host read
of a tensor (`.item()`, `.tolist()`) is marked as deliberate.

A constructor without `device=` makes a CPU tensor, which breaks (or silently copies through the host) the first
time it meets a CUDA gradient. Where the CPU is meant (a host-side entropy coder, a table built once and moved,
an empty buffer regrown on first use), the call says `device="cpu"` with a comment saying why, so the choice is
visible in review; random draws from a host generator say `device=gen.device` and move the result.

`.item()` and `.tolist()` on a CUDA tensor wait for the GPU (a host synchronisation). In a hot path a device
tensor serves instead (a scale stays a one-element tensor, a table lookup takes a tensor of values); where a
number must reach the host (a receive buffer's size, a header), it is read once per exchange, not per tensor,
and the line says so with a `# host:` comment (e.g. `# host: once per exchange`). `int(t)` / `float(t)` of a
tensor synchronise the same way but cannot be told from `int(x)` of a number by reading the source: review them."""
from __future__ import annotations

import ast
import pathlib

import thinwire

ROOT = pathlib.Path(thinwire.__file__).parent
HOT = ["comm", "compress", "exchange", "sched", "algorithms", "trainer"]
FILES = ["run/loop.py", "run/lm.py", "run/stepper.py", "compare/peers/counter.py",
         "compare/peers/ddp.py"]   # + the training loop and the peers' steppers
HOST_MARK = "# host:"
HOST_READS = {"item", "tolist"}
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


def _lines_of_statements(tree) -> list[tuple[int, int]]:
    """(first, last) line of every statement; of a compound statement (if, for, with, def ...) its header only."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = max(node.lineno, body[0].lineno - 1) if body else node.end_lineno
            spans.append((node.lineno, last))
    return spans


def host_reads(source: str) -> list[tuple[int, str]]:
    """(line, call) of each `.item()` / `.tolist()` whose statement carries no `# host:` comment on its lines."""
    lines, tree = source.splitlines(), ast.parse(source)
    spans = _lines_of_statements(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READS
                and not node.args and not node.keywords):
            first, last = min((s for s in spans if s[0] <= node.lineno and node.end_lineno <= s[1]),
                              key=lambda s: s[1] - s[0], default=(node.lineno, node.end_lineno))
            if not any(HOST_MARK in line for line in lines[first - 1:last]):
                found.append((node.lineno, f".{node.func.attr}()"))
    return sorted(found)


def test_the_lint_finds_an_unmarked_host_read():
    src = ("a = t.item()\nb = t.tolist()   # host: once per exchange\nc = [x.item() for x in ts]\n"
           "d = f(t.tolist(),\n      1)   # host: the sizes\ne = t.sum(dim=0).tolist()\nf = g.item(3)\n"
           "if flag.item() > 0:\n    x = 1   # host: (a mark in the body does not cover the condition)\n"
           "if flag.item() > 0:   # host: once per step\n    x = 1\n")
    assert host_reads(src) == [(1, ".item()"), (3, ".item()"), (6, ".tolist()"), (8, ".item()")]


def test_hot_path_host_reads_are_marked():
    bad = [f"{f.relative_to(ROOT.parent)}:{line}: {call} without a '{HOST_MARK}' comment" for f in hot_files()
           for line, call in host_reads(f.read_text())]
    assert not bad, ("host reads of tensors in hot-path modules (keep the value on the device, or read it once "
                     "per exchange and say so):\n" + "\n".join(bad))
