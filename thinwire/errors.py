"""Errors thinwire raises. A `UserError` is the user's to fix: the CLI prints its one line and exits with 2."""


class UserError(ValueError):
    """Bad input: an unknown name, a value out of range, an invalid combination."""


class WorkerError(RuntimeError):
    """A worker process raised, died or stalled; names the rank and carries its traceback."""

    def __init__(self, rank: int, cause: str, traceback: str = ""):
        self.rank, self.cause, self.traceback = rank, cause, traceback
        msg = f"worker {rank} failed: {cause}"
        if traceback:
            msg += "\n--- traceback of worker %d ---\n%s" % (rank, traceback.rstrip())
        super().__init__(msg)
