"""The `thinwire` command. Thin: each subcommand is a module of this package with `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import tempfile
import threading

from thinwire import __version__

from ..errors import UserError, WorkerError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, no usage dump
        raise UserError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thinwire", description="Communication-efficient distributed training over thin wires.")
    parser.add_argument("--version", action="version", version=f"thinwire {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}").register(sub)
    return parser


def parse_extra(tokens: list[str]) -> dict:
    """Turn leftover `--name value` / `--name=value` / `--param name=value` tokens into parameters."""
    params: dict = {}
    rest = iter(tokens)
    for tok in rest:
        if not tok.startswith("--") or len(tok) < 3:
            raise UserError(f"unexpected argument {tok!r}")
        name, eq, value = tok[2:].partition("=")
        if not eq:
            value = next(rest, None)
            if value is None or value.startswith("--"):
                raise UserError(f"option --{name} needs a value")
        if name == "param":
            if "=" not in value:
                raise UserError(f"--param takes key=value, got {value!r}")
            name, value = value.split("=", 1)
        params[name.replace("-", "_")] = value
    return params


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception like Ctrl-C's: the stack unwinds, so pools stop their workers,
    emulated networks are taken down and multiprocessing's resources are released (no leaked semaphores)."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up that follows is not interrupted again
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stacks_aside(e: WorkerError) -> str:
    """The error's message with the workers' stacks of a hang (`WorkerError.stacks`) in a file of their own, named
    at the end of the first line: the report stays as short as it was."""
    if not e.stacks:
        return str(e)
    fd, path = tempfile.mkstemp(prefix="thinwire-stacks-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(e.stacks)
    first, _, rest = str(type(e)(e.rank, e.cause, e.traceback)).partition("\n")     # the message without them
    return f"{first} (every worker's Python stacks: {path})" + (f"\n{rest}" if rest else "")


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if extra and not getattr(args, "accepts_params", False):
            raise UserError(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = parse_extra(extra)
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"thinwire: {_stacks_aside(e)}", file=sys.stderr)
        return 1
    except Terminated:
        print("thinwire: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("thinwire: interrupted", file=sys.stderr)
        return 130
