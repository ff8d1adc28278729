"""`asp`: asynchronous SGD on the parameter server (seed 000 §III-C; catalog §2.1.5)."""
from __future__ import annotations

from ._registry import register
from .ps_sync import PSBSP, StalenessAware


@register("asp")
class ASP(StalenessAware, PSBSP):
    """The server applies each pushed bucket as it arrives: x_{t+1} = x_t - γ_τ G_{i_t}(x_{t-τ_t}) (catalog §2.1.5,
    operational form of eq. 8, whose printed indices are an erratum), with the staleness-aware rate and momentum
    of `StalenessAware` (γ/τ, Zhang et al. 2016; momentum net of the implicit momentum of asynchrony, Mitliagkas
    et al. 2016). τ_t, the updates applied since worker i_t pulled, is recorded (`staleness_hist`). A worker
    pushes each bucket during backward and waits for its own answers at `step()`."""

    rule = "async"
