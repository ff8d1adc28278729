"""`thinwire bench compressors`: every registered compressor's compress and decompress time on N fp32 elements,
against one memcpy of the same input measured in the same run, with its payload size (bits per element, actual
and nominal). Times are medians of `--repeat` runs after one warm-up; the input is a (N/1024, 1024) matrix when
1024 divides N (PowerSGD compresses matrices), else a vector. Each compressor goes through the common interface
only: `compress(x, key, step)` then `decompress(payload)`; a compressor that fails is reported with its error.
Bits per element: the payload as compressed (actual, and its `nominal_bits`), and what the exchange really puts
on the wire per rank's contribution at `--world-size` ranks on the collective it picks there
(`Compressor.wire_bits`: a quantizer's all-reduce sums levels widened for that many ranks, e.g. qsgd's 4-bit
codes as 8-bit levels from 4 ranks and 32-bit ones from 19).

    thinwire bench compressors [--numel 16777216] [--json] [--only qsgd,terngrad] [--repeat 5] [--out DIR]
                               [--clock wall|cpu] [--world-size 4]

`--out DIR` also writes DIR/compressors.json and DIR/compressors.png (x memcpy per compressor, bits per element).

memcpy is `dst.copy_(x)` into a preallocated tensor (the fastest copy; compressors allocate their outputs, which
costs page faults here: set THP_MEM_ALLOC_ENABLE=1 to let PyTorch use huge pages for large tensors).
"""
from __future__ import annotations

import json
import os
import statistics
import time

from ..errors import UserError
from .calibrate import median_s
from ..files import pyplot, save, write_json


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench(numel: int, names: list[str], repeat: int = 5, seed: int = 0, clock: str = "wall",
          world_size: int = 4) -> dict:
    """`clock="cpu"` times with this process's CPU time (all its threads) instead of the wall clock: on a machine
    shared with other jobs it leaves out the time this process waits for a core, so the ratios to memcpy stay
    meaningful (memory-bandwidth contention still shows)."""
    import torch
    if clock not in ("wall", "cpu"):
        raise UserError(f"clock must be one of wall, cpu; got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.process_time
    from ..compress import compressors
    gen = torch.Generator().manual_seed(seed)
    shape = (numel // 1024, 1024) if numel >= 1024 and numel % 1024 == 0 else (numel,)
    x = torch.randn(shape, generator=gen)
    dst = torch.empty_like(x)
    dst.copy_(x)
    memcpy_ms = median_s(lambda: dst.copy_(x), max(repeat, 3), clock=now) * 1e3
    del dst
    rows = []
    for name in names:
        row = {"name": name}
        try:
            comp = compressors.get(name)
            payload = comp.compress(x, key="bench", step=0)
            comp.decompress(payload)
            tc, td = [], []
            for step in range(1, repeat + 1):
                del payload
                t0 = now()
                payload = comp.compress(x, key="bench", step=step)
                t1 = now()
                out = comp.decompress(payload)
                t2 = now()
                del out
                tc.append(t1 - t0)
                td.append(t2 - t1)
            row.update(compress_ms=_median_ms(tc), decompress_ms=_median_ms(td))
            row["x_memcpy"] = (row["compress_ms"] + row["decompress_ms"]) / memcpy_ms
            row["payload_bytes"] = int(payload.nbytes)
            row["bits_per_element"] = payload.nbytes * 8.0 / max(numel, 1)
            row["nominal_bits_per_element"] = float(comp.nominal_bits(numel))
            row["collective"], wire = comp.wire_bits(numel, world_size)
            row["wire_bits_per_element"] = float(wire)
            del payload
        except Exception as exc:          # report and go on: one broken compressor must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return {"numel": numel, "world_size": world_size, "memcpy_ms": memcpy_ms, "compressors": rows}


def _table(result: dict) -> str:
    n = result.get("world_size", 4)
    lines = [f"numel {result['numel']}, memcpy {result['memcpy_ms']:.2f} ms (medians); wire: per rank's "
             f"contribution at {n} ranks",
             f"{'compressor':<14}{'compress ms':>12}{'decomp. ms':>12}{'x memcpy':>10}{'payload B':>12}"
             f"{'bits/el':>9}{'nominal':>9}{'wire':>9}  collective"]
    for r in result["compressors"]:
        if "error" in r:
            lines.append(f"{r['name']:<14}error: {r['error']}")
            continue
        lines.append(f"{r['name']:<14}{r['compress_ms']:>12.2f}{r['decompress_ms']:>12.2f}{r['x_memcpy']:>10.2f}"
                     f"{r['payload_bytes']:>12d}{r['bits_per_element']:>9.4f}{r['nominal_bits_per_element']:>9.4f}"
                     f"{r['wire_bits_per_element']:>9.4f}  {r['collective']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bars of compress + decompress time in memcpys (targets: 8x quantizers, 12x samplers) and of bits/element."""
    plt = pyplot()
    rows = [r for r in result["compressors"] if "error" not in r]
    names = [r["name"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(rows)), 7), sharex=True)
    a.bar(names, [r["compress_ms"] / result["memcpy_ms"] for r in rows], label="compress")
    a.bar(names, [r["decompress_ms"] / result["memcpy_ms"] for r in rows],
          bottom=[r["compress_ms"] / result["memcpy_ms"] for r in rows], label="decompress")
    for y, text, va in ((8, "8x (quantizers)", "top"), (12, "12x (dgc, gaussiank, threshold, randomk)", "bottom")):
        a.axhline(y, color="gray", ls="--", lw=0.8)
        a.text(-0.5, y, text, ha="left", va=va, fontsize=8, color="gray")
    top = 40.0                  # one slow outlier must not flatten the rest: clip and label it
    a.set_ylim(0, top)
    for i, r in enumerate(rows):
        if r["x_memcpy"] > top:
            a.text(i, top * 0.97, f"{r['x_memcpy']:.0f}x", ha="center", va="top", fontsize=8, rotation=90)
    a.set_ylabel("time / memcpy")
    a.set_title(f"{result['numel']} fp32 elements; memcpy {result['memcpy_ms']:.1f} ms")
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
    from ..compress import compressors
    names = compressors.names() + ["qsgd+elias", "qsgd+huffman", "topk+golomb"]  # coded (compress/coded.py)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        for n in names:
            compressors.lookup(n)
    if args.numel < 0 or args.repeat < 1 or args.world_size < 1:
        raise UserError("--numel must be >= 0, --repeat >= 1 and --world-size >= 1")
    result = bench(args.numel, names, args.repeat, args.seed, args.clock, args.world_size)
    print(json.dumps(result, indent=1) if args.json else _table(result))
    if args.out:
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
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="directory for compressors.json and compressors.png")
    p.set_defaults(func=run)
