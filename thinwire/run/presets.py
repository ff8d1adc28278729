"""Named comparison matrices for `thinwire compare --preset NAME`, and the cell-spec grammar.

A cell spec names one contestant:  `ALGO[:k=v,...][+COMPRESSOR[:k=v,...]]`, e.g. `bsp`,
`dts:delay=4,period=4`, `bsp+topk:ratio=0.01,memory=residual` (`memory=` picks the error-feedback memory), or a
PyTorch peer (`ddp`, `ddp-fp16`, `ddp-powersgd`, `ddp-postlocalsgd`, see `thinwire.run.peers`). A cell may also be
a dict `{"algorithm": ..., "compressor": ..., "memory": ..., "params": {...}, "label": ...}`.

Algorithms and compressors are registered by other modules; a preset names what the seed papers compare and
`resolve` keeps only what is registered now, with a note for each thing it leaves out (never an error).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..registry import _convert

PEERS = ("ddp", "ddp-fp16", "ddp-powersgd", "ddp-postlocalsgd")


@dataclass
class Cell:
    """One contestant (its network is added by the harness)."""
    label: str
    algorithm: str
    compressor: str | None = None
    memory: str | None = None
    params: dict = field(default_factory=dict)

    @property
    def peer(self) -> bool:
        return self.algorithm in PEERS

    def to_dict(self) -> dict:
        return {"label": self.label, "algorithm": self.algorithm, "compressor": self.compressor,
                "memory": self.memory, "params": dict(self.params), "peer": self.peer}


@dataclass
class Preset:
    workload: str
    workers: int
    networks: list[str]
    cells: list
    budget_s: float          # per cell: a cell running longer is stopped and recorded as timed out
    doc: str = ""
    epochs: float | None = None
    target: float | None = None   # None: the workload's


def _kv(text: str, spec: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise UserError(f"malformed cell {spec!r}: {item!r} is not key=value; e.g. bsp+topk:ratio=0.01")
        k, v = (s.strip() for s in item.split("=", 1))
        out[k.replace("-", "_")] = _convert(v, None, None)
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
        return Cell(label, spec["algorithm"], spec.get("compressor"), spec.get("memory"), params)
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"a cell is a spec like 'bsp+topk:ratio=0.01,memory=residual' or a dict, got {spec!r}")
    spec = spec.strip()
    algo_part, _, comp_part = spec.partition("+")
    algo, _, algo_kv = algo_part.partition(":")
    params = _kv(algo_kv, spec)
    compressor = memory = None
    if comp_part:
        compressor, _, comp_kv = comp_part.partition(":")
        params.update(_kv(comp_kv, spec))
        compressor = compressor.strip() or None
    memory = params.pop("memory", None)
    return Cell(spec, algo.strip(), compressor, memory, params)


def _label(algorithm, compressor, memory, params) -> str:
    kv = ",".join(f"{k}={v}" for k, v in params.items())
    if compressor:
        mem = f",memory={memory}" if memory else ""
        return f"{algorithm}+{compressor}:{kv}{mem}".replace(":,", ":").rstrip(":")
    return f"{algorithm}:{kv}".rstrip(":")


def check(cell: Cell, strict: bool) -> tuple[Cell | None, list[str]]:
    """Validate a cell against the registries. strict: raise UserError on a problem (user-typed cells);
    otherwise drop the cell (unregistered name) or the parameter nobody declares, with a note (presets)."""
    from .. import algorithms
    from ..compress import compressors, memories
    notes: list[str] = []

    def problem(msg: str):
        if strict:
            raise UserError(msg)
        notes.append(msg)

    if cell.peer:
        from .peers import PEER_PARAMS
        bad = [k for k in cell.params if k not in PEER_PARAMS[cell.algorithm]]
        if bad:
            takes = ", ".join(PEER_PARAMS[cell.algorithm]) or "no parameters"
            problem(f"{cell.label}: peer {cell.algorithm!r} takes {takes}, not {', '.join(bad)}")
            cell.params = {k: v for k, v in cell.params.items() if k not in bad}
        if cell.compressor or cell.memory:
            raise UserError(f"{cell.label}: PyTorch peers take no thinwire compressor")
        return cell, notes
    for reg, name, what in ((algorithms.registry, cell.algorithm, "algorithm"),
                            (compressors, cell.compressor, "compressor"), (memories, cell.memory, "memory")):
        if name is not None and name not in reg:
            valid = ", ".join(reg.names() + (list(PEERS) if what == "algorithm" else []))
            if strict:
                raise UserError(f"unknown {what} {name!r} in cell {cell.label!r}; valid: {valid}")
            return None, [f"skipped {cell.label}: {what} {name!r} is not registered (yet)"]
    tables = [(algorithms.registry, cell.algorithm), (compressors, cell.compressor), (memories, cell.memory)]
    for key in list(cell.params):
        if not any(n is not None and reg.accepts(n, key) for reg, n in tables):
            problem(f"{cell.label}: no algorithm/compressor/memory there takes parameter {key!r}; "
                    f"running with its default")
            cell.params.pop(key)
    return cell, notes


def _registered_everything() -> list:
    from .. import algorithms
    skip = {"local"}  # the no-communication reference is measured separately (scalability)
    return [n for n in algorithms.names() if n not in skip] + list(PEERS)


PRESETS: dict[str, Preset] = {
    "quick": Preset(
        "wide-mlp", 4, ["wan"],
        ["bsp", "bsp+topk:ratio=0.01,memory=residual", "localsgd:period=8", "cdsgd", "dts:delay=4,period=4",
         *PEERS],
        budget_s=150, target=0.9,
        doc="make demo: the communication-heavy MLP (1.1 M params) on a 100 Mbit/s, 50 ms wide-area link, "
            "4 workers; thinwire's main algorithms against PyTorch's own options"),
    "paper-cdsgd": Preset(
        "digits-mlp", 4, ["cluster", "wan"],
        ["ssgd", "bsp", "bitsgd", "odsgd", "cdsgd"], budget_s=300,
        doc="seed 001 §4: synchronous SGD, 2-bit quantization (BIT-SGD), local update (OD-SGD) and CD-SGD"),
    "paper-dts": Preset(
        "wide-mlp", 4, ["custom:bandwidth=100mbit,latency=0ms", "custom:bandwidth=100mbit,latency=50ms",
                        "custom:bandwidth=100mbit,latency=250ms"],
        ["bsp", "delayed", "dts:delay=4,period=1", "tsparse", "dts:delay=1,period=4", "dts:delay=4,period=4"],
        budget_s=300,
        doc="seed 004 Fig. 3: bsp, delayed update, temporally sparse update and DTS across latencies"),
}


def get(name: str) -> Preset:
    if name == "full":
        return Preset("digits-mlp", 4, ["wan"], _registered_everything(), budget_s=300,
                      doc="every registered algorithm with its defaults, plus the PyTorch peers")
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; valid: {', '.join(list(PRESETS) + ['full'])}")
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
