"""Errors thinwire raises. A `UserError` is the user's to fix: the CLI prints its one line and exits with 2."""
import importlib
import os
import sys


class UserError(ValueError):
    """Bad input: an unknown name, a value out of range, an invalid combination."""


class WorkerError(RuntimeError):
    """A worker process raised, died or stalled; names the rank and carries its traceback.

    Args:
        rank: the worker's rank (-1: no single rank to blame).
        cause: what happened, one line.
        traceback: the worker's traceback, if it raised.
        stacks: every live worker's Python stacks when the launcher gave up on a hang.
    """

    def __init__(self, rank: int, cause: str, traceback: str = "", stacks: str = ""):
        self.rank, self.cause, self.traceback, self.stacks = rank, cause, traceback, stacks
        msg = f"worker {rank} failed: {cause}"
        if traceback:
            msg += "\n--- traceback of worker %d ---\n%s" % (rank, traceback.rstrip())
        if stacks:          # where every live worker was when the launcher gave up on a hang
            msg += "\n" + stacks.rstrip()
        super().__init__(msg)


class MissingExtra(UserError, ImportError):
    """An optional dependency is not installed; the message is one line naming the pip command. Left uncaught in a
    script, it prints that line alone and exits with status 2, as the CLI does for every `UserError`."""


def require_extra(module: str, extra: str, feature: str):
    """`import module`, or raise `MissingExtra` naming the pip command that installs `extra` (beside the torch pin)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        _exit_2_when_uncaught()
        raise MissingExtra(f"{feature} needs the optional extra {extra!r}: "
                           f"pip install 'thinwire[{extra}]' 'torch==2.13.0'") from None


def _exit_2_when_uncaught() -> None:
    """Make an uncaught `MissingExtra` end the program with its one line and status 2 (any other exception keeps
    Python's own report): installed once, and only where such an error is raised."""
    previous = sys.excepthook
    if getattr(previous, "_thinwire", False):
        return

    def hook(kind, value, tb):
        if not isinstance(value, MissingExtra):
            return previous(kind, value, tb)
        sys.stdout.flush()
        print(f"thinwire: error: {value}", file=sys.stderr, flush=True)
        os._exit(2)     # Python ends an uncaught exception with status 1; nothing was started before the import
    hook._thinwire = True
    sys.excepthook = hook
