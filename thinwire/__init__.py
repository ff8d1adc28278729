"""thinwire: communication-efficient data-parallel training of PyTorch models over thin wires.

    import thinwire as tw
    trainer = tw.Trainer(model, opt, algorithm="dts", delay=4, period=4, compressor="topk", ratio=0.01)
    with tw.attach(model, opt, algorithm="diloco", period=50): ...   # a loop that calls opt.step() itself
    tw.launch(worker, world_size=4, network="wan")
    wl = tw.Workload("mine", (x, y, x_test, y_test), build=MyNet)   # make() returns it: --workload mod:make
"""
__version__ = "0.1.0"  # the one source of the version: pyproject.toml reads it (setuptools dynamic attr)

import os as _os
import sys as _sys

if "torch" not in _sys.modules:  # large fresh tensors (compressor outputs) fault pages 2x faster with huge pages
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from . import algorithms  # noqa: E402
from .comm import Transport
from .compress import compressors, memories
from .errors import UserError, WorkerError
from .exchange.ddp import ddp_hook
from .net import Link, parse_network
from .trainer import Attachment, Trainer, attach

_LAUNCH = ("Pool", "init", "launch", "report_progress")


def __getattr__(name):
    """The launcher's names and `Workload`, imported when first used (`import thinwire` in a worker loads no
    launcher)."""
    if name in _LAUNCH:
        from . import launcher as _launcher
        return getattr(_launcher, name)
    if name == "Workload":
        from .run.workloads import Workload
        return Workload
    raise AttributeError(f"module 'thinwire' has no attribute {name!r}")


__all__ = ["Attachment", "Link", "Pool", "Trainer", "Transport", "UserError", "WorkerError", "Workload", "algorithms",
           "attach", "compressors", "ddp_hook", "init", "launch", "memories", "parse_network", "report_progress"]
