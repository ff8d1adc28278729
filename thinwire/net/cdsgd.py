"""The time model of Yu, Dong, Xu, Ouyang, Liao 2021, "CD-SGD: Distributed Stochastic Gradient Descent with
Compression and Delay Compensation", arXiv 2106.10796, §2–3.3: iteration time of S-SGD, OD-SGD (local update),
BIT-SGD and CD-SGD.

Inputs (seconds per iteration, Table 1 of the paper): τ compute (forward + backward), φ uncompressed
communication, ψ compressed communication, δ the extra time of compression (encode + decode).
The algorithms of `thinwire.algorithms.cdsgd` measure these on their own run and report the prediction beside
the measured iteration time in `metrics()`.
"""
from __future__ import annotations


def ssgd(tau: float, phi: float) -> float:
    """T^ssgd = τ + φ (eq. 2)."""
    return tau + phi


def local_update(tau: float, phi: float) -> float:
    """T^loc = τ if τ > φ else φ (eq. 4): OD-SGD hides communication behind the next iteration."""
    return tau if tau > phi else phi


def bitsgd(tau: float, psi: float, delta: float) -> float:
    """T^bit = τ + δ + ψ (eq. 5)."""
    return tau + delta + psi


def compressed(i: int, k: int) -> bool:
    """Whether CD-SGD's iteration i (counted from the first formal iteration, 0-based) is compressed:
    i mod k ≠ 0 (eq. 6, Algorithm 1 line 23); k = 0 means never corrected (always compressed)."""
    return k == 0 or i % k != 0


def cd_communication(i: int, k: int, phi: float, psi: float, delta: float) -> float:
    """φ^cd of iteration i (eq. 6): δ + ψ on compressed iterations, φ on correction iterations."""
    return delta + psi if compressed(i, k) else phi


def cdsgd_iteration(i: int, k: int, tau: float, phi: float, psi: float, delta: float) -> float:
    """T^cd of iteration i (eq. 7): τ if τ > φ^cd, else φ^cd (δ + ψ or φ)."""
    return local_update(tau, cd_communication(i, k, phi, psi, delta))


def cdsgd(tau: float, phi: float, psi: float, delta: float, k: int) -> float:
    """Mean T^cd over one period of k iterations; when communication dominates it is
    ((k−1)(δ+ψ) + φ)/k (§3.3 ②)."""
    period = max(1, k)
    return sum(cdsgd_iteration(i, k, tau, phi, psi, delta) for i in range(period)) / period


def saving_vs_local(i: int, k: int, tau: float, phi: float, psi: float, delta: float) -> float:
    """T_s^loc = T^loc − T^cd of iteration i (eq. 8). Computed as the difference of eqs. 4 and 7, which
    is the printed case table wherever its cases apply (its case 3, φ − δ − ψ, assumes τ < φ)."""
    return local_update(tau, phi) - cdsgd_iteration(i, k, tau, phi, psi, delta)


def saving_vs_bit(i: int, k: int, tau: float, phi: float, psi: float, delta: float) -> float:
    """T_s^bit = T^bit − T^cd of iteration i (eq. 9): δ+ψ if τ > φ^cd; τ on compressed iterations
    with τ < φ^cd; τ + δ + ψ − φ on correction iterations with τ < φ^cd."""
    return bitsgd(tau, psi, delta) - cdsgd_iteration(i, k, tau, phi, psi, delta)


def predict(algorithm: str, tau: float, phi: float | None = None, psi: float | None = None,
            delta: float | None = None, k: int = 5) -> float | None:
    """Predicted mean iteration time of `algorithm` (ssgd/bsp, odsgd, bitsgd, cdsgd) after warm-up;
    None when an input it needs is unknown."""
    need = {"ssgd": (phi,), "bsp": (phi,), "odsgd": (phi,), "bitsgd": (psi, delta),
            "cdsgd": (phi, psi, delta) if k != 1 else (phi,)}
    if algorithm not in need:
        raise ValueError(f"no time model for {algorithm!r}; valid: {', '.join(need)}")
    if tau is None or any(v is None for v in need[algorithm]):
        return None
    if algorithm in ("ssgd", "bsp"):
        return ssgd(tau, phi)
    if algorithm == "odsgd":
        return local_update(tau, phi)
    if algorithm == "bitsgd":
        return bitsgd(tau, psi, delta)
    return cdsgd(tau, phi, psi or 0.0, delta or 0.0, k)


def predict_all(tau: float, phi: float | None, psi: float | None, delta: float | None, k: int = 5) -> dict:
    """The four predictions side by side (None where an input is unknown)."""
    return {name: predict(name, tau, phi, psi, delta, k) for name in ("ssgd", "bitsgd", "odsgd", "cdsgd")}
