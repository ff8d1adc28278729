"""The race behind `thinwire compare`: the matrix of cells × networks × seeds (`matrix.py`), the presets and cell
syntax (`presets.py`), the no-communication reference, the records and their ranking (`results.py`), the report
(`report.py`) and the plots (`plots.py`)."""
from .matrix import CompareConfig, compare

__all__ = ["CompareConfig", "compare"]
