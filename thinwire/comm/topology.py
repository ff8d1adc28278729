"""Gossip topologies: who talks to whom at each step, with the mixing matrix W and its spectral gap.

Static topologies use Metropolis–Hastings weights W_ij = 1/(1 + max(d_i, d_j)) on their edges and
W_ii = 1 - Σ_j W_ij (Xiao, Boyd 2004, "Fast Linear Iterations for Distributed Averaging"): symmetric and
doubly stochastic (W = Wᵀ, W1 = 1; Tang, Shi, Chu, Wang, Li 2020, "Communication-Efficient Distributed Deep
Learning: A Comprehensive Survey", arXiv 2003.06307, §VIII, prints "W1 = W"). The spectral gap is 1 - ρ with
ρ = max(|λ2(W)|, |λn(W)|), the second-largest eigenvalue magnitude (what Tang et al. §VIII calls the spectral gap).

| name | edges | W | gap (n = 4 / 8 / 16) |
| --- | --- | --- | --- |
| `ring` | i ± 1 | 1/3 each (1/2 for n = 2) | 0.667 / 0.195 / 0.051 |
| `torus` | 2-D grid X×Y with wrap-around (n = X·Y, X, Y ≥ 2) | Metropolis–Hastings | 0.667 / 0.5 / 0.4 |
| `exponential` | i ± 2^k, k = 0..⌊log2(n-1)⌋ | Metropolis–Hastings | 1 / 0.667 / 0.5 |
| `random` | a random perfect matching, drawn per step from (seed, step) | 1/2 with the partner | gap of E[W]: n/(2(n-1)) for even n: 0.667 / 0.571 / 0.533 |
| `complete` | everyone | 11ᵀ/n | 1 |

`random` changes every step (every rank draws the same matching from the seed); its `matrix(step)` is that
step's W and its `spectral_gap()` the gap of the expected matrix E[W] (a single matching is disconnected).

Not every gossip algorithm mixes with W. SGP pushes half its mass to one out-peer per step (`out_peer`: the
neighbours in turn), a column-stochastic `push_matrix(step)`; AD-PSGD averages pairwise over `matching(step)`,
`pair_matrix(step)`. Their gaps (`push_gap`, `pairwise_gap`) are those of the matrices they mix with: for a
deterministic schedule of period L, 1 - |λ2(P_{L-1}⋯P_0)|^{1/L}, the contraction per round of the disagreement
that the whole period achieves (`mixing_gap`; λ2 the second-largest eigenvalue modulus, for push-sum that of the
column-stochastic product, Kempe, Dobra, Gehrke 2003 §3); for random matchings the gap of E[W], which bounds
the mean-square contraction E‖x(k) - x̄‖² ≤ λ2(E[W])^k since each W is a symmetric projection (Boyd et al.,
Randomized gossip algorithms, 2006, Theorem 3 with E[WᵀW] = E[W]).

| n = 4 / 8 / 16 | W | SGP push (P) | AD-PSGD pairs |
| --- | --- | --- | --- |
| `ring` | 0.667 / 0.195 / 0.051 | 0.293 / 0.076 / 0.019 | 1 / 0.293 / 0.076 |
| `exponential` | 1 / 0.667 / 0.5 | 1 / 1 / 1.000 | - |
| `random` | 0.667 / 0.571 / 0.533 | same as W (the push goes to the matching partner) | same as W |
"""
from __future__ import annotations

import math
import random

import numpy as np

from ..errors import UserError
from ..net.cost import grid_shape

NAMES = ("ring", "torus", "exponential", "random", "complete")


