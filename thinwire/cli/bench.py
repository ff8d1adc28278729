"""`thinwire bench NAME ...`: the benchmarks of `thinwire.run.benchmarks` (one module each)."""
from __future__ import annotations

import importlib
import pkgutil


def register(sub) -> None:
    from ..run import benchmarks
    p = sub.add_parser("bench", help="benchmarks (compressors, overlap, ...) against same-run baselines")
    inner = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=type(p))
    for mod in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{benchmarks.__name__}.{mod.name}").register(inner)
    p.set_defaults(func=lambda args: p.print_help() or 2)
