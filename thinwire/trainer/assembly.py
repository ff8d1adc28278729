"""Assembly and checks: a run's components built from names and keyword parameters, and what they cannot check
alone, refused before any worker starts (`TrainConfig.validate` calls these too).

Keyword parameters are routed by name (`thinwire.registry.route`) to the algorithm, the compressor, the memory,
the scheduler (`thinwire.sched.make`: schedule, bucket_mb, ...) and the transport (`allreduce`: the all-reduce
algorithm); each gets the ones it declares, and a parameter none of them takes is an error. On the parameter
server, `downlink_<name>` is parameter <name> of the downlink compressor (`downlink_compressor="qsgd",
downlink_levels=3`; gathered into the algorithm's `downlink_params`). Every refusal is one line, a `UserError`.
"""
from __future__ import annotations

import inspect

import torch

from .. import algorithms, sched
from ..comm.collectives import parse
from ..comm.membership import MEMBERSHIP
from ..compress import Memory, compressors, memories
from ..errors import UserError
from ..exchange.exchange import Exchange, check_collectives
from ..registry import call, route

SCHED_PARAMS = tuple(inspect.signature(sched.make).parameters)
TRANSPORT_PARAMS = ("allreduce",)
EXCHANGE_PARAMS = tuple(inspect.signature(check_collectives).parameters)[1:]   # collective, ..., faulty


def build_components(algorithm, compressor=None, memory=None, **params):
    """Resolve defaults, route `params` by name and build (algorithm, compressor, memory, scheduler, transport
    options, exchange options: `collective`, `sparse_collective`, `aggregate`, `trim`, `clip`, `faulty`); raises
    UserError for unknown names, unknown parameters, bad values and invalid combinations (used before launching
    too)."""
    alg_cls = (algorithms.registry.constructor(algorithm, params) if isinstance(algorithm, str)
               else type(algorithm))
    compressor = compressor or alg_cls.default_compressor
    memory = memory or alg_cls.default_memory
    if isinstance(algorithm, str) and algorithms.registry.accepts(algorithm, "downlink_params"):
        down = {k: params.pop(k) for k in list(params)
                if k.startswith("downlink_") and k not in ("downlink_compressor", "downlink_params")}
        if down:   # the downlink compressor's own parameters (it names the valid ones)
            params["downlink_params"] = {**(params.get("downlink_params") or {}),
                                         **{k[len("downlink_"):]: v for k, v in down.items()}}
    alg_params, comp_params, mem_params, sched_params, transport_params, exchange_params = route(
        {"algorithm": (algorithms.registry, algorithm), "compressor": (compressors, compressor),
         "memory": (memories, memory)}, params, (SCHED_PARAMS, TRANSPORT_PARAMS, EXCHANGE_PARAMS))
    if not alg_cls.compression and compressor != "none":
        raise UserError(f"algorithm {alg_cls.name!r} does not exchange gradients through a compressor; "
                        f"drop --compressor or use one of: "
                        f"{', '.join(n for n in algorithms.names() if algorithms.registry.lookup(n).compression)}")
    schedule = sched_params.get("schedule", "fusion")
    if isinstance(schedule, str) and schedule not in alg_cls.schedules:
        raise UserError(f"algorithm {alg_cls.name!r} does not run with schedule {schedule!r}; "
                        f"valid: {', '.join(alg_cls.schedules)}")
    alg, comp, mem = (algorithms.get(algorithm, **alg_params), compressors.get(compressor, **comp_params),
                      memories.get(memory, **mem_params))
    alg.check_components(comp, mem)      # invalid pairings are refused here, before any worker starts
    check_collectives(comp, **exchange_params)
    robust = [k for k in ("aggregate", "faulty") if exchange_params.get(k, "mean") not in ("mean", None)]
    if robust and alg.exchange_class is not Exchange:    # the PS and gossip exchanges gather no contributions
        raise UserError(f"{' and '.join(robust)} act on an all-reduce exchange's contributions; {alg.name!r} on "
                        f"{alg.architecture} has none (use bsp, localsgd or diloco on allreduce)")
    return alg, comp, mem, call(sched.make, "schedule", sched_params), transport_params, exchange_params


