"""`asp`: asynchronous SGD on the parameter server (seed 000 §III-C; catalog §2.1.5)."""
from __future__ import annotations

from ..errors import UserError
from . import register
from .ps_sync import PSAlgorithm

_SCALES = ("mean", "full")


@register("asp")
class ASP(PSAlgorithm):
    """The server applies each gradient as it arrives: x_{t+1} = x_t - γ G_{i_t}(x_{t-τ_t}) (catalog §2.1.5,
    operational form of eq. 8, whose printed indices are an erratum). τ_t, the model versions applied since
    worker i_t pulled, is recorded for every update (`staleness_hist` in the metrics). `scale="mean"` (default)
    uses γ/n per gradient, so n asynchronous updates move the model as far as one synchronous step of the mean
    gradient; `scale="full"` uses γ per gradient."""

    mode = "async"

    def __init__(self, architecture: str | None = None, scale: str = "mean", servers: int = 1,
                 downlink_compressor: str = "none"):
        super().__init__(architecture, servers, downlink_compressor)
        if scale not in _SCALES:
            raise UserError(f"asp scale must be one of {', '.join(_SCALES)}, got {scale!r}")
        self.scale = scale

    def server_options(self):
        n = self.layout.workers
        return {"mode": "async", "lr_scale": 1.0 / n if self.scale == "mean" else 1.0}
