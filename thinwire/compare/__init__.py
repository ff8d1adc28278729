"""The race behind `thinwire compare`: the matrix of cells × networks × seeds and the no-communication reference
(`matrix.py`), the planner's forecast of the race (`forecast.py`), the presets and cell syntax (`presets.py`), the
records and their ranking (`results.py`), the report (`report.py`), the plots (`plots.py`), the peers (`peers/`) and the race on torchrun's processes (`cluster.py`)."""
from .matrix import CompareConfig, compare

__all__ = ["CompareConfig", "compare"]
