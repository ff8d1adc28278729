"""`asp`: asynchronous SGD on the parameter server (Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient
Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, §III-C; Lian, Huang, Li, Liu 2015,
"Asynchronous Parallel Stochastic Gradient for Nonconvex Optimization", arXiv 1506.08272)."""
from __future__ import annotations

from ._registry import register
from .cost import CostFamily
from .ps_sync import PSBSP, StalenessAware


@register("asp")
class ASP(StalenessAware, PSBSP):
    """The server applies each pushed bucket as it arrives: x_{t+1} = x_t - γ_τ G_{i_t}(x_{t-τ_t}) (Lian et al. 2015;
    the survey's eq. 8 in its operational form, since its printed delay indices disagree), with the staleness-aware
    rate and momentum of `StalenessAware` (γ/τ, Zhang et al. 2016; momentum net of the implicit momentum of
    asynchrony, Mitliagkas et al. 2016). τ_t, the updates applied since worker i_t pulled, is recorded
    (`staleness_hist`). A worker pushes each bucket during backward and waits for its own answers at `step()`."""

    rule = "async"
    cost = CostFamily("parameter_server", pace="own")   # each worker waits for its own answers only