def check_run(algorithm, transport_params: dict, world_size: int, optimizer=None, on_failure: str = "stop",
              watching: bool | None = None) -> None:
    """What built components cannot check alone, before any worker starts (`TrainConfig.validate`): the
    all-reduce algorithm over `world_size` ranks, the algorithm's own limits on the run (`Algorithm.check_run`:
    the world size, the optimizer) and `on_failure`."""
    if "allreduce" in transport_params:
        parse(transport_params["allreduce"], world_size)
    algorithm.check_run(world_size, optimizer)
    check_on_failure(on_failure, algorithm, watching)


def check_optimizer_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds tensors other than `model`'s parameters (another model's: it would update
    nothing the algorithm exchanges, and no rank would notice)."""
    mine = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in mine for p in held)
    if foreign:
        raise UserError(f"the optimizer holds {foreign} of {len(held)} tensors that are not the model's parameters "
                        f"(another model's?): build it from this model's parameters (model.parameters())")


def adam_feedback_warning(algorithm, compressor, memory, optimizer) -> str | None:
    """One line where a biased compressor's error feedback carries the gradient of an Adam: Adam divides by a running
    variance of what it is fed, whose compression error does not cancel (Tang et al. 2021, "1-bit Adam", arXiv
    2102.02888, §3). Measured on stdlib-lm (docs/adam.md): bsp + onebit + residual under AdamW stalls at test loss
    2.7 from step 150 on, where uncompressed AdamW reaches 2.07 at step 300. None where the combination is not that."""
    if not (algorithm.exchanges_gradients and isinstance(optimizer, torch.optim.Adam) and not compressor.unbiased
            and type(memory).update is not Memory.update):
        return None
    return (f"thinwire: error feedback on the gradient ({compressor.name} + memory {memory.name}) under "
            f"{type(optimizer).__name__} stalls (Tang et al. 2021, 1-bit Adam; docs/adam.md): use algorithm "
            f"onebit-adam or zeroone-adam, which exchange Adam's momentum with a frozen variance")


ON_FAILURE = ("stop", "continue")


def check_on_failure(on_failure: str, algorithm, watching: bool | None = None) -> None:
    """`continue` only for algorithms whose averages stay meaningful over a smaller group, and only where a
    launcher announces the survivors (`watching`; default: whether this process's launcher does)."""
    if on_failure not in ON_FAILURE:
        raise UserError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    if on_failure == "continue" and not algorithm.survives_failures:
        valid = sorted(n for n in algorithms.names() if algorithms.registry.lookup(n).survives_failures)
        raise UserError(f"on_failure='continue' needs an algorithm whose averages stay meaningful over fewer "
                        f"workers; {algorithm.name!r} is not one; valid: {', '.join(valid)} "
                        f"(elsewhere: on_failure='stop' and resume from a checkpoint)")
    if on_failure == "continue" and not (MEMBERSHIP.watching if watching is None else watching):
        raise UserError("on_failure='continue' needs thinwire's launcher to announce the survivors: start the "
                        "workers with thinwire.launch(..., on_failure='continue') (thinwire train "
                        "--on-failure continue); under torchrun use on_failure='stop' and --max-restarts")


def check_elastic(algorithm, scheduler) -> None:
    """An elastic job needs an algorithm that names its synchronization boundaries (where newcomers join)."""
    if type(algorithm).join_boundary is algorithms.base.Algorithm.join_boundary:
        valid = sorted(n for n in algorithms.names()
                       if algorithms.registry.lookup(n).join_boundary is not algorithms.base.Algorithm.join_boundary)
        raise UserError(f"an elastic job needs an algorithm that takes newcomers in at its synchronization "
                        f"boundaries; {algorithm.name!r} does not; valid: {', '.join(valid)}")
    if scheduler.defers_update:
        raise UserError("an elastic job cannot run schedule='priority' (its update is applied in the next "
                        "forward, so a step's end is no synchronization boundary); use fusion, wfbp or mgwfbp")
