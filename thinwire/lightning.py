"""PyTorch Lightning: `from thinwire.lightning import ThinwireStrategy` (the extra: pip install 'thinwire[lightning]').
The strategy lives in the run layer (`thinwire.run.lightning`); this module is its public name."""
from .run.lightning import ThinwireStrategy, sidecar

__all__ = ["ThinwireStrategy", "sidecar"]
