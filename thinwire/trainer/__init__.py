"""The Trainer room: the user-facing `Trainer` and the `attach` adapter, one idea per module.

- `assembly.py`: the components built from names and keyword parameters, and the checks refused before any
  worker starts (`build_components`, `check_run`, ...);
- `nonfinite.py`: the NaN/Inf policy (`nonfinite_stop`, `FiniteGuard`, ...);
- `trainer.py`: the `Trainer`;
- `resilience.py`: the Trainer's joins and recovery (`Resilience`);
- `attachment.py`: `attach`, the Trainer driven from the optimizer's own step hooks.
"""
from .assembly import build_components, check_elastic, check_on_failure, check_optimizer_of, check_run
from .attachment import Attachment, attach
from .nonfinite import FiniteGuard, nonfinite_flag, nonfinite_params, nonfinite_stop
from .trainer import Trainer

__all__ = ["Attachment", "FiniteGuard", "Trainer", "attach", "build_components", "check_elastic", "check_on_failure",
           "check_optimizer_of", "check_run", "nonfinite_flag", "nonfinite_params", "nonfinite_stop"]