class Topology:
    """Neighbours and mixing weights of `n` ranks under one named topology."""

    def __init__(self, name: str, n: int, seed: int = 0):
        if name not in NAMES:
            raise UserError(f"unknown topology {name!r}; valid: {', '.join(NAMES)}")
        if n < 1:
            raise UserError(f"a topology needs at least one rank, got {n}")
        if name == "torus":
            x, y = grid_shape(n)
            if n > 1 and (x < 2 or y < 2):
                raise UserError(f"topology 'torus' needs a world size that is a product X·Y with X, Y >= 2 "
                                f"(4, 6, 8, 9, ...), got {n}; valid here: ring, exponential, random, complete")
        self.name, self.n, self.seed = name, n, seed
        self.static = name != "random"
        self._W = self._static_matrix() if self.static else None

    # -- edges ---------------------------------------------------------------------------------------------
    def _edges(self, i: int) -> list[int]:
        n = self.n
        if self.name == "ring":
            peers = [(i + 1) % n, (i - 1) % n]
        elif self.name == "complete":
            peers = [j for j in range(n) if j != i]
        elif self.name == "exponential":    # i ± 2^k for every 2^k < n
            peers = [(i + s * 2 ** k) % n for k in range((n - 1).bit_length()) for s in (1, -1)]
        else:  # torus: rank = row·X + column
            x, y = grid_shape(n)
            r, c = divmod(i, x)
            peers = [r * x + (c + 1) % x, r * x + (c - 1) % x, ((r + 1) % y) * x + c, ((r - 1) % y) * x + c]
        return [p for p in dict.fromkeys(peers) if p != i]  # dedupe, keep order, drop self

    def matching(self, step: int) -> list[int]:
        """The partner of every rank at `step` (-1: idle), for pairwise gossip. `random`: a uniformly random
        perfect matching drawn from (seed, step); `ring`: edges (2k, 2k+1) on even steps, (2k+1, 2k+2) on odd
        ones; others: UserError."""
        n = self.n
        partner = [-1] * n
        if self.name == "random":
            order = list(range(n))
            random.Random(self.seed * 1_000_003 + step).shuffle(order)
            for a, b in zip(order[0::2], order[1::2]):
                partner[a], partner[b] = b, a
        elif self.name == "ring":
            start = step % 2 if n > 2 else 0
            for a in range(start, start + n - 1, 2):     # disjoint pairs (a, a + 1 mod n)
                b = (a + 1) % n
                partner[a], partner[b] = b, a
        else:
            raise UserError(f"pairwise gossip needs topology 'random' or 'ring', got {self.name!r}")
        return partner

    def neighbors(self, i: int, step: int = 0) -> list[int]:
        """The ranks `i` exchanges with at `step` (excluding itself)."""
        if self.static:
            return self._edges(i)
        p = self.matching(step)[i]
        return [] if p < 0 else [p]

    def out_peer(self, i: int, step: int) -> int:
        """Where `i` pushes at `step` (push-sum, SGP): its neighbours in turn, one per step (-1: none)."""
        peers = self.neighbors(i, step)
        return peers[step % len(peers)] if peers else -1

    def in_peers(self, i: int, step: int) -> list[int]:
        """The ranks that push to `i` at `step`."""
        return [j for j in range(self.n) if j != i and self.out_peer(j, step) == i]

    # -- mixing matrix ---------------------------------------------------------------------------------------
    def _static_matrix(self) -> np.ndarray:
        n = self.n
        if self.name == "complete":
            return np.full((n, n), 1.0 / n)
        deg = [len(self._edges(i)) for i in range(n)]
        W = np.zeros((n, n))
        for i in range(n):
            for j in self._edges(i):
                W[i, j] = 1.0 / (1 + max(deg[i], deg[j]))  # Metropolis–Hastings
            W[i, i] = 1.0 - W[i].sum()
        return W

    def matrix(self, step: int = 0) -> np.ndarray:
        """W at `step` (float64, n×n): row i holds the weights rank i gives to every rank."""
        return self._W.copy() if self.static else self.pair_matrix(step)

    def expected_matrix(self) -> np.ndarray:
        """E[W] over steps (W itself for static topologies)."""
        if self.static:
            return self._W.copy()
        n = self.n
        pair = 1.0 / (n - 1) if n % 2 == 0 else 1.0 / n  # probability that a given pair is matched
        W = np.full((n, n), pair / 2)
        np.fill_diagonal(W, 1.0 - pair / 2 * (n - 1))
        return W

    def spectral_gap(self) -> float:
        """1 - max(|λ2|, |λn|) of W (of E[W] for `random`)."""
        if self.n == 1:
            return 1.0
        lam = np.sort(np.linalg.eigvalsh(self.expected_matrix()))
        return float(1.0 - max(abs(lam[-2]), abs(lam[0])))

    def _halves(self, peer: list[int]) -> np.ndarray:
        """m_jj = m_{p j} = 1/2 with p = peer[j] (m_jj = 1 where peer[j] = -1): column j splits j's mass."""
        M = np.eye(self.n)
        for j, p in enumerate(peer):
            if p >= 0:
                M[j, j] = M[p, j] = 0.5
        return M

    def push_matrix(self, step: int) -> np.ndarray:
        """SGP's column-stochastic P at `step`: p_jj = p_{o j} = 1/2 with o = out_peer(j, step) (p_jj = 1 alone)."""
        return self._halves([self.out_peer(j, step) for j in range(self.n)])

    def pair_matrix(self, step: int) -> np.ndarray:
        """The pairwise averages of `matching(step)`: w_ii = w_ij = 1/2 for partners i, j (1 alone)."""
        return self._halves(self.matching(step))

    def push_gap(self) -> float:
        """The gap of the push-sum mixing (see the module docstring), per step."""
        if self.n == 1 or not self.static:
            return self.spectral_gap()      # random: pushes go to the matching partner, P = W of the matching
        period = math.lcm(*(len(self._edges(i)) for i in range(self.n)))
        return mixing_gap([self.push_matrix(s) for s in range(period)])

    def pairwise_gap(self) -> float:
        """The gap of pairwise averaging over the matchings (see the module docstring), per averaging."""
        self.matching(0)                    # (a UserError for topologies without matchings)
        if self.n == 1 or not self.static:
            return self.spectral_gap()
        return mixing_gap([self.pair_matrix(s) for s in range(2 if self.n > 2 else 1)])


def mixing_gap(matrices: list[np.ndarray]) -> float:
    """1 - |λ2(M_{L-1}⋯M_0)|^{1/L}: the per-round gap of a periodic schedule of stochastic mixing matrices."""
    prod = np.eye(matrices[0].shape[0])
    for M in matrices:
        prod = M @ prod
    lam = np.sort(np.abs(np.linalg.eigvals(prod)))[::-1]
    rho = float(lam[1]) if len(lam) > 1 and lam[1] > 1e-9 else 0.0   # (exact consensus: round-off, not a rate)
    return 1.0 - min(rho, 1.0) ** (1.0 / len(matrices))
