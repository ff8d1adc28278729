"""Running things: the local launcher, workloads, training runs, the comparison harness."""
from .launcher import Pool, init, launch, report_progress, under_torchrun

__all__ = ["Pool", "init", "launch", "report_progress", "under_torchrun"]
