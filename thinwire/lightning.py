"""PyTorch Lightning: `from thinwire.lightning import ThinwireStrategy` (the extra: pip install 'thinwire[lightning]').
The strategy lives in the integrations room (`thinwire.integrations.lightning`); this module is its public name."""
from .integrations.lightning import ThinwireStrategy, sidecar

__all__ = ["ThinwireStrategy", "sidecar"]
