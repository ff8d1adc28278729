"""`cdsgd`: distributed SGD with compression and delay compensation (Yu, Dong, Xu, Ouyang, Liao 2021, "CD-SGD:
Distributed Stochastic Gradient Descent with Compression and Delay Compensation", arXiv 2106.10796,
Algorithm 1, eqs. 10–11).

Global weights W are identical on every worker (all-reduce architecture); the model holds each worker's local
weights W^loc, on which the gradients are computed. With η the optimizer's lr and η_loc = `local_lr`:

- warm-up, the first `warmup` iterations: g_i = ∇L_j(W_i), full-precision mean, W_{i+1} = W_i − η·mean_j g_{i,j};
  at the last one also W^loc_{n+1} = W_n − η_loc·g_{n,j} (Algorithm 1 lines 5–6, 11–12);
- formal training, counter c = 0, 1, ... from the first formal iteration:
  W^loc_{i+1,j} = W_i − η_loc·g_{i,j}                    (eq. 11, done at once: the next forward starts)
  W_{i+1} = W_i − η·mean_j Q_j(g_{i,j})                   (eq. 10: each bucket's exchange starts during
                                                          backward and is applied at the next step)
  Q_j = the compressor with its memory (2-bit threshold quantizer + residual by default) when c mod k ≠ 0,
  the identity (a full-precision correction step) when c mod k = 0; the residual is kept across correction
  steps. Iteration i+1 only waits for iteration i's exchange before its own local update.
- `close()` drains the exchange in flight and loads W into the model: every worker holds the global weights.

Momentum: the paper uses plain SGD for both updates. The global update applies the optimizer's SGD
hyper-parameters to the aggregated gradient d = mean_j Q_j(g_{i,j}) exactly as torch.optim.SGD does
(d += wd·W_i; b = μ·b + (1 − dampening)·d, b = d the first time; d = d + μ·b with nesterov, else d = b;
W_{i+1} = W_i − η·d), with one momentum buffer on W, kept in this algorithm's state. With momentum μ the global
step W_{i+1} − W_i = −η·μ·b_i − η·d_i holds a part, −η·μ·b_i = μ·(W_i − W_{i−1}), that every worker knows
before the exchange. `local_momentum` (default on) adds it to the local update, so that W^loc stays the
worker's estimate of W_{i+1}:
  W^loc_{i+1,j} = W_i + μ·(W_i − W_{i−1}) − η_loc·g_{i,j}
This is exact for heavy-ball momentum at a constant lr, and an estimate with Nesterov or a changing lr. With
μ = 0 (the paper's setting) it is eq. 11 as printed. `local_momentum=False` gives eq. 11 as printed for every μ;
its W^loc then trails W_{i+1} by the momentum step η·μ·b, which is ≈ 9 gradient steps at μ = 0.9 (see
docs/benchmarks/cdsgd-accuracy.md).

`bitsgd`, `odsgd` and `ssgd` (the paper's comparison set, eqs. 5, 4, 1) are this class with explicit options
(bitsgd, like bsp, takes the momentum before its quantizer: `BitSGD`):
without the local update (`local_update=False`) the global weights are the model and the step is bsp's (wait for
the averaged gradient, apply the optimizer), compressed (BIT-SGD) or not (S-SGD). Each measures the time model's
inputs on its own run (τ compute, φ full-precision exchange, ψ compressed exchange, δ compression) and reports in
`metrics()` the iteration time that the paper's §3.3 predicts from them (`thinwire.net.cdsgd`) beside the measured
one.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..compress import Compressor
from ..errors import UserError
from ..net import cdsgd as time_model
from ..tensors import copy_each, copy_flat, views
from ._registry import register
from .base import int_at_least
from .bsp import BSP
from .cost import CostFamily
from .ps_sync import PSMixin

_now = time.perf_counter


class _TimedCompressor:
    """A compressor as it is (every attribute is the inner compressor's), with its encode/decode time measured
    (δ); the Exchange traces the spans. Not a `Compressor` subclass: the base class's defaults would shadow the
    inner compressor's (its `vote` drops signsgd's scale: BIT-SGD + signsgd ran to chance)."""

    def __init__(self, inner: Compressor):
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, attr):  # anything not timed (a custom exchange, parameters, state) is the inner one's
        if attr == "inner":
            raise AttributeError(attr)
        value = getattr(self.inner, attr)
        if attr not in ("compress", "decompress", "aggregate", "vote"):
            return value

        def timed(*args, **kwargs):
            t0 = _now()
            try:
                return value(*args, **kwargs)
            finally:
                self.seconds += _now() - t0
        return timed


def _sgd_hyper(optimizer) -> dict:
    """The SGD hyper-parameters the global update applies (one value for all parameter groups)."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise UserError(f"this algorithm applies SGD updates to the global weights itself; use torch.optim.SGD "
                        f"(got {type(optimizer).__name__})")
    keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    first = {k: optimizer.param_groups[0].get(k) for k in keys}
    for g in optimizer.param_groups[1:]:
        if any(g.get(k) != first[k] for k in keys):
            raise UserError("this algorithm needs one lr/momentum/dampening/weight_decay/nesterov for all "
                            "parameter groups")
    return first


