"""`thinwire bench coding`: sparse collectives against their α-β formulas, and QSGD's bits with lossless coding.

    thinwire bench coding                          # 2, 4, 8 workers × cluster, wan × density 1%, 0.1%
    thinwire bench coding --workers 2 4 --networks cluster --numel 262144 --out docs/benchmarks

Part 1, per (workers, network, density, collective): top-k of a Gaussian tensor of `numel` fp32 elements with
residual memory, `steps` exchanges; bytes sent per worker per step (the Transport's meter), the emulated network
time per step (the meter's sum of its ops' α-β times, this rank) and the slowest rank's wall time per step, beside
the α-β prediction of `thinwire.net.cost.sparse_collective`. Part 2 (one process): QSGD levels on a Gaussian
tensor, bits per element fixed-width vs Elias-gamma vs canonical Huffman vs the levels' entropy, and the coders'
encode+decode time.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from ..comm import Transport
from ..compress import coders, compressors, memories
from ..compress.bitpack import unpack
from ..compress.coding import entropy_bits, zigzag
from ..exchange import Exchange
from ..exchange.sparse import SPARSE_COLLECTIVES as COLLECTIVES
from ..files import pyplot, save, write_json
from ..launcher import launch
from ..net import parse_network
from ..net.cost import sparse_collective


def _collectives_worker(rank, world_size, numel, densities, steps):
    torch.set_num_threads(1)
    tr = Transport()
    out = []
    for density in densities:
        for name in COLLECTIVES:
            ex = Exchange(tr, compressors.get("topk", ratio=density), memories.get("residual"), sparse_collective=name)
            gen = torch.Generator().manual_seed(rank + 1)
            xs = [torch.randn(numel, generator=gen) for _ in range(steps + 1)]
            ex.aggregate(xs[0], "w")                      # warm-up (not counted)
            dist.barrier()
            before = tr.meter.totals()
            t0 = time.perf_counter()
            for x in xs[1:]:
                ex.aggregate(x, "w")
            wall = torch.tensor([(time.perf_counter() - t0) / steps])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            after = tr.meter.totals()
            out.append({"density": density, "collective": name,
                        "bytes_per_step": (after["bytes_sent"] - before["bytes_sent"]) / steps,
                        "emulated_s_per_step": (after["emulated_s"] - before["emulated_s"]) / steps,
                        "wall_s_per_step": float(wall)})
    return out


def collectives(workers, networks, densities, numel, steps) -> list[dict]:
    rows = []
    for net in networks:
        link = parse_network(net)
        for n in workers:
            res = launch(_collectives_worker, n, network=net, args=(numel, densities, steps), timeout=1800)
            for i, row in enumerate(res[0]):       # every rank's rows are in the same (density, collective) order
                k = max(1, int(row["density"] * numel))
                pred = sparse_collective(row["collective"], link, n, k, numel)
                rows.append({"network": net, "workers": n, **row,
                             "max_bytes_per_step": max(r[i]["bytes_per_step"] for r in res),
                             "predicted_s": pred.time, "predicted_bytes": pred.sent})
    return rows


def qsgd_bits(numel: int, repeat: int = 3) -> list[dict]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for levels in (1, 3, 7, 15, 63):
        q = compressors.get("qsgd", levels=levels)
        p = q.compress(x)
        codes = unpack(p.tensors[0], q.bits, numel).long()
        row = {"levels": levels, "fixed_bits": q.bits, "entropy_bits": entropy_bits(codes)}
        for coder in ("elias", "huffman"):
            c = coders.get(coder)
            sym = zigzag(codes - levels) if coder == "elias" else codes
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                head, data = c.encode(sym)
                c.decode(head, data)
                times.append(time.perf_counter() - t0)
            row[f"{coder}_bits"] = (8 * data.numel() + 32 * head.numel()) / numel
            row[f"{coder}_ms"] = sorted(times)[len(times) // 2] * 1e3
        rows.append(row)
    return rows


def _md(rows, bits, args) -> str:
    lines = ["| network | workers | density | collective | bytes/worker/step (rank 0 / max) | predicted bytes | "
             "emulated s/step | predicted s | wall s/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['network']} | {r['workers']} | {r['density']:g} | {r['collective']} | "
                     f"{r['bytes_per_step']:.0f} / {r['max_bytes_per_step']:.0f} | {r['predicted_bytes']:.0f} | "
                     f"{r['emulated_s_per_step']:.4f} | {r['predicted_s']:.4f} | {r['wall_s_per_step']:.3f} |")
    lines += ["", f"QSGD on {args.qsgd_numel} Gaussian elements (bucket 512): bits per element",
              "", "| levels s | fixed width | Elias-gamma | Huffman | entropy of levels | Elias enc+dec ms | "
              "Huffman enc+dec ms |", "|---|---|---|---|---|---|---|"]
    for b in bits:
        lines.append(f"| {b['levels']} | {b['fixed_bits']} | {b['elias_bits']:.3f} | {b['huffman_bits']:.3f} | "
                     f"{b['entropy_bits']:.3f} | {b['elias_ms']:.1f} | {b['huffman_ms']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Bytes per worker per step (left) and emulated vs predicted time per step (right), density 1%."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, pred) in zip(axes, (("bytes_per_step", "predicted_bytes"), ("emulated_s_per_step", "predicted_s"))):
        for name, marker in zip(COLLECTIVES, "osD^"):
            for net, style in (("cluster", "-"), ("wan", "--")):
                pts = sorted((r["workers"], r[key], r[pred]) for r in rows if r["collective"] == name
                             and r["network"] == net and abs(r["density"] - 0.01) < 1e-9)
                if not pts or (key == "bytes_per_step" and net == "wan"):
                    continue
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                                label=f"{name} {net}" if key != "bytes_per_step" else name)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color(), alpha=0.6)
        ax.set_xlabel("workers")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("bytes sent per worker per step (dotted: α-β)")
    axes[1].set_ylabel("emulated network s per step (dotted: α-β)")
    fig.suptitle("top-k at density 1%: sparse collectives (measured vs α-β prediction)")
    save(fig, path)


def run(args) -> int:
    rows = collectives(args.workers, args.networks, args.densities, args.numel, args.steps) if args.workers else []
    bits = qsgd_bits(args.qsgd_numel)
    print(json.dumps({"collectives": rows, "qsgd": bits}, indent=1) if args.json else _md(rows, bits, args))
    if args.out:
        write_json({"collectives": rows, "qsgd": bits, "numel": args.numel}, args.out, "coding.json")
        if rows:
            plot(rows, os.path.join(args.out, "coding.png"))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("coding", help="sparse collectives vs α-β; qsgd bits with Elias/Huffman coding")
    p.add_argument("--workers", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--networks", nargs="+", default=["cluster", "wan"])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--qsgd-numel", type=int, default=1 << 20)
    p.add_argument("--out", default=None, help="directory for coding.json and coding.png")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
