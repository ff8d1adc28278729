"""Named comparison matrices for `thinwire compare --preset NAME`, and the cell-spec grammar.

A cell spec names one contestant:  `ALGO[:k=v,...][+COMPRESSOR[:k=v,...]]`, e.g. `bsp`,
`dts:delay=4,period=4`, `bsp+topk:ratio=0.01,memory=residual` (`memory=` picks the error-feedback memory,
`optimizer=sgd|adamw|muon` the optimizer instead of the workload's own), or a peer by name (`ddp`, `ddp-fp16`,
`torchft-diloco`, ...: `thinwire.compare.peers`). A cell may also be a dict `{"algorithm": ..., "compressor": ...,
"memory": ..., "params": {...}, "label": ...}`.

Algorithms and compressors are registered by other modules; a preset names what the papers compare and `resolve`
keeps only what is registered (and installed) now, with a note for each thing it leaves out (never an error).
Parameters a cell leaves out are picked for the network by the planner (`thinwire.compare.forecast.tune_cell`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import algorithms
from ..compress import compressors, memories
from ..errors import UserError
from ..registry import parse_scalar
from ..run import workloads
from ..trainer.assembly import EXCHANGE_PARAMS, SCHED_PARAMS, TRANSPORT_PARAMS
from . import peers

# the parameters `thinwire train` routes past the algorithm, compressor and memory (the scheduler's, the
# transport's, the exchange's: e.g. aggregate=median), which a cell takes too; --faulty is the matrix's own
ROUTED = tuple(k for k in SCHED_PARAMS + TRANSPORT_PARAMS + EXCHANGE_PARAMS if k != "faulty")


@dataclass
class Cell:
    """One contestant (its network and seed are added by the harness)."""
    label: str
    algorithm: str
    compressor: str | None = None
    memory: str | None = None
    params: dict = field(default_factory=dict)
    optimizer: str | None = None

    @property
    def peer(self) -> bool:
        return peers.find(self.algorithm) is not None

    def to_dict(self) -> dict:
        return {**asdict(self), "peer": self.peer}


@dataclass
class Preset:
    workload: str
    workers: int
    networks: list[str]
    cells: list
    budget_s: float          # per cell: seconds of training time (evaluations excluded), the same for every cell
    doc: str = ""
    epochs: float | None = None   # an upper bound on the steps of a cell (None: the budget and the target only)
    target: float | None = None   # None: the workload's
    seeds: int = 1
    batch_size: int | None = None  # per worker; None: the workload's
    speeds: list = field(default_factory=lambda: [None])   # worker speed profiles (`thinwire.speeds`)


def _kv(text: str, spec: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise UserError(f"malformed cell {spec!r}: {item!r} is not key=value; e.g. bsp+topk:ratio=0.01")
        k, v = (s.strip() for s in item.split("=", 1))
        out[k.replace("-", "_")] = parse_scalar(v)
    return out


def parse_cell(spec) -> Cell:
    """A cell from its spec string or dict (syntax only; `check` validates the names)."""
    if isinstance(spec, Cell):
        return spec
    if isinstance(spec, dict):
        unknown = set(spec) - {"algorithm", "compressor", "memory", "params", "label"}
        if unknown or "algorithm" not in spec:
            raise UserError(f"a cell dict needs 'algorithm' and may have compressor, memory, params, label; "
                            f"got {sorted(spec)}")
        params = dict(spec.get("params") or {})
        label = spec.get("label") or _label(spec["algorithm"], spec.get("compressor"), spec.get("memory"), params)
        optimizer = params.pop("optimizer", None)
        return Cell(label, spec["algorithm"], spec.get("compressor"), spec.get("memory"), params, optimizer)
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"a cell is a spec like 'bsp+topk:ratio=0.01,memory=residual' or a dict, got {spec!r}")
    spec = spec.strip()
    algo_part, _, comp_part = spec.partition("+")
    algo, _, algo_kv = algo_part.partition(":")
    compressor, _, comp_kv = comp_part.partition(":")
    params = {**_kv(algo_kv, spec), **_kv(comp_kv, spec)}
    memory, optimizer = params.pop("memory", None), params.pop("optimizer", None)
    return Cell(spec, algo.strip(), compressor.strip() or None, memory, params, optimizer)


def _label(algorithm, compressor, memory, params) -> str:
    kv = ",".join(f"{k}={v}" for k, v in params.items())
    if compressor:
        mem = f",memory={memory}" if memory else ""
        return f"{algorithm}+{compressor}:{kv}{mem}".replace(":,", ":").rstrip(":")
    return f"{algorithm}:{kv}".rstrip(":")


def check(cell: Cell, strict: bool) -> tuple[Cell | None, list[str]]:
    """Validate a cell against the registries. strict: raise UserError on a problem (user-typed cells);
    otherwise drop the cell (unregistered name) or the parameter nobody declares, with a note (presets)."""
    notes: list[str] = []

    def problem(msg: str):
        if strict:
            raise UserError(msg)
        notes.append(msg)

    if cell.optimizer is not None:
        workloads.check_optimizer(cell.optimizer, f"{cell.label}: optimizer")
    peer = peers.find(cell.algorithm)
    if peer is not None:
        why = peer.missing()
        if why:
            if strict:
                raise UserError(why)
            return None, [f"skipped {cell.label}: {why}"]
        bad = peer.unknown(cell.params)
        if bad:
            problem(f"{cell.label}: {bad}")
            cell.params = {k: v for k, v in cell.params.items() if k in peer.params}
        if cell.compressor or cell.memory:
            raise UserError(f"{cell.label}: peers take no thinwire compressor")
        return cell, notes
    tables = ((algorithms.registry, cell.algorithm, "algorithm"), (compressors, cell.compressor, "compressor"),
              (memories, cell.memory, "memory"))
    for reg, name, what in tables:
        if name is not None and name not in reg:
            valid = ", ".join(reg.names() + (peers.names() if what == "algorithm" else []))
            if strict:
                raise UserError(f"unknown {what} {name!r} in cell {cell.label!r}; valid: {valid}")
            return None, [f"skipped {cell.label}: {what} {name!r} is not registered (yet)"]
    for key in list(cell.params):
        if key not in ROUTED and not any(n is not None and reg.accepts(n, key) for reg, n, _ in tables):
            problem(f"{cell.label}: no algorithm/compressor/memory there takes parameter {key!r}; "
                    f"running with its default")
            cell.params.pop(key)
    return cell, notes


_LM, _SGD = "stdlib-lm", "mnist1d-resnet"   # the language model (AdamW) and the momentum-SGD CNN workloads

PRESETS: dict[str, Preset] = {
    "quick": Preset(
        _LM, 4, ["world"],
        ["bsp", "ddp", "ddp-postlocalsgd:warmup=0", "bsp+topk:ratio=0.01,memory=residual", "localsgd", "diloco",
         "torchft-diloco"],
        budget_s=45, target=2.5,
        doc="make demo (under 10 minutes): the byte-level LM (1.1 M params) on `world` (50 Mbit/s, 150 ms "
            "one-way), 4 workers, 45 s of training per cell, target validation loss 2.5 (looser than the "
            "workload's 2.25 so that seven cells fit in 10 minutes on 2 cores, and tight enough that no cell gets "
            "there before its first synchronization: at 2.8 the local-update cells stopped at step 46 of a 64-step "
            "period, a race of no communication): bsp, PyTorch DDP, PyTorch's post-local SGD (the best "
            "PyTorch option on a wide-area link; no warm-up: its default 8 synchronous steps cost 24 of the 40 s "
            "here, and without them it is PyTorch's local SGD, thinwire's `localsgd`'s counterpart), top-k 1 % "
            "with error feedback, local SGD, DiLoCo as the planner picks it for the network (its sync hidden: "
            "streaming fragments and overlap by the τ rule, the all-reduce and outer compressor that suit the link) "
            "and torchft's DiLoCo; periods picked by the planner for the network. DTS and "
            "CD-SGD step momentum SGD (their compensation and local update are derived for it) "
            "and race on the SGD workload in `paper-dts` and `paper-cdsgd`"),
    "islands": Preset(
        _LM, 4, ["islands:2x2,inside=dc,across=world"],
        ["diloco", "diloco:replicas=worker", "localsgd", "ddp", "ddp-postlocalsgd:warmup=0", "torchft-diloco"],
        budget_s=45, target=2.5, seeds=3,
        doc="a two-tier network: 2 islands of 2 workers, `dc` (10 Gbit/s, 0.05 ms) inside an island, `world` (50 "
            "Mbit/s, 150 ms) between them, every message charged on the link it crosses. Hierarchical DiLoCo (the "
            "planner's `diloco`: one replica per island, data parallel inside, the outer sync once per island over "
            "the thin link) against flat DiLoCo (every worker a replica), local SGD, PyTorch's DDP and post-local "
            "SGD and torchft's DiLoCo (per worker), all on the same network; the report gives the bytes that "
            "crossed the thin link beside all that was sent. The LM, 45 s a cell, loss 2.5, 3 seeds"),
    "map": Preset(
        _LM, 4, ["dc", "cluster", "wan", "world", "home", "islands:2x2,inside=dc,across=world"],
        ["bsp", "localsgd", "diloco", "ddp", "ddp-postlocalsgd:warmup=0", "torchft-diloco"],
        budget_s=45, target=2.5,
        doc="the network map: every family's best cell (the planner's settings for each network) and the peers on "
            "`dc`, `cluster`, `wan`, `world`, a consumer link `home` (10 Mbit/s, 100 ms one-way) and two islands "
            "(`dc` inside, `world` across): synchronous SGD, local SGD, DiLoCo (streaming, eager or hierarchical as "
            "the planner picks), PyTorch's DDP and post-local SGD, torchft's DiLoCo. One plot of time to target "
            "against network with the measured winner and the planner's predicted one (predicted before the cells "
            "ran). The LM, 45 s a cell, loss 2.5; one seed by default (about 35 minutes on 2 cores), `--seeds 3` "
            "for the ranges"),
    "paper-dts": Preset(
        _SGD, 4, [f"custom:bandwidth=1gbit,latency={ms}ms" for ms in (0, 250, 1000)],
        ["bsp", "delayed:delay=4", "tsparse:period=4", "dts:delay=4,period=4", "dts",
         "dts:delay=4,period=4+dgc:ratio=0.001,memory=residual"],
        budget_s=60, batch_size=128,
        doc="Zhu, Lu, Lin, Han 2019, \"Distributed Training Across the World\" (DTS), Fig. 3 / Table 1 at the "
            "paper's ratio of compute to latency: bsp, delayed update (t=4), "
            "temporally sparse update (p=4), DTS at the paper's t=4, p=4 with and without DGC (0.1 %), and DTS with "
            "the planner's settings (within the accuracy bound (t-1)p <= 3 at momentum 0.9, which t=p=4, 12 steps, "
            "is not: on this workload it did not learn), momentum SGD, one-way latency 0, 250 and 1000 ms at "
            "1 Gbit/s. Batch 128 per worker (the workload's is 32) so that a step costs about the paper's compute: "
            "measured single-threaded here 45 ms at batch 32, 125 ms at 128, 238 ms at 256, so with 4 workers on 2 "
            "cores about 250 ms a step at 128 (idle machine) against 250 ms of one-way latency, as in the paper "
            "(~300 ms of compute, 277 ms of latency); at batch 32 the ratio was 1:3 and not the paper's regime. "
            "The workload's learning rate is kept (0.02, momentum 0.9). Three latencies instead of the paper's "
            "sweep and 60 s of training per cell keep the 18 cells at about 25 minutes (start-up and evaluations "
            "included; the no-communication reference first). Read scalability and the final metric per cell "
            "(the paper at 250 ms: DTS 0.72 vs SSGD 0.008)"),
    "paper-cdsgd": Preset(
        _SGD, 4, ["cluster", "wan"],
        ["ssgd", "bitsgd", "odsgd", "cdsgd:k=2", "cdsgd:k=5", "cdsgd:k=10", "cdsgd:k=20"],
        budget_s=150,
        doc="Yu et al. 2021 (CD-SGD, arXiv 2106.10796) §4: S-SGD, BIT-SGD (2-bit threshold quantization), "
            "OD-SGD (local update) and CD-SGD with "
            "k = 2, 5, 10, 20 on the momentum-SGD workload"),
    "hetero": Preset(
        _LM, 4, ["world", "home"],
        ["diloco", "diloco:dynamic=true", "async-diloco", "torchft-diloco", "ddp-postlocalsgd:warmup=0"],
        budget_s=45, target=2.5, seeds=1, speeds=[None, "one-half", "two-speeds", "stragglers"],
        doc="the map's second axis: workers of different speeds — equal, one worker of four at half speed, two "
            "speeds 1:3 (two workers each), stragglers (each worker, each step, a 2 % chance of 10 steps at a "
            "quarter speed) — on `world` and `home`, the LM workload, 45 s of training per cell to the validation "
            "loss 2.5. thinwire's DiLoCo synchronous (the planner's), with dynamic local updates and asynchronous, "
            "against torchft's DiLoCo and PyTorch's post-local SGD, which wait for the slowest worker at every "
            "sync; every contestant and the no-communication reference face the same speeds"),
    "world": Preset(
        _LM, 4, ["world"],
        ["bsp", "bsp+topk:ratio=0.01,memory=residual", "bsp+powersgd:rank=4,memory=powersgd", "localsgd", "dts",
         "cdsgd", "dpsgd", "diloco", "ddp", "ddp-powersgd", "ddp-postlocalsgd:warmup=0", "torchft-diloco"],
        budget_s=45, target=2.5, seeds=3,
        doc="the headline: every family once on `world` (50 Mbit/s, 150 ms one-way) against PyTorch's options "
            "and torchft's DiLoCo — synchronous SGD, top-k with error feedback, PowerSGD, local SGD, DTS, CD-SGD, "
            "D-PSGD (gossip), DiLoCo; DDP, DDP with PowerSGD, PyTorch's post-local SGD — on the LM workload, 4 "
            "workers, 3 seeds. 45 s of training per cell and the target validation loss 2.5, as in `quick`, so "
            "that the 36 runs take about 35 minutes on a 2-core machine (at the workload's own 2.25 and 150 s a "
            "cell it took over 2 hours). The parameter-server family is left out: 4 workers and a server make 5 "
            "processes. DTS and CD-SGD step momentum SGD (lr 0.1, momentum 0.9: the LM's SGD settings) with "
            "the planner's settings inside their accuracy bounds ((t-1)p <= 3, k <= 2): on `world` in 45 s DTS "
            "learns (t=1, p=16: loss 2.75) but does not reach 2.5, and CD-SGD gets about 15 steps of ~3 s (its 10 warm-up steps and "
            "its corrections are full-precision all-reduces of 4.3 MB), still in the transient after its warm-up"),
}


def get(name: str) -> Preset:
    if name == "full":  # `local`, the no-communication reference, is measured separately (scalability)
        return Preset("digits-mlp", 4, ["wan"], [n for n in algorithms.names() if n != "local"] + peers.names(),
                      budget_s=120, doc="every registered algorithm with its defaults, plus the peers")
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; valid: {', '.join(names())}")
    return PRESETS[name]


def names() -> list[str]:
    return list(PRESETS) + ["full"]


def resolve(specs, strict: bool) -> tuple[list[Cell], list[str]]:
    """Parse and check every spec; the cells to run and the notes about what was left out."""
    cells, notes, seen = [], [], set()
    for spec in specs:
        cell, why = check(parse_cell(spec), strict)
        notes += why
        if cell is not None and cell.label not in seen:
            seen.add(cell.label)
            cells.append(cell)
    if not cells:
        raise UserError("nothing to compare: none of the cells is registered; see `thinwire list`")
    return cells, notes
