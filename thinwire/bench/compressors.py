"""`thinwire bench compressors`: every registered compressor's compress and decompress time on N fp32 elements,
against one memcpy of the same input measured in the same run, with its payload size (bits per element, actual
and nominal). Times are medians of `--repeat` runs after one warm-up; the input is a (N/1024, 1024) matrix when
1024 divides N (PowerSGD compresses matrices), else a vector. Each compressor goes through the common interface
only: `compress(x, key, step)` then `decompress(payload)`; a compressor that fails is reported with its error.
Bits per element: the payload as compressed (actual, and its `nominal_bits`), and what the exchange really puts
on the wire per rank's contribution at `--world-size` ranks on the collective it picks there
(`thinwire.exchange.choose.wire_bits`: a quantizer's all-reduce sums levels widened for that many ranks, e.g.
qsgd's 4-bit codes as 8-bit levels from 4 ranks and 32-bit ones from 19).

    thinwire bench compressors --only qsgd,terngrad --clock cpu --out docs/benchmarks

memcpy is `dst.copy_(x)` into a preallocated tensor (the fastest copy; compressors allocate their outputs, which
costs page faults on the CPU: set THP_MEM_ALLOC_ENABLE=1 to let PyTorch use huge pages for large tensors).
`--device cuda` times on the GPU (CUDA-synchronised wall clock; the first calls compile the fused kernels, so a
warm-up precedes the timed runs) and also times `torch.topk` of 1 % of the input, the yardstick of the top-k
family there. The table's last column is the compressor's speed target on that device (`TARGETS`; none for the
sketches, transforms and coders; BENCHMARKS.md, "Compressors"), marked `OVER` where the measured multiple exceeds
it.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from ..compress import compressors
from ..errors import UserError
from ..exchange.choose import wire_bits
from ..files import check_writable_dir, pyplot, save, write_json


QUANTIZERS_1_2_BIT = ("signsgd", "signum", "efsignsgd", "onebit", "terngrad", "threshold2bit")
TARGETS = {   # x memcpy per device; "topk": a multiple of torch.topk of 1 % instead
    "cpu": {**{n: 8.0 for n in QUANTIZERS_1_2_BIT + ("int8", "qsgd", "natural", "fp4", "fp8", "fp16", "bf16")},
            **{n: 12.0 for n in ("topk", "dgc", "gaussiank", "threshold", "stc", "qsparse", "sparseloco")},
            "randomk": 4.0},
    "cuda": {**{n: 3.0 for n in QUANTIZERS_1_2_BIT + ("int8", "fp16", "bf16")},
             **{n: 4.0 for n in ("qsgd", "natural", "fp4", "fp8")},
             "randomk": 2.0, **{n: ("topk", 1.2) for n in ("topk", "dgc", "stc")}},
}


def target(result: dict, name: str) -> float | None:
    """The target multiple of memcpy for compressor `name` on the result's device (None: no target)."""
    t = TARGETS.get(result.get("device", "cpu"), {}).get(name)
    if isinstance(t, tuple):
        return t[1] * result["torch_topk_ms"] / result["memcpy_ms"] if "torch_topk_ms" in result else None
    return t


