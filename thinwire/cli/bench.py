"""`thinwire bench NAME ...`: the benchmarks of `thinwire.bench` (one module each), and
`thinwire bench all --out DIR`, which runs every one of them at its defaults and writes each one's output, with
the command and the machine's load, to DIR/NAME.md (the tables of BENCHMARKS.md)."""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import pkgutil
import sys
import time

from .. import bench as benchmarks
from ..errors import UserError
from ..files import check_writable_dir, check_writable_file


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (compressors, overlap, ...) against same-run baselines")
    inner = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=type(p))
    seen: set[str] = set()
    for mod in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{benchmarks.__name__}.{mod.name}")
        if hasattr(module, "register"):         # calibrate and validate are the planner's, not benchmarks
            module.register(inner)
            name = next(n for n in inner.choices if n not in seen)
            seen.add(name)
            inner.choices[name].set_defaults(func=_checked_out(inner.choices[name].get_default("func"),
                                                               getattr(module, "OUT", "directory")))
    names = sorted(inner.choices)
    a = inner.add_parser("all", help="run every benchmark at its defaults; DIR/NAME.md per benchmark")
    a.add_argument("--out", required=True, help="directory for NAME.md (and each benchmark's own files)")
    a.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(names)}")
    a.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    a.set_defaults(func=lambda args: run_all(p, inner, names, args))
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _checked_out(run, kind: str):
    """`run` after its `--out` is checked like every command's (before any work starts): a directory (`kind`
    "directory", most benchmarks) or a file ("file": the benchmarks that write their rows as JSON)."""
    def checked(args):
        out = getattr(args, "out", None)
        if out is not None:
            (check_writable_file if kind == "file" else check_writable_dir)(out, "--out")
        return run(args)
    return checked


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def run_all(bench, inner, names: list[str], args) -> int:
    chosen = [n for n in args.only.split(",") if n] or names
    skip = [n for n in args.skip.split(",") if n]
    bad = [n for n in chosen + skip if n not in names]
    if bad:
        raise UserError(f"unknown benchmark {bad[0]!r}; valid: {', '.join(names)}")
    chosen = [n for n in chosen if n not in skip]
    check_writable_dir(args.out, "--out")
    os.makedirs(args.out, exist_ok=True)
    failed = []
    for i, name in enumerate(chosen, 1):
        argv = [name]
        if any("--out" in a.option_strings for a in inner.choices[name]._actions):
            argv += ["--out", os.path.join(args.out, name)]
        command = "thinwire bench " + " ".join(argv)
        print(f"[{i}/{len(chosen)}] {command}", file=sys.stderr, flush=True)
        path = os.path.join(args.out, f"{name}.md")
        with open(path, "w") as f:
            f.write(f"`{command}` — {time.strftime('%Y-%m-%d %H:%M')}, {_load()} at start\n\n")
            t0 = time.monotonic()
            try:
                with contextlib.redirect_stdout(_Tee(sys.stdout, f)):
                    sub = bench.parse_args(argv)
                    rc = sub.func(sub)
            except Exception as e:          # one benchmark's failure does not lose the others'
                rc = f"{type(e).__name__}: {e}"
            f.write(f"\n({time.monotonic() - t0:.0f} s, {_load()} at the end)\n")
        if rc not in (0, None):
            failed.append(f"{name} ({rc})")
    print(f"written to {args.out}/" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0