@register("cdsgd")
class CDSGD(BSP):
    """CD-SGD (Yu et al. 2021): 2-bit exchange hidden behind the next iteration by a local update, k-step correction
    (see the module's doc)."""

    schedules = ("none", "wfbp", "fusion", "mgwfbp")
    exchanges_gradients = False   # its own momentum update (eqs. 8-11) on the exchanged gradients (see __init__)
    lands_in_backward = False     # the exchange of step n is applied at step n + 1 (eq. 10)
    default_compressor = "threshold2bit"
    default_memory = "residual"
    survives_failures = False
    sgd_only = True
    # The planner's staleness bound: k, the steps between full-precision corrections. Under momentum 0.9 the 2-bit
    # quantizer winds up (docs/cdsgd.md, Limitations: digits-cnn k = 5 3–9 pp below ssgd, k = 2 within noise); on
    # stdlib-lm (SGD lr 0.1, 4 workers, 50 steps on `lan`) k = 2 reached loss 3.09 against ssgd's 2.97, k = 3 4.23,
    # and k = 5 diverged (6.05). With plain SGD, the paper's setting, k up to 20 (Yu et al. 2021, §4).
    cost = CostFamily("delay_compensated", tunable={"k": (1, 2, 5, 10, 20)}, max_staleness=(2, 20))

    def __init__(self, architecture: str | None = None, k: int = 5, warmup: int = 10,
                 local_lr: float | None = None, local_momentum: bool = True, *, local_update: bool = True,
                 compress: bool = True):
        super().__init__(architecture)
        self.k = int_at_least(f"{self.name}: k", k, 0 if not local_update or not compress else 1)  # 0: never corrected
        self.warmup = int_at_least(f"{self.name}: warmup", warmup, 0)
        if local_lr is not None and not (isinstance(local_lr, (int, float)) and local_lr > 0):
            raise UserError(f"{self.name}: local_lr must be a number > 0 (default: the optimizer's lr), "
                            f"got {local_lr!r}")
        if not isinstance(local_momentum, bool):
            raise UserError(f"{self.name}: local_momentum must be true or false, got {local_momentum!r}")
        self.local_lr = None if local_lr is None else float(local_lr)
        self.local_momentum = local_momentum
        self.local_update = local_update     # eq. 11: the next iteration computes on W^loc
        # without the local update the step is bsp's: the optimizer applies the exchanged gradients, so (as for
        # bsp) a memory takes the momentum before Q (bitsgd: `BitSGD`)
        self.exchanges_gradients = not local_update
        self.overlaps_steps = local_update   # eq. 10's exchange is applied at the next iteration
        self.compress = compress             # Q is the compressor (with its memory) on non-correction iterations

    # -- wiring ----------------------------------------------------------------------------------------
    def check_components(self, compressor, memory):
        super().check_components(compressor, memory)
        if not self.compress and compressor.name != "none":
            raise UserError(f"{self.name} exchanges full-precision gradients; drop --compressor "
                            f"(compressed: cdsgd, bitsgd)")

    def check_run(self, world_size, optimizer=None):
        super().check_run(world_size, optimizer)
        if optimizer is not None:
            _sgd_hyper(optimizer)

    def setup(self):
        _sgd_hyper(self.optimizer)
        self.plain = self.make_exchange("none", "none")
        self.timed = _TimedCompressor(self.compressor) if self.compress else None
        self.quant = self.make_exchange(self.timed, self.memory, **self.ctx.collectives) if self.compress else None
        self.pending: dict[int, object] = {}
        # global weights (rank 0's, broadcast); without the local update, the model itself
        self.W = [p.detach().clone() if self.local_update else p.detach() for p in self.params]
        self.W_prev = [w.clone() for w in self.W]                # before the last global update
        self.buf: list[torch.Tensor] | None = None               # momentum buffer of the global update
        self.prev: dict[int, tuple] = {}       # formal iterations: last step's exchanges, applied this step
        self.iteration = 0                     # steps taken
        self.counter = 0                       # formal iterations taken (c of Algorithm 1)
        self._samples: dict[str, list[float]] = {k: [] for k in ("tau", "phi", "psi", "iteration")}
        self._compressed_steps = 0
        self._comm_start: float | None = None
        self._last_start = self._last_end = None

    # -- the step --------------------------------------------------------------------------------------
    def _formal(self) -> bool:
        return self.iteration >= self.warmup

    def _compressed(self) -> bool:
        """Q is the compressor (k-step rule, eq. 6 / Algorithm 1 line 23), else the identity."""
        return self.compress and self._formal() and time_model.compressed(self.counter, self.k)

    def on_bucket(self, bucket):
        if self._comm_start is None:
            self._comm_start = _now()
        ex = self.quant if self._compressed() else self.plain
        # the bucket keeps this worker's own g for the local update; the exchange gets a copy
        g = bucket.buffer.clone() if self.local_update else bucket.buffer
        self.pending[bucket.index] = ex.start(g, bucket.key, shapes=bucket.shapes, inplace=True)

    def _stamp(self, compressed: bool) -> None:
        """When the last bucket's exchange of this step completes: φ or ψ (Table 1)."""
        if not self.pending or self._comm_start is None:
            return
        start, kind = self._comm_start, ("psi" if compressed else "phi")
        last = self.pending[max(self.pending)]
        last.add_done_callback(lambda _f: self._samples[kind].append(_now() - start))
        self._comm_start = None

    def step(self):
        t_start = _now()
        if self._last_end is not None and self.iteration > self.warmup:
            self._samples["tau"].append(t_start - self._last_end)
            self._samples["iteration"].append(t_start - self._last_start)
        self._last_start = t_start
        hyper = _sgd_hyper(self.optimizer)
        formal, compressed = self._formal(), self._compressed()
        self.scheduler.flush()
        self._stamp(compressed)
        self._compressed_steps += compressed
        if not self.local_update:          # S-SGD / BIT-SGD: the model is W, bsp's step (eqs. 1, 5)
            self._synchronous_update(hyper)
        elif formal:                       # eq. 11 now; eq. 10 of this step is applied at the next one
            self._apply_global(self.prev, hyper)                   # W_i: the previous exchange only
            copy_each(self.params, self._local(hyper))
            self.prev = self._take_pending()
        else:
            # Algorithm 1 lines 5–6, 11–12: the last warm-up iteration also prepares W^loc_{n+1} = W_n − η_loc·g_n
            w_loc = self._local(hyper) if self.iteration == self.warmup - 1 else None
            self._apply_global(self._take_pending(), hyper)
            copy_each(self.params, w_loc if w_loc is not None else self.W)
        self.iteration += 1
        self.counter += formal
        self._last_end = _now()
        self.scheduler.end_step()

    def _synchronous_update(self, hyper: dict) -> None:
        """W_{i+1} = W_i − η·mean_j Q_j(g_{i,j}), waited for in this step (eqs. 1, 5)."""
        self.average_gradients()
        self.optimizer_step()

    def _take_pending(self) -> dict:
        return {b.index: (b.members, self.pending.pop(b.index)) for b in self.scheduler.buckets}

    def _local(self, hyper: dict) -> list[torch.Tensor]:
        """W^loc_{i+1} = W_i − η_loc·g_i (eq. 11), plus the known momentum step μ·(W_i − W_{i−1})."""
        eta = hyper["lr"] if self.local_lr is None else self.local_lr
        mu = hyper["momentum"] if self.local_momentum else 0.0
        out = []
        for w, w_prev, p in zip(self.W, self.W_prev, self.params):
            x = w - eta * p.grad
            if mu:
                x.add_(w - w_prev, alpha=mu)
            out.append(x)
        return out

    def _apply_global(self, exchanges: dict, h: dict) -> None:
        """W_{i+1} = W_i − η·mean_j Q_j(g_{i,j}) (eq. 10; eq. 1 when Q is the identity), with
        torch.optim.SGD's update of the averaged gradient d (see the module docstring)."""
        if not exchanges:
            return
        self.W_prev = [w.clone() for w in self.W]
        if self.buf is None:
            self.buf = [None] * len(self.W)
        mu = h["momentum"]
        with self.tracer.span("global update", "optimizer"):
            for members, fut in exchanges.values():
                for i, d in zip(members, views(fut.wait(), [self.W[i] for i in members])):
                    W = self.W[i]
                    if h["weight_decay"]:
                        d = d.add(W, alpha=h["weight_decay"])
                    if mu:
                        if self.buf[i] is None:
                            self.buf[i] = d.clone()
                        else:
                            self.buf[i].mul_(mu).add_(d, alpha=1 - h["dampening"])
                        d = d.add(self.buf[i], alpha=mu) if h["nesterov"] else self.buf[i]
                    W.add_(d, alpha=-h["lr"])

    def close(self):
        if self.local_update:
            self._apply_global(self.prev, _sgd_hyper(self.optimizer))
            self.prev = {}
            copy_each(self.params, self.W)
        self.scheduler.close()

    # -- reporting and state ---------------------------------------------------------------------------
    def metrics(self) -> dict:
        med = {k: (statistics.median(v) if v else None) for k, v in self._samples.items()}
        delta = (self.timed.seconds / self._compressed_steps) if self.timed and self._compressed_steps else None
        k = self.k if self.compress else 1
        return {**super().metrics(), "warmup": self.warmup, "k": self.k, "tau_s": med["tau"], "phi_s": med["phi"],
                "psi_s": med["psi"], "delta_s": delta, "measured_step_s": med["iteration"],
                "predicted_step_s": time_model.predict(self.name, med["tau"], med["phi"], med["psi"], delta, k),
                "predicted": time_model.predict_all(med["tau"], med["phi"], med["psi"], delta, self.k)}

    def state_dict(self) -> dict:
        """The global weights after the exchange in flight (applied now, as the next step would)."""
        self._apply_global(self.prev, _sgd_hyper(self.optimizer))
        self.prev = {}
        flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])
        return {"iteration": self.iteration, "counter": self.counter, "W": flat(self.W), "W_prev": flat(self.W_prev),
                "buf": None if self.buf is None else [None if b is None else b.clone() for b in self.buf],
                "plain": self.plain.state_dict(), "quant": None if self.quant is None else self.quant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.iteration, self.counter = state["iteration"], state["counter"]
        copy_flat(self.W, state["W"])
        copy_flat(self.W_prev, state["W_prev"])
        self.buf = None if state["buf"] is None else [None if b is None else b.clone() for b in state["buf"]]
        self.prev = {}
        self.plain.load_state_dict(state["plain"])
        if self.quant is not None and state["quant"] is not None:
            self.quant.load_state_dict(state["quant"])


class _FullPrecision:
    """(mixed in first) A variant that exchanges full-precision gradients: no compressor, no memory."""

    compression = False
    default_compressor = "none"
    default_memory = "none"


@register("bitsgd")
class BitSGD(CDSGD):
    """BIT-SGD (eq. 5): synchronous SGD on 2-bit threshold-quantized gradients with residual:
    W_{i+1} = W_i − η·mean_j Q_j(g_{i,j}) with g_{i,j} = ∇L_j(W_i), every iteration waiting for its own
    compressed exchange (T^bit = τ + δ + ψ).

    The paper runs plain SGD. With heavy-ball momentum, as for bsp, the Trainer hands it to the memory, which
    applies it before the quantizer (EF-SGDM, `hand_over_momentum`): Q_j quantizes u_j ← μ u_j + g_{i,j} plus
    the residual and the global step is W_{i+1} = W_i − η·mean_j Q_j(·). Momentum after the quantizer left
    bitsgd at 0.09–0.29 with the sign and 2-bit compressors on digits-mlp (docs/matrix.md)."""

    cost = CostFamily("quantized")

    def __init__(self, architecture: str | None = None):
        super().__init__(architecture, k=0, warmup=0, local_update=False)


@register("odsgd")
class ODSGD(_FullPrecision, CDSGD):
    """OD-SGD (eqs. 3–4; Yu et al.'s ref. [38]): W^loc_{i+1,j} = W_i − η_loc·g_{i,j} lets iteration i+1 start
    at once while the full-precision exchange and W_{i+1} = W_i − η·mean_j g_{i,j} complete (T^loc = max(τ, φ));
    CD-SGD with every iteration a correction step, the same warm-up."""

    cost = CostFamily("local_update")

    def __init__(self, architecture: str | None = None, warmup: int = 10, local_lr: float | None = None,
                 local_momentum: bool = True):
        super().__init__(architecture, k=1, warmup=warmup, local_lr=local_lr, local_momentum=local_momentum,
                         compress=False)


@register("ssgd")
class SSGD(_FullPrecision, CDSGD):
    """S-SGD (eq. 1): bsp, with the paper's time model measured (τ, φ) and predicted
    (T^ssgd = τ + φ, eq. 2; and OD-SGD's max(τ, φ)) in its metrics."""

    cost = CostFamily("every_step")

    def __init__(self, architecture: str | None = None):
        super().__init__(architecture, k=1, warmup=0, local_update=False, compress=False)


# -- the parameter server (Yu et al. §3.2) ----------------------------------------------------------------
@register("cdsgd", variant="ps")
class PSCDSGD(PSMixin, CDSGD):
    """CD-SGD on the parameter server (§3.2): each bucket is pushed as backward hands it over, compressed
    (Q_j, with the worker's memory) or not by the k-step rule, the header naming the codec; the server applies the
    worker's optimizer to mean_j Q_j(g_{i,j}) (eq. 10) and answers W_{i+1}; the workers keep W^loc (eq. 11) and
    take the answer at the next iteration, as on all-reduce. `bitsgd`, `odsgd` and `ssgd` on the PS are this class
    with their options."""

    def __init__(self, architecture: str | None = None, k: int = 5, warmup: int = 10,
                 local_lr: float | None = None, local_momentum: bool = True, servers: int = 1,
                 downlink_compressor: str = "none", downlink_params: dict | None = None, *,
                 local_update: bool = True, compress: bool = True):
        CDSGD.__init__(self, architecture, k, warmup, local_lr, local_momentum, local_update=local_update,
                       compress=compress)
        self._ps_init(servers, downlink_compressor, downlink_params)

    def _apply_global(self, exchanges: dict, h: dict) -> None:
        """W_{i+1}: the server's answer (it applied eq. 10 with the optimizer)."""
        if not exchanges:
            return
        self.W_prev = [w.clone() for w in self.W]
        with self.tracer.span("global update", "optimizer"):
            for members, fut in exchanges.values():
                copy_flat([self.W[i] for i in members], fut.wait())
        self.worker.commit()

    def _synchronous_update(self, hyper: dict) -> None:
        self._apply_global(self._take_pending(), hyper)


@register("bitsgd", variant="ps")
class PSBitSGD(PSCDSGD):
    """BIT-SGD on the parameter server (eq. 5): every push compressed, every step waits for its answer."""

    def __init__(self, architecture: str | None = None, servers: int = 1, downlink_compressor: str = "none",
                 downlink_params: dict | None = None):
        super().__init__(architecture, k=0, warmup=0, servers=servers, downlink_compressor=downlink_compressor,
                         downlink_params=downlink_params, local_update=False)


@register("odsgd", variant="ps")
class PSODSGD(_FullPrecision, PSCDSGD):
    """OD-SGD on the parameter server (eqs. 3–4): full-precision pushes, W^loc while the answer travels."""

    def __init__(self, architecture: str | None = None, warmup: int = 10, local_lr: float | None = None,
                 local_momentum: bool = True, servers: int = 1, downlink_compressor: str = "none",
                 downlink_params: dict | None = None):
        super().__init__(architecture, k=1, warmup=warmup, local_lr=local_lr, local_momentum=local_momentum,
                         servers=servers, downlink_compressor=downlink_compressor, downlink_params=downlink_params,
                         compress=False)


@register("ssgd", variant="ps")
class PSSSGD(_FullPrecision, PSCDSGD):
    """S-SGD on the parameter server (eq. 1): bsp on the PS, with the paper's time model measured."""

    def __init__(self, architecture: str | None = None, servers: int = 1, downlink_compressor: str = "none",
                 downlink_params: dict | None = None):
        super().__init__(architecture, k=1, warmup=0, servers=servers, downlink_compressor=downlink_compressor,
                         downlink_params=downlink_params, local_update=False, compress=False)
