"""The embedded launcher: worker processes on one machine (`pool.py`), rendezvous on 127.0.0.1, watchdogs (exit
codes, heartbeats, progress, deadline) and what every worker process shares (`worker.py`), jobs whose membership
changes (`elastic.py`), and the real-network mode: network namespaces, tbf shaping and a delaying forwarder
(`netem.py`). Under torchrun, `init` joins torchrun's job instead."""
from .pool import MAX_LOCAL_WORKERS, DeadlineError, Pool, init, launch, pick_backend, report_progress, under_torchrun
from .worker import PROGRESS_TIMEOUT, NoProgressError

__all__ = ["DeadlineError", "MAX_LOCAL_WORKERS", "NoProgressError", "PROGRESS_TIMEOUT", "Pool", "init", "launch",
           "pick_backend", "report_progress", "under_torchrun"]
