"""Layers point down only (DESIGN.md): every import inside `thinwire/` goes to the module's own package, to a
package it depends on, or to the shared utilities; an upward import fails here, naming the file and line."""
from __future__ import annotations

import ast
import pathlib

import thinwire

ROOT = pathlib.Path(thinwire.__file__).parent
UTILITIES = {"errors", "files", "optim", "registry", "speeds", "tensors", "trace", "__main__"}
# package -> the packages it may import (DESIGN.md's "depends on", transitively closed)
# compress: nothing — a compressor declares its payload, the exchange chooses the collective and runs the rounds
BELOW: dict[str, set[str]] = {"net": set(), "comm": {"net"}, "compress": set()}
BELOW["exchange"] = {"comm", "compress", "net"} | BELOW["comm"] | BELOW["compress"]
BELOW["sched"] = {"exchange"} | BELOW["exchange"]
BELOW["algorithms"] = {"sched"} | BELOW["sched"]
BELOW["trainer"] = {"algorithms"} | BELOW["algorithms"]
# plan: nominal sizes from compressors, costs from net, the collective the exchange would choose
# (`thinwire.exchange.choose`, pure: the planner predicts with the rule the exchange runs), and what each algorithm
# declares (its class's cost family: `thinwire.algorithms.cost`)
BELOW["plan"] = {"net", "compress", "exchange", "algorithms"} | BELOW["algorithms"]
BELOW["launcher"] = {"comm", "net"}
BELOW["run"] = {"launcher", "trainer", "plan"} | BELOW["trainer"] | BELOW["launcher"]
# integrations: other frameworks' loops (Lightning, Accelerate) around the trainer, above the run layer
BELOW["integrations"] = {"run"} | BELOW["run"]
BELOW["compare"] = {"integrations"} | BELOW["integrations"]
BELOW["bench"] = {"compare"} | BELOW["compare"]
BELOW["cli"] = {"bench"} | BELOW["bench"]
# the integrations' public names (thinwire.lightning, thinwire.accelerate): aliases over the integrations' modules
BELOW["lightning"] = {"integrations"} | BELOW["integrations"]
BELOW["accelerate"] = {"integrations"} | BELOW["integrations"]


def _layer(module: str) -> str | None:
    """'thinwire.comm.engine' -> 'comm'; the top-level package and the utilities have no layer."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return None if parts[1] in UTILITIES else parts[1]


def _imports(path: pathlib.Path, module: str):
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            for name in names:
                yield node.lineno, name


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = "thinwire." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        mine = _layer(module)
        if mine is None:
            continue
        for line, target in _imports(path, module):
            if not target.startswith("thinwire."):
                continue
            theirs = _layer(target)
            if theirs is None or theirs == mine or theirs in BELOW.get(mine, ()):
                continue
            upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_compress_imports_no_network_transport_or_exchange():
    """Compressors declare their payloads and know nothing of collectives: no module of `thinwire.compress` imports
    `net`, `comm` or `exchange`, at the top or inside a function."""
    found = []
    for path in sorted((ROOT / "compress").rglob("*.py")):
        module = ("thinwire." + ".".join(path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        found += [f"{path.relative_to(ROOT.parent)}:{line} imports {target}" for line, target in _imports(path, module)
                  if _layer(target) in ("net", "comm", "exchange")]
    assert not found, "compress imports what it must not know:\n" + "\n".join(found)


def test_every_layer_is_known():
    """Every package and top-level module of thinwire/ is a layer of BELOW (or a utility), and BELOW names none that
    is gone: a new one fails here with its name, not with a KeyError in the other tests."""
    layers = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    layers |= {p.stem for p in ROOT.glob("*.py") if p.stem not in UTILITIES | {"__init__"}}
    unknown, gone = sorted(layers - set(BELOW)), sorted(set(BELOW) - layers)
    assert not unknown, (f"thinwire/ has packages or modules that tests/test_layers.py does not place: {unknown}; "
                         f"add each to BELOW (the layers it may import) or to UTILITIES")
    assert not gone, f"BELOW names layers that thinwire/ no longer has: {gone}"


def _graph() -> dict[str, set[str]]:
    """module -> the thinwire modules it imports (anywhere in it, inside functions too); `from pkg import name`
    counts as an import of pkg.name where that is a module, else of pkg."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = ("thinwire." + ".".join(path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[module] = path
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, target in _imports(path, module):
            while target and target not in modules:       # `from .x import name`: the module x
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_import_circles_between_modules():
    graph, circles, state = _graph(), [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_importing_thinwire_loads_no_launcher():
    import subprocess
    import sys
    code = ("import sys, thinwire; loaded = sorted(m for m in sys.modules if m.startswith(('thinwire.launcher', "
            "'thinwire.run', 'thinwire.integrations', 'thinwire.compare', 'thinwire.bench', 'thinwire.cli'))); print(loaded); "
            "assert not loaded; assert callable(thinwire.launch)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