def bench(numel: int, names: list[str], repeat: int = 5, seed: int = 0, clock: str = "wall",
          world_size: int = 4, device: str = "cpu", params: dict | None = None) -> dict:
    """`clock="cpu"` times with this process's CPU time (all its threads) instead of the wall clock: on a machine
    shared with other jobs it leaves out the time this process waits for a core, so the ratios to memcpy stay
    meaningful (memory-bandwidth contention still shows). `device="cuda"` puts the input on the GPU and times
    each call CUDA-synchronised on the wall clock; the result then also holds `device` ("cuda"), the GPU's name
    (`device_name`) and the time of `torch.topk` of 1 % (`torch_topk_ms`). `params` (name -> value) go to every
    compressor that takes them (its row's `params`)."""
    if clock not in ("wall", "cpu"):
        raise UserError(f"clock must be one of wall, cpu; got {clock!r}")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device must be one of cpu, cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here")
    if device == "cuda" and clock == "cpu":
        raise UserError("--clock cpu times the host; on --device cuda the wall clock, CUDA-synchronised, is used")
    cuda = device == "cuda"
    now = time.perf_counter if clock == "wall" else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    shape = (numel // 1024, 1024) if numel >= 1024 and numel % 1024 == 0 else (numel,)
    x = torch.randn(shape, generator=gen).to(device)
    dst = torch.empty_like(x)
    dst.copy_(x)

    def timed(fn):
        sync()
        t0 = now()
        out = fn()
        sync()
        return now() - t0, out

    memcpy_ms = statistics.median(timed(lambda: dst.copy_(x))[0] for _ in range(max(repeat, 3))) * 1e3
    del dst
    extra = {}
    if cuda:
        flat = x.reshape(-1)
        k = max(1, numel // 100)
        timed(lambda: torch.topk(flat.abs(), k, sorted=False))
        extra = {"device": "cuda", "device_name": torch.cuda.get_device_name(x.device),
                 "torch_topk_ms": statistics.median(timed(lambda: torch.topk(flat.abs(), k, sorted=False))[0]
                                                    for _ in range(max(repeat, 3))) * 1e3}
    rows = []
    for name in names:
        row = {"name": name}
        try:
            own = {k: v for k, v in (params or {}).items() if compressors.accepts(name, k)}
            if own:
                row["params"] = own
            comp = compressors.get(name, **own)
            t0 = time.perf_counter()
            for step in range(-2 if cuda else 0, 1):      # (on a GPU: compile and warm up first)
                payload = comp.compress(x, key="bench", step=step)
                comp.decompress(payload)
            sync()
            row["warmup_s"] = time.perf_counter() - t0      # on a GPU: the kernels' compilation, mostly
            tc, td = [], []
            for step in range(1, repeat + 1):
                del payload
                t, payload = timed(lambda: comp.compress(x, key="bench", step=step))
                tc.append(t)
                t, out = timed(lambda: comp.decompress(payload))
                td.append(t)
                del out
            row.update(compress_ms=statistics.median(tc) * 1e3, decompress_ms=statistics.median(td) * 1e3)
            row["x_memcpy"] = (row["compress_ms"] + row["decompress_ms"]) / memcpy_ms
            row["payload_bytes"] = int(payload.nbytes)
            row["bits_per_element"] = payload.nbytes * 8.0 / max(numel, 1)
            row["nominal_bits_per_element"] = float(comp.nominal_bits(numel))
            row["collective"], wire = wire_bits(comp, numel, world_size)
            row["wire_bits_per_element"] = float(wire)
            del payload
        except Exception as exc:          # report and go on: one broken compressor must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return {"numel": numel, "world_size": world_size, "memcpy_ms": memcpy_ms, **extra, "compressors": rows}


def table(result: dict) -> str:
    n = result.get("world_size", 4)
    where = result.get("device_name", result.get("device", "cpu"))
    head = (f"numel {result['numel']} on {where}, memcpy {result['memcpy_ms']:.3f} ms (medians); wire: per rank's "
            f"contribution at {n} ranks")
    if "torch_topk_ms" in result:
        head += (f"; torch.topk of 1 %: {result['torch_topk_ms']:.3f} ms = "
                 f"{result['torch_topk_ms'] / result['memcpy_ms']:.2f}x memcpy")
    lines = [head,
             f"{'compressor':<14}{'compress ms':>12}{'decomp. ms':>12}{'x memcpy':>10}{'payload B':>12}"
             f"{'bits/el':>9}{'nominal':>9}{'wire':>9}  {'collective':<11}target"]
    for r in result["compressors"]:
        if "error" in r:
            lines.append(f"{r['name']:<14}error: {r['error']}")
            continue
        goal = target(result, r["name"])
        mark = "" if goal is None else f"<= {goal:.1f}" + (" OVER" if r["x_memcpy"] > goal else "")
        name = r["name"] + "".join(f" {k}={v}" for k, v in r.get("params", {}).items())
        lines.append(f"{name:<13} {r['compress_ms']:>12.2f}{r['decompress_ms']:>12.2f}{r['x_memcpy']:>10.2f}"
                     f"{r['payload_bytes']:>12d}{r['bits_per_element']:>9.4f}{r['nominal_bits_per_element']:>9.4f}"
                     f"{r['wire_bits_per_element']:>9.4f}  {r['collective']:<11}{mark}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bars of compress + decompress time in memcpys (the targets on the result's device as marks) and of
    bits/element."""
    plt = pyplot()
    rows = [r for r in result["compressors"] if "error" not in r]
    names = [r["name"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(rows)), 7), sharex=True)
    a.bar(names, [r["compress_ms"] / result["memcpy_ms"] for r in rows], label="compress")
    a.bar(names, [r["decompress_ms"] / result["memcpy_ms"] for r in rows],
          bottom=[r["compress_ms"] / result["memcpy_ms"] for r in rows], label="decompress")
    goals = [target(result, r["name"]) for r in rows]
    a.scatter(names, goals, color="r", marker="_", s=300, label="target")
    top = 40.0                  # one slow outlier must not flatten the rest: clip and label it
    a.set_ylim(0, top)
    for i, r in enumerate(rows):
        if r["x_memcpy"] > top:
            a.text(i, top * 0.97, f"{r['x_memcpy']:.0f}x", ha="center", va="top", fontsize=8, rotation=90)
    a.set_ylabel("time / memcpy")
    a.set_title(f"{result['numel']} fp32 elements on {result.get('device_name', result.get('device', 'cpu'))}; "
                f"memcpy {result['memcpy_ms']:.3f} ms")
    a.legend()
    b.bar(names, [r["bits_per_element"] for r in rows], label="actual")
    b.scatter(names, [r["nominal_bits_per_element"] for r in rows], color="k", marker="_", s=200, label="nominal")
    b.scatter(names, [r["wire_bits_per_element"] for r in rows], color="r", marker="x",
              label=f"on the wire at {result.get('world_size', 4)} ranks")
    b.set_yscale("log")
    b.set_ylabel("bits per element")
    b.legend()
    plt.setp(b.get_xticklabels(), rotation=45, ha="right")
    save(fig, path)


def run(args) -> int:
    names = compressors.names() + ["qsgd+elias", "qsgd+huffman", "topk+golomb"]  # coded (compress/coded.py)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        for n in names:
            compressors.lookup(n)
    if args.numel < 0 or args.repeat < 1 or args.world_size < 1:
        raise UserError("--numel must be >= 0, --repeat >= 1 and --world-size >= 1")
    params = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--set takes KEY=VALUE, got {item!r}")
        if not any(compressors.accepts(n, key.strip()) for n in names):
            raise UserError(f"--set {key.strip()}: none of the compressors benchmarked takes it")
        params[key.strip()] = value.strip()
    for n in names:          # a bad value: one line before anything runs
        compressors.get(n, **{k: v for k, v in params.items() if compressors.accepts(n, k)})
    as_file = bool(args.out) and (args.out.endswith(".json") or os.path.isfile(args.out))
    if args.out:       # before the run: never lose it to a bad path
        check_writable_dir(os.path.dirname(os.path.abspath(args.out)) if as_file else args.out, "--out")
    result = bench(args.numel, names, args.repeat, args.seed, args.clock, args.world_size, args.device, params)
    print(json.dumps(result, indent=1) if args.json else table(result))
    if as_file:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.out)[0] + ".png")
    elif args.out:
        write_json(result, args.out, "compressors.json")
        plot(result, os.path.join(args.out, "compressors.png"))
    return 0


def register(sub) -> None:
    p = sub.add_parser("compressors", help="compress/decompress time vs memcpy, payload bits vs nominal")
    p.add_argument("--numel", type=int, default=1 << 24, help="fp32 elements (default 2^24)")
    p.add_argument("--only", help="comma-separated compressor names (default: every registered one)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per compressor (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="wall clock (default) or this process's CPU time (for a machine shared with other jobs)")
    p.add_argument("--world-size", type=int, default=4,
                   help="ranks the wire bits are reported for (the exchange's collective depends on it)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the input lives (cuda: CUDA-synchronised wall clock, fused kernels compiled first)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter for every compressor benchmarked that takes it, e.g. --only randomk --set "
                        "ratio=0.3 (repeatable)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="FILE.json (and FILE.png beside it), or a directory for compressors.json and "
                                 "compressors.png")
    p.set_defaults(func=run)
