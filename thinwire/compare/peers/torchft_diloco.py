"""torchft's DiLoCo as a peer of `thinwire compare` (`torchft-diloco`; optional extra `thinwire[peers]`:
`pip install torch==2.13.0 torchft==0.2.0`).

How it runs here, on CPU and gloo, one replica group per thinwire worker rank:
- worker rank 0 starts torchft's Lighthouse in-process on 127.0.0.1 (`LighthouseServer(min_replicas=workers)`)
  and the ranks learn its address through the launcher's process group;
- each rank is a replica group of one (`replica_group`) with `torchft.local_sgd.DiLoCo` around the workload's
  own optimizer (inner steps) and an outer `SGD(lr=outer_lr 0.7, momentum=outer_momentum 0.9, nesterov=True)`
  (Douillard et al. 2023's outer optimizer), syncing every `period` steps; `fragments` > 1 is Streaming DiLoCo
  (with `fragment_sync_delay` and `fragment_update_alpha`);
- pseudo-gradients go in one bucket per sync (`use_bucketization=True`, as thinwire's exchanges bucket; torchft's
  default is one all-reduce per parameter tensor).

**Same network as thinwire's cells.** torchft's process group is wrapped (`emulated_gloo`): every all-reduce runs
for real on gloo, then completes no earlier than the emulated link delivers it, with the α-β ring all-reduce cost
and the per-rank link queue (`LinkClock`) the Transport charges, and its bytes counted the same way (the DDP peers'
`AllReduceCounter`, `counter.py`). Each sync also starts a quorum through the Lighthouse, a remote procedure call
on a real deployment: it is charged one round trip of the emulated link (2 × one-way latency), counted as emulated
and exposed time.
Other control traffic (heartbeats, `should_commit` inside a replica group of one) runs on loopback uncharged.

**Not here:** `quantize=True` asks torchft to quantize pseudo-gradients, which needs Triton (a GPU): on CPU torchft
silently sends full precision. The cell's description says so; its bytes are what was sent (fp32).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from importlib.metadata import version

import torch
import torch.distributed as dist

from ...comm.state import broadcast_text
from ...errors import UserError
from ...exchange.faulty import Faulty
from ...launcher.worker import listen
from ...net import parse_network
from ...registry import Param, at_least, between
from ...run.stepper import make_optimizer, model_device
from .counter import AllReduceCounter, CountedWork, PeerStepper
from .registry import Peer, register


def emulated_gloo(counter, timeout: timedelta, faulty: Faulty | None = None):
    """torchft's ProcessGroupGloo whose all-reduces are delivered by the emulated link and counted (see above); with
    `faulty` (this rank's `--faulty`), what this rank hands each all-reduce is corrupted first, as thinwire's
    exchange corrupts a faulty rank's contribution (`thinwire.exchange.faulty`): torchft's DiLoCo all-reduces only
    pseudo-gradients, so the corruption is the same one."""
    from torchft.process_group import ProcessGroupGloo
    calls = [0]

    class _EmulatedGloo(ProcessGroupGloo):
        def allreduce(self, tensors, opts):
            if faulty is not None:
                calls[0] += 1
                for i, t in enumerate(tensors):
                    t.copy_(faulty.corrupt(t, i, calls[0], faulty.rank))
            work = super().allreduce(tensors, opts)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            # torchft's wrapper keeps the quorum rank it was configured with in `_rank` (its `rank()` is the base
            # class's, 0 on every replica: no ring neighbour across the thin link would be counted)
            me = self._rank if getattr(self, "_rank", None) is not None else self.rank()
            return CountedWork(counter, work, counter.charge(self.size(), nbytes, me=me))

    return _EmulatedGloo(timeout=timeout)


def quiet() -> None:
    """torchft's logs at warnings (its Rust side logs every quorum otherwise) and errors (e.g. a warning per manager
    about NCCL's recorder), unless RUST_LOG says otherwise."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.ERROR)


def replica_group(counter: AllReduceCounter, lighthouse: str, replica_id: str, min_replicas: int, timeout_s: float,
                  model, inner, faulty: Faulty | None = None):
    """(Manager, process group, store) of a torchft replica group of one on 127.0.0.1: its own `TCPStore`, the
    emulated gloo and a `Manager` (`use_async_quorum=False`, as DiLoCo requires; `init_sync=False`: every replica
    builds the same model from the seed) whose state is `model`'s and the `inner` optimizer's (what a healing
    replica receives). The store lives as long as the Manager: keep it."""
    from torchft import Manager

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    fd, port = listen("127.0.0.1", 0)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                          use_libuv=False)
    timeout = timedelta(seconds=timeout_s)
    pg = emulated_gloo(counter, timeout, faulty)
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replicas,
                      use_async_quorum=False, init_sync=False, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=port, lighthouse_addr=lighthouse, replica_id=replica_id, hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=60))
    return manager, pg, store


