"""`cdsgd`: distributed SGD with compression and delay compensation (seed 001, Algorithm 1, eqs. 10–11).

Global weights W are identical on every worker (all-reduce architecture); the model holds each worker's local
weights W^loc, on which the gradients are computed. With η the optimizer's lr and η_loc = `local_lr`:

- warm-up, the first `warmup` iterations: g_i = ∇L_j(W_i), full-precision mean, W_{i+1} = W_i − η·mean_j g_{i,j};
  at the last one also W^loc_{n+1} = W_n − η_loc·g_{n,j} (Algorithm 1 lines 5–6, 11–12);
- formal training, counter c = 0, 1, ... from the first formal iteration:
  W^loc_{i+1,j} = W_i − η_loc·g_{i,j}                    (eq. 11, done at once: the next forward starts)
  W_{i+1} = W_i − η·mean_j Q_j(g_{i,j})                   (eq. 10, in a background thread)
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

`bitsgd`, `odsgd` and `ssgd` (the paper's comparison set, eqs. 5, 4, 1) are this class with the local update,
the compression or the overlap switched off. Each measures the time model's inputs on its own run (τ compute,
φ full-precision exchange, ψ compressed exchange, δ compression) and reports in `metrics()` the iteration time
that seed 001 §3.3 predicts from them (`thinwire.plan.cdsgd`) beside the measured one.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..compress import Compressor, Memory, Payload
from ..errors import UserError
from ..exchange import Exchange
from ..plan import cdsgd as time_model
from . import register
from .base import Algorithm

_now = time.perf_counter
_KEY = "model"


class _TimedCompressor(Compressor):
    """A compressor as it is, with its encode/decode time measured (δ); the Exchange traces the spans."""

    def __init__(self, inner: Compressor):
        self.inner, self.seconds = inner, 0.0
        for attr in ("name", "unbiased", "linear", "randomness", "aggregation", "fixed_size"):
            setattr(self, attr, getattr(inner, attr))

    def __getattr__(self, attr):  # anything else (a custom exchange, parameters) is the inner compressor's
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def _timed(self, fn, *args):
        t0 = _now()
        try:
            return fn(*args)
        finally:
            self.seconds += _now() - t0

    def compress(self, tensor, key=None, step=0, agreed=None):
        return self._timed(self.inner.compress, tensor, key, step, agreed)

    def decompress(self, payload):
        return self._timed(self.inner.decompress, payload)

    def aggregate(self, payloads):
        return self._timed(self.inner.aggregate, payloads)

    def agree(self, tensor, key=None, step=0):
        return self.inner.agree(tensor, key, step)

    def sum_payload(self, payload, world_size):
        return self.inner.sum_payload(payload, world_size)

    def nominal_bits(self, numel):
        return self.inner.nominal_bits(numel)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


class _KStepCompressor(_TimedCompressor):
    """(Parameter server) the compressor of push `step` (= the iteration): the inner one where `compressed(step)`,
    else the identity, so the server decodes every push by the same rule without being told."""

    def __init__(self, inner: Compressor, compressed):
        super().__init__(inner)
        self.compressed = compressed

    def compress(self, tensor, key=None, step=0, agreed=None):
        if not self.compressed(step):
            return Payload([tensor.reshape(-1)], ("identity", tensor.shape))
        p = self._timed(self.inner.compress, tensor, key, step, agreed)
        return Payload(p.tensors, ("inner", p.ctx), p.extra)

    def decompress(self, payload):
        kind, ctx = payload.ctx
        if kind == "identity":
            return payload.tensors[0].view(ctx)
        return self._timed(self.inner.decompress, Payload(payload.tensors, ctx, payload.extra))


class _GatedMemory(Memory):
    """(Parameter server) the memory, bypassed on full-precision iterations: the residual is kept, not flushed."""

    def __init__(self, inner: Memory):
        self.inner, self.active = inner, True

    def setup(self, world_size):
        self.inner.setup(world_size)

    def compensate(self, tensor, key):
        return self.inner.compensate(tensor, key) if self.active else tensor

    def update(self, tensor, key, sent):
        if self.active:
            self.inner.update(tensor, key, sent)


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
class CDSGD(Algorithm):
    """CD-SGD (seed 001): 2-bit exchange hidden behind the next iteration by a local update, k-step correction.

    The local update is eq. 11; every k-th formal iteration is a full-precision correction; the first `warmup`
    iterations are synchronous and full precision."""

    architectures = ("allreduce", "ps")
    compression = True
    default_compressor = "threshold2bit"
    default_memory = "residual"
    local_update = True     # eq. 11: the next iteration computes on W^loc
    overlapped = True       # the exchange and the global update run in the background

    def __init__(self, architecture: str | None = None, k: int = 5, warmup: int = 10,
                 local_lr: float | None = None, servers: int = 0, local_momentum: bool = True):
        super().__init__(architecture)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise UserError(f"cdsgd: k must be an integer >= 1 (1: every iteration full precision), got {k!r}")
        self._configure(k, warmup, local_lr, servers, local_momentum)

    def _configure(self, k: int, warmup: int, local_lr: float | None, servers: int = 0,
                   local_momentum: bool = True) -> None:
        if servers and self.architecture != "ps":
            raise UserError(f"{self.name} with servers={servers} needs architecture=ps (--architecture ps)")
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 0:
            raise UserError(f"{self.name}: servers must be an integer >= 0, got {servers!r}")
        self.servers = servers or 1
        self.role = "worker"
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise UserError(f"{self.name}: warmup must be an integer >= 0, got {warmup!r}")
        if local_lr is not None and not (isinstance(local_lr, (int, float)) and local_lr > 0):
            raise UserError(f"{self.name}: local_lr must be a number > 0 (default: the optimizer's lr), "
                            f"got {local_lr!r}")
        if not isinstance(local_momentum, bool):
            raise UserError(f"{self.name}: local_momentum must be true or false, got {local_momentum!r}")
        self.local_momentum = local_momentum
        self.k = k                      # 0: never corrected (every formal iteration compressed)
        self.warmup = warmup
        self.local_lr = None if local_lr is None else float(local_lr)

    # -- wiring ----------------------------------------------------------------------------------------
    def setup(self):
        _sgd_hyper(self.optimizer)
        self.plain = self.quant = self.ps = None
        if self.architecture == "ps":
            self._setup_ps()
        else:
            self.plain = Exchange(self.transport, "none", "none")
        if self.compression and self.architecture != "ps":
            self.timed = _TimedCompressor(self.trainer.compressor)
            self.quant = Exchange(self.transport, self.timed, self.trainer.memory)
        self.W = self.flat_params().clone()     # global weights (rank 0's, broadcast by the Trainer)
        self.W_prev = self.W.clone()            # the global weights before the last global update
        self.buf: torch.Tensor | None = None    # momentum buffer of the global update
        self.iteration = 0                      # steps taken
        self.counter = 0                        # formal iterations taken (c of Algorithm 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pending = None
        self._samples: dict[str, list[float]] = {k: [] for k in ("tau", "phi", "psi", "delta", "iteration")}
        self._last_start = self._last_end = None

    def _setup_ps(self) -> None:
        """Parameter server (seed 001 §3.2): the server applies the optimizer to mean_j Q_j(g_{i,j}) (eq. 10)
        and answers with W_{i+1}; workers keep W^loc. Push i is compressed by the same rule as `_compressed`."""
        from ..comm.ps import PSLayout, PSServer, PSWorker
        flat = self.flat_params()
        self.layout = PSLayout(flat.numel(), self.world_size, self.servers)

        def compressed(step: int) -> bool:
            return self.compression and step >= self.warmup and (self.k == 0 or (step - self.warmup) % self.k != 0)
        self.timed = _KStepCompressor(self.trainer.compressor, compressed)
        if self.layout.is_server(self.rank):
            self.role = "server"
            self.server = PSServer(self.transport, self.layout, flat, self.optimizer, compressor=self.timed)
        else:
            self.worker_rank = self.rank
            self.gate = _GatedMemory(self.trainer.memory)
            self.ps = PSWorker(self.transport, self.layout, flat, compressor=self.timed, memory=self.gate)

    def serve(self) -> None:
        if self.role != "server":
            raise RuntimeError(f"rank {self.rank} is a worker, not a server")
        self.server.serve()

    # -- the step --------------------------------------------------------------------------------------
    def _compressed(self, formal: bool) -> bool:
        return self.compression and formal and (self.k == 0 or self.counter % self.k != 0)

    def step(self):
        if self.role == "server":
            raise RuntimeError(f"rank {self.rank} is a parameter server: call serve(), not step()")
        t_start = _now()
        formal = self.iteration >= self.warmup
        if self._last_end is not None and self.iteration > self.warmup:
            self._samples["tau"].append(t_start - self._last_end)
            self._samples["iteration"].append(t_start - self._last_start)
        self._last_start = t_start
        hyper = _sgd_hyper(self.optimizer)
        eta_loc = hyper["lr"] if self.local_lr is None else self.local_lr
        g = self.flat_grad().detach().clone()
        compressed = self._compressed(formal)
        if formal and self.overlapped:
            self._drain()                                       # W_i: the previous exchange only
            self.set_flat_params(self._local(g, eta_loc, hyper))    # eq. 11: W^loc_{i+1} from W_i and g_i
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="cdsgd")
            self._pending = self._pool.submit(self._global, g, compressed, hyper)
        else:
            # Algorithm 1 lines 5–6, 11–12: the last warm-up iteration also prepares W^loc_{n+1} = W_n − η_loc·g_n
            last_warmup = self.local_update and self.iteration == self.warmup - 1
            w_loc = self._local(g, eta_loc, hyper) if last_warmup else None
            self._global(g, compressed, hyper)
            self.set_flat_params(w_loc if last_warmup else self.W)
        self.iteration += 1
        if formal:
            self.counter += 1
        self._last_end = _now()

    def _local(self, g: torch.Tensor, eta_loc: float, hyper: dict) -> torch.Tensor:
        """W^loc_{i+1} = W_i − η_loc·g_i (seed 001 eq. 11), plus the known momentum step μ·(W_i − W_{i−1})."""
        w = self.W - eta_loc * g
        if self.local_momentum and hyper["momentum"]:
            w.add_(self.W - self.W_prev, alpha=hyper["momentum"])
        return w

    def _global(self, g: torch.Tensor, compressed: bool, hyper: dict) -> None:
        """W_{i+1} = W_i − η·mean_j Q_j(g_{i,j}) (seed 001 eq. 10; eq. 1 when Q is the identity)."""
        t0 = _now()
        if self.local_update:
            self.W_prev = self.W.clone()
        if self.ps is not None:  # the server applies the update; its answer is W_{i+1}
            self.gate.active = compressed
            d0 = self.timed.seconds
            self.W = self.ps.push_pull(g)
            delta = self.timed.seconds - d0
            if compressed:
                self._samples["delta"].append(delta)
                self._samples["psi"].append(_now() - t0 - delta)
            else:
                self._samples["phi"].append(_now() - t0)
            return
        if compressed:
            d0 = self.timed.seconds
            mean = self.quant.start(g, _KEY).wait()
            delta = self.timed.seconds - d0
            self._samples["delta"].append(delta)
            self._samples["psi"].append(_now() - t0 - delta)
        else:
            mean = self.plain.start(g, _KEY).wait()
            self._samples["phi"].append(_now() - t0)
        with self.tracer.span("global update", "optimizer"):
            self._apply_sgd(mean, hyper)

    def _apply_sgd(self, d: torch.Tensor, h: dict) -> None:
        """torch.optim.SGD's update on the flat global weights (see the module docstring)."""
        W = self.W
        if h["weight_decay"]:
            d = d.add(W, alpha=h["weight_decay"])
        mu = h["momentum"]
        if mu:
            if self.buf is None:
                self.buf = d.clone()
            else:
                self.buf.mul_(mu).add_(d, alpha=1 - h["dampening"])
            d = d.add(self.buf, alpha=mu) if h["nesterov"] else self.buf
        W.add_(d, alpha=-h["lr"])

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self):
        if self.role == "server":
            return
        self._drain()
        self.set_flat_params(self.W)
        if self.ps is not None:
            self.ps.done()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- reporting and state ---------------------------------------------------------------------------
    def metrics(self) -> dict:
        med = {k: (statistics.median(v) if v else None) for k, v in self._samples.items()}
        k = self.k if self.compression else 1
        out = {"warmup": self.warmup, "k": self.k, "tau_s": med["tau"], "phi_s": med["phi"],
               "psi_s": med["psi"], "delta_s": med["delta"], "measured_step_s": med["iteration"],
               "predicted_step_s": time_model.predict(self.name, med["tau"], med["phi"], med["psi"],
                                                      med["delta"], k)}
        out["predicted"] = time_model.predict_all(med["tau"], med["phi"], med["psi"], med["delta"], self.k)
        return out

    def state_dict(self) -> dict:
        if self.architecture == "ps":
            raise UserError(f"{self.name} on the parameter server cannot checkpoint yet (the server's shard and "
                            f"momentum are not saved); checkpoint it on architecture allreduce")
        self._drain()
        return {"iteration": self.iteration, "counter": self.counter, "W": self.W.clone(),
                "W_prev": self.W_prev.clone(),
                "buf": None if self.buf is None else self.buf.clone(), "plain": self.plain.state_dict(),
                "quant": None if self.quant is None else self.quant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.architecture == "ps":
            raise UserError(f"{self.name} on the parameter server cannot resume from a checkpoint yet")
        self._drain()
        self.iteration, self.counter = state["iteration"], state["counter"]
        self.W = state["W"].clone()
        self.W_prev = state.get("W_prev", state["W"]).clone()
        self.buf = None if state["buf"] is None else state["buf"].clone()
        self.plain.load_state_dict(state["plain"])
        if self.quant is not None and state["quant"] is not None:
            self.quant.load_state_dict(state["quant"])
