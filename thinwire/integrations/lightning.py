"""PyTorch Lightning: any thinwire algorithm as a Lightning strategy (public name: `thinwire.lightning`).

    import lightning as L
    from thinwire.lightning import ThinwireStrategy

    strategy = ThinwireStrategy(algorithm="diloco", period=50, compressor="fp4", network="world")
    L.Trainer(strategy=strategy, devices=4, accelerator="cpu").fit(module)

`ThinwireStrategy` is Lightning's DDP strategy (its launcher, process group, samplers, barriers and reductions)
without the `DistributedDataParallel` wrapper: the module stays bare and `tw.attach` drives the algorithm from the
optimizer's step hooks and the parameters' backward hooks, so Lightning's own `optimizer.step(closure)` runs the
algorithm's step. Parameters are `tw.Trainer`'s (compressor, memory, schedule, network, nonfinite, the algorithm's
own); they are checked when the strategy is built. Bytes and emulated time are metered at thinwire's transport as
in `thinwire train`: `strategy.metrics()` and, each step, the logged `thinwire/bytes_sent` and
`thinwire/emulated_s`. Checkpoints: Lightning's file holds rank 0's module and optimizer as usual; each rank also
writes its own thinwire state (`Trainer.state_dict`: model, optimizer, algorithm, compressor, memory, step) to
`<checkpoint>.thinwire-rank<R>`, which `fit(ckpt_path=...)` loads back on that rank after Lightning's restore, so a
resumed run goes on as if never stopped (local models, residuals and outer-optimizer state included).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import UserError, require_extra
from ..net import parse_network
from ..trainer import Attachment, attach, build_components

L = require_extra("lightning", "lightning", "thinwire.lightning (PyTorch Lightning)")
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

_TRAINER_ONLY = ("transport", "tracer", "sync_initial_model", "nonfinite", "on_failure")


def sidecar(filepath, rank: int) -> str:
    """Where rank `rank` keeps its thinwire state beside Lightning's checkpoint file.

    Args:
        filepath: Lightning's checkpoint file.
        rank: the process's global rank.
    """
    return f"{os.fspath(filepath)}.thinwire-rank{rank}"


class ThinwireStrategy(DDPStrategy):
    """Lightning's multi-process strategy with a thinwire algorithm in place of DDP's all-reduce.

    Args:
        algorithm: a registered algorithm's name, as for `tw.Trainer` (the parameter server is refused).
        accelerator: Lightning's (DDPStrategy's parameter).
        parallel_devices: Lightning's (DDPStrategy's parameter).
        cluster_environment: Lightning's (DDPStrategy's parameter).
        checkpoint_io: Lightning's (DDPStrategy's parameter).
        precision_plugin: Lightning's (DDPStrategy's parameter).
        process_group_backend: "gloo" or "nccl" (default: Lightning's choice for the accelerator).
        start_method: how Lightning starts the processes ("popen": a fresh interpreter runs the script).
        log_every_step: log `thinwire/bytes_sent` and `thinwire/emulated_s` to Lightning's loggers each step.
        **params: `tw.Trainer`'s (`compressor`, `memory`, `schedule`, `network`, `nonfinite`, ...) and the
            algorithm's, compressor's and memory's own, checked here, before any process starts.
    """

    strategy_name = "thinwire"

    def __init__(self, algorithm: str = "bsp", *, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend: str | None = None,
                 start_method: str = "popen", log_every_step: bool = True, **params):
        self.algorithm, self.params, self.log_every_step = algorithm, dict(params), log_every_step
        network = params.get("network")
        if network is not None:
            parse_network(network)
        built = {k: v for k, v in params.items() if k not in _TRAINER_ONLY + ("network",)}
        alg = build_components(algorithm, **built)[0]        # every name and value checked here, before launch
        if alg.architecture == "ps":
            raise UserError("ThinwireStrategy trains on every Lightning process; the parameter-server "
                            "architecture needs server ranks that do not (use tw.attach in your own loop)")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method)
        self.attachment: Attachment | None = None
        self._metrics: dict = {}
        self._resume: dict | None = None

    # -- no DDP wrapper: the algorithm communicates -------------------------------------------------------
    def configure_ddp(self) -> None:
        """Keep the LightningModule bare (DDP's all-reduce would run beside the algorithm's)."""

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise UserError(f"ThinwireStrategy drives one optimizer; configure_optimizers returned "
                            f"{len(self.optimizers)}")
        self.attachment = attach(self.lightning_module, self.optimizers[0], algorithm=self.algorithm,
                                 **self.params)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_every_step and self.attachment is not None and self.lightning_module is not None:
            m = self.attachment.metrics()
            self.lightning_module.log_dict({"thinwire/bytes_sent": float(m["bytes_sent"]),
                                            "thinwire/emulated_s": float(m.get("emulated_s", 0.0))},
                                           on_step=True, on_epoch=False, rank_zero_only=True)
        return out

    def on_train_end(self) -> None:
        """Drain what is in flight and leave every rank with the model the algorithm defines."""
        if self.attachment is not None:
            self.attachment.close()
            self._metrics = self.attachment.metrics()
            self.attachment = None
        super().on_train_end()

    def teardown(self) -> None:
        if self.attachment is not None:       # a fit that raised: remove the hooks, send nothing more
            self._metrics = self.attachment.metrics()
            self.attachment.detach()
            self.attachment = None
        super().teardown()

    def metrics(self) -> dict:
        """thinwire's counters for this process (steps, bytes_sent, bytes_recv, emulated_s, wait_s, ...): live
        during `fit`, the final ones after it."""
        return self.attachment.metrics() if self.attachment is not None else dict(self._metrics)

    # -- checkpoints: rank 0's file as usual, and every rank's thinwire state beside it ----------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.attachment is not None:
            path = sidecar(filepath, self.global_rank)
            tmp = path + ".tmp"
            torch.save(self.attachment.state_dict(), tmp)
            os.replace(tmp, path)

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        path = sidecar(filepath, self.global_rank)
        if os.path.exists(path):
            os.remove(path)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = sidecar(checkpoint_path, self.global_rank)
        if not os.path.exists(path):
            raise UserError(f"{checkpoint_path} has no thinwire state for rank {self.global_rank} ({path}): it was "
                            f"not saved by ThinwireStrategy, or with another number of processes")
        self._resume = torch.load(path, map_location="cpu", weights_only=True)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._resume is not None and self.attachment is not None:    # this rank's own state, last
            self.attachment.load_state_dict(self._resume)
            self._resume = None