class TorchftDiLoCoStepper(PeerStepper):
    """torchft's DiLoCo around the workload's optimizer: `step()` is the inner optimizer's step, whose post-hook
    (torchft's) starts the quorum and the pseudo-gradient all-reduce and applies the outer step every `period`."""

    def __init__(self, cfg, wl, rank: int, world_size: int):
        why = TORCHFT.missing()
        if why:
            raise UserError(why)
        quiet()
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        p = cfg.params
        period, fragments = int(p.get("period", 8)), int(p.get("fragments", 1))
        self.counter = AllReduceCounter(rank, parse_network(cfg.network))
        module = wl.model(cfg.seed).to(model_device(cfg))
        super().__init__(module, module, rank)
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world_size) if rank == 0 else None
        address = broadcast_text(self.lighthouse.address() if rank == 0 else None, src=0)  # never a pickle
        self.optimizer = make_optimizer(cfg, wl, module)  # the inner one
        faulty = Faulty(cfg.faulty) if cfg.faulty is not None else None
        self.manager, self.pg, self.store = replica_group(self.counter, address, f"thinwire_{rank}", world_size,
                                                          600, module, self.optimizer,
                                                          faulty if faulty and faulty.rank == rank else None)
        self._charge_quorum()
        # Streaming DiLoCo splits the model into `fragments` consecutive groups of its top-level modules
        children = list(module.children()) or [module]
        if fragments > len(children):
            raise UserError(f"torchft-diloco: {fragments} fragments, but the model has {len(children)} top-level "
                            f"modules to split")
        bounds = [round(i * len(children) / fragments) for i in range(fragments + 1)]
        parts = [torch.nn.ModuleList(children[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        lr, momentum = float(p.get("outer_lr", 0.7)), float(p.get("outer_momentum", 0.9))
        nesterov = bool(p.get("nesterov", True))
        outer = [torch.optim.SGD(part.parameters(), lr=lr, momentum=momentum, nesterov=nesterov) for part in parts]
        self.diloco = DiLoCo(self.manager, parts, self.optimizer, outer, sync_every=period,
                             use_bucketization=bool(p.get("bucketize", True)),
                             should_quantize=bool(p.get("quantize", False)),
                             fragment_sync_delay=int(p.get("fragment_sync_delay", 0)),
                             fragment_update_alpha=float(p.get("fragment_update_alpha", 0.0)))
        self.diloco.__enter__()
        quant = " (quantize asked: needs Triton, so full precision on CPU)" if p.get("quantize") else ""
        self.desc = (f"torchft {_version()} DiLoCo, sync every {period} steps, outer SGD lr {lr:g} momentum "
                     f"{momentum:g}{' Nesterov' if nesterov else ''}, {fragments} fragment(s){quant}; quorum "
                     f"charged one round trip per sync")
        self.start_counting()

    def _charge_quorum(self) -> None:
        """Each quorum is one round trip to the Lighthouse on a real deployment: charge it on the emulated link."""
        start, counter = self.manager.start_quorum, self.counter

        def start_quorum(*args, **kwargs):
            out = start(*args, **kwargs)
            rtt = 2 * counter.link.latency if counter.link.emulated else 0.0
            if rtt > 0:
                counter.emulated_s += rtt
                t0 = time.perf_counter()
                time.sleep(rtt)
                counter.wait_s += time.perf_counter() - t0
            return out
        self.manager.start_quorum = start_quorum

    def counted(self, before) -> tuple[dict, dict]:
        meter, metrics = super().counted(before)
        return meter, {**metrics, "syncs": self.manager.current_step()}

    def shutdown(self) -> None:
        clean = sys.exc_info()[0] is None
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if clean and dist.is_initialized():
            dist.barrier()  # every replica is done before the Lighthouse goes
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.pg.shutdown()
        self.store = None


def _version() -> str:
    try:
        return version("torchft")
    except Exception:  # noqa: BLE001
        return "?"


def check(params: dict, workers: int) -> None:
    """Combinations torchft's DiLoCo refuses (its own checks raise deep inside a worker), on parameters already
    converted and range-checked: a one-line UserError."""
    period = params.get("period", 8)
    fragments = params.get("fragments", 1)
    delay = params.get("fragment_sync_delay", 0)
    if period % fragments:
        raise UserError(f"torchft-diloco: fragments ({fragments}) must divide period ({period})")
    if delay >= period // fragments:
        raise UserError(f"torchft-diloco: fragment_sync_delay ({delay}) must be below period / fragments "
                        f"({period // fragments})")


PARAMS = (Param("period", (int,), 8, at_least(1)), Param("outer_lr", (float,), 0.7, between(0, 10, low_open=True)),
          Param("outer_momentum", (float,), 0.9, between(0, 1, high_open=True)), Param("nesterov", (bool,), True),
          Param("fragments", (int,), 1, at_least(1)), Param("fragment_sync_delay", (int,), 0, at_least(0)),
          Param("fragment_update_alpha", (float,), 0.0, between(0, 1)), Param("quantize", (bool,), False))
TORCHFT = register(Peer("torchft-diloco", TorchftDiLoCoStepper, ("localsgd", "none"), {p.name: p for p in PARAMS},
                        plan_params={"period": None}, kind="torchft peer", needs="torchft",
                        install="pip install 'thinwire[peers]' (torch==2.13.0 torchft==0.2.0)", checks=check,
                        faulty=True, one_machine="its Lighthouse and replica stores listen on 127.0.0.1"))
