"""The user-facing `Trainer` (`trainer.py`; its joins and recovery: `resilience.py`), `attach` (`attachment.py`),
the components built from names with the checks made before any worker starts (`assembly.py`) and the NaN/Inf
policy (`nonfinite.py`)."""
from .assembly import build_components, check_elastic, check_on_failure, check_optimizer_of, check_run
from .attachment import Attachment, attach
from .nonfinite import FiniteGuard, nonfinite_flag, nonfinite_params, nonfinite_stop
from .trainer import Trainer

__all__ = ["Attachment", "FiniteGuard", "Trainer", "attach", "build_components", "check_elastic", "check_on_failure",
           "check_optimizer_of", "check_run", "nonfinite_flag", "nonfinite_params", "nonfinite_stop"]
