"""`thinwire bench gpu`: what thinwire costs on one GPU, in one command (about 5 minutes on an H200).

    thinwire bench gpu [--out DIR] [--parts compressors,overhead,race] [--json]
    thinwire bench gpu --device cpu          # a dry run: the same code path at tiny sizes, on the CPU

Three tables, each against a baseline measured in the same run:
1. **compressors** — every compressor's compress + decompress of 2^25 fp32 elements on the GPU as multiples of one
   device memcpy of the input (`thinwire bench compressors --device cuda`'s measurement, its targets marked).
2. **overhead** — the median step (the median of three passes' medians, the rows interleaved) of a GPT-like
   model (`run.lm.ByteLM` at context 512, width 768, 12 layers, 12 heads: 85 M parameters; batch 8 x 512
   bytes, bf16 autocast, AdamW), one rank over NCCL (so a collective costs almost nothing and what shows is the
   framework's own cost): plain PyTorch, DDP, DDP with PyTorch's and thinwire's comm hooks, `tw.Trainer` with
   `bsp` (sends every step) and with the algorithms whose steps here send nothing (`local`; local SGD and DiLoCo
   with H = 1000; DTS's sparse steps). Targets (BENCHMARKS.md, "Step overhead"): a local
   step at most 1.03x plain, bsp at most 1.0x DDP, thinwire's fp16 hook no slower than PyTorch's.
3. **race** — a short `thinwire compare` of 4 workers sharing the GPU (gloo: NCCL takes one process per GPU;
   thinwire's transport stages point-to-point messages through pinned host buffers): stdlib-lm on `cluster`
   (1 Gbit/s, 0.1 ms), a time budget per cell, bsp, DiLoCo, D-PSGD (gossip: point to point) and PyTorch's DDP.

Without CUDA, `--device cuda` (the default) is one line and exit status 2. `--device cpu` runs every part at tiny
sizes (2^16 elements; a 2-layer width-64 model; a few steps per cell): a check that the command works, not a
measurement. Offline machines: docs/gpu.md says how to bring the wheels the project needs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..compare import CompareConfig, compare
from ..compare.report import table
from ..compress import compressors
from ..errors import UserError
from ..exchange.ddp import ddp_hook
from ..files import check_writable_dir
from ..run.lm import ByteLM
from ..trainer import Trainer
from . import compressors as cbench
from .calibrate import median_s

PARTS = ("compressors", "overhead", "race")

SIZES = {
    "cuda": {"numel": 1 << 25, "repeat": 5, "lm": {"context": 512, "width": 768, "layers": 12, "heads": 12},
             "batch": 8, "warmup": 5, "steps": 30, "passes": 3, "budget_s": 15.0, "race_steps": None},
    "cpu": {"numel": 1 << 16, "repeat": 2, "lm": {"context": 32, "width": 64, "layers": 2, "heads": 2},
            "batch": 2, "warmup": 2, "steps": 2, "passes": 2, "budget_s": None, "race_steps": 4},
}
RACE = {"workload": "stdlib-lm", "workers": 4, "networks": ["cluster"], "cells": ["bsp", "diloco", "dpsgd", "ddp"]}

# (row, how, settings): "plain", "ddp" (+ a hook: "torch:NAME" PyTorch's, else thinwire's ddp_hook settings),
# "trainer" (tw.Trainer settings)
OVERHEAD = [
    ("plain", "plain", {}),
    ("ddp", "ddp", {}),
    ("ddp + torch fp16_compress_hook", "ddp", {"hook": "torch:fp16"}),
    ('ddp + tw.ddp_hook("none")', "ddp", {"hook": {"compressor": "none"}}),
    ('ddp + tw.ddp_hook("fp16")', "ddp", {"hook": {"compressor": "fp16"}}),
    ('  same, check_finite=False', "ddp", {"hook": {"compressor": "fp16", "check_finite": False}}),
    ("ddp + tw.ddp_hook int8", "ddp", {"hook": {"compressor": "int8"}}),
    ("ddp + tw.ddp_hook topk 1%", "ddp", {"hook": {"compressor": "topk", "memory": "residual", "ratio": 0.01}}),
    ("ddp + torch powerSGD_hook rank 4", "ddp", {"hook": "torch:powersgd"}),
    ("ddp + tw.ddp_hook powersgd rank 4", "ddp", {"hook": {"compressor": "powersgd", "memory": "powersgd",
                                                            "rank": 4}}),
    ("tw bsp", "trainer", {"algorithm": "bsp"}),
    ("tw bsp + topk 1%", "trainer", {"algorithm": "bsp", "compressor": "topk", "memory": "residual",
                                     "ratio": 0.01}),
    ("tw local (sends nothing)", "trainer", {"algorithm": "local"}),
    ("tw localsgd H=1000 (local steps)", "trainer", {"algorithm": "localsgd", "period": 1000}),
    ("tw diloco H=1000 (local steps)", "trainer", {"algorithm": "diloco", "period": 1000}),
    # DTS compensates SGD only: its row and its baseline train with SGD (momentum 0.9)
    ("plain (SGD)", "plain", {"sgd": True}),
    ("tw dts (sparse steps, SGD)", "trainer", {"algorithm": "dts", "delay": 2, "period": 1000, "sgd": True}),
]
LOCAL_TARGET, BSP_TARGET = 1.03, 1.0       # x plain for a step that sends nothing; bsp x DDP


# -- step overhead on a GPT-like model ---------------------------------------------------------------------
def _hook(net, hook) -> None:
    """Register a comm hook on the DDP model `net`: "torch:fp16" / "torch:powersgd" (PyTorch's), else thinwire's
    `ddp_hook(**hook)`."""
    if hook == "torch:fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "torch:powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        net.register_comm_hook(*ddp_hook(**hook))


def _one_case(how: str, settings: dict, device, sizes: dict) -> float:
    """The median step (ms, CUDA-synchronised) of one configuration, built, warmed up, timed and released."""
    torch.manual_seed(0)
    with torch.device(device):
        model = ByteLM(**sizes["lm"])
    settings = dict(settings)
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if settings.pop("sgd", False) else
           torch.optim.AdamW(model.parameters(), lr=1e-4))
    net, trainer = model, None
    if how == "ddp":
        net = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        if "hook" in settings:
            _hook(net, settings["hook"])
    elif how == "trainer":
        trainer = Trainer(model, opt, **settings)
    g = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["lm"]["context"])
    x = torch.randint(0, 256, shape, generator=g, device="cpu").to(device)
    y = torch.randint(0, 256, shape, generator=g, device="cpu").to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = net(x)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        (trainer.step if trainer is not None else opt.step)()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(sizes["warmup"]):
            step()
        return median_s(lambda: (step(), sync()), sizes["steps"], before=sync) * 1e3
    finally:
        if trainer is not None:
            trainer.close()


def overhead_part(device_name: str, sizes: dict) -> tuple[list[dict], str]:
    """Every OVERHEAD row (one rank: NCCL on a GPU, gloo on the CPU): (rows, table)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    threads = torch.get_num_threads()
    if device.type == "cpu":    # the dry run's tiny steps: threads only wait on each other (and on a loaded machine)
        torch.set_num_threads(1)
    rows = [{"case": name, "passes": []} for name, _, _ in OVERHEAD]
    try:
        for _ in range(sizes["passes"]):     # every row once per pass: a slow spell of the machine hits all rows
            for row, (_, how, settings) in zip(rows, OVERHEAD):
                if "error" in row:
                    continue
                try:
                    row["passes"].append(_one_case(how, settings, device, sizes))
                except Exception as e:      # one broken row must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for row in rows:
            if "error" not in row:
                row["ms"] = statistics.median(row["passes"])
    finally:
        torch.set_num_threads(threads)
        if mine:
            dist.destroy_process_group()
    ms = {r["case"]: r.get("ms") for r in rows}
    for r, (_, _, settings) in zip(rows, OVERHEAD):
        plain = ms.get("plain (SGD)" if settings.get("sgd") else "plain")
        if "ms" in r and plain:
            r["x_plain"] = r["ms"] / plain
        if "ms" in r and ms.get("ddp") and not r["case"].startswith("plain") and not settings.get("sgd"):
            r["x_ddp"] = r["ms"] / ms["ddp"]
        if "(local steps)" in r["case"] or "sends nothing" in r["case"] or "sparse steps" in r["case"]:
            r["target"] = f"<= {LOCAL_TARGET}x plain"
            r["over"] = r.get("x_plain", 0) > LOCAL_TARGET
        elif r["case"] == "tw bsp":
            r["target"] = f"<= {BSP_TARGET}x DDP"
            r["over"] = r.get("x_ddp", 0) > BSP_TARGET
    lm = sizes["lm"]
    params = 12 * lm["layers"] * lm["width"] ** 2 + (256 + lm["context"] + 256) * lm["width"]
    lines = [f"the median over {sizes['passes']} passes of each pass's median step ({sizes['steps']} steps after "
             f"{sizes['warmup']} warm-up; the passes' spread in the last column), ByteLM context {lm['context']} "
             f"width {lm['width']} x {lm['layers']} layers (~{params / 1e6:.1f} M parameters), batch "
             f"{sizes['batch']}, bf16 autocast, AdamW (SGD where named), one rank on "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}",
             f"{'case':38s}{'ms':>9s}{'x plain':>9s}{'x DDP':>8s}  {'target':22s}passes (ms)"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:38s} error: {r['error']}")
            continue
        x_ddp = f"{r['x_ddp']:8.3f}" if "x_ddp" in r else " " * 8
        mark = (r["target"] + ("  OVER" if r["over"] else "")) if "target" in r else ""
        spread = f"{min(r['passes']):.2f}-{max(r['passes']):.2f}"
        lines.append(f"{r['case']:38s}{r['ms']:9.2f}{r.get('x_plain', float('nan')):9.3f}{x_ddp}  {mark:22s}{spread}")
    return rows, "\n".join(lines)


# -- a race of 4 workers sharing the GPU -----------------------------------------------------------------
def race_part(device: str, sizes: dict, out: str) -> tuple[dict, str]:
    """A short `thinwire compare` of RACE on `device` (4 workers on one GPU: gloo): (results, its table)."""
    cfg = CompareConfig(**RACE, budget_s=sizes["budget_s"], steps=sizes["race_steps"], device=device,
                        eval_every=2 if sizes["race_steps"] else None)
    results = compare(cfg.validate(), out, progress=False)
    entries = results.get("summary") or []
    lines = [f"{RACE['workers']} workers sharing {'one GPU over gloo' if device == 'cuda' else 'the CPU'}, "
             f"{RACE['workload']} on {', '.join(RACE['networks'])}, "
             + (f"budget {sizes['budget_s']:g} s of training per cell" if sizes["budget_s"] else
                f"{sizes['race_steps']} steps per cell") + f"; report: {out}/report.md"]
    lines += table(entries, 1) if entries else ["(no cell ran)"]
    lines += [f"{r['label']}: {r.get('status')}: {r.get('error', '')}" for r in results["cells"]
              if r.get("status") != "ok"]
    return results, "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------------------
def run(args) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise UserError(f"--parts: unknown part {bad[0] if bad else ''!r}; valid: {', '.join(PARTS)}")
    if args.device not in SIZES:
        raise UserError(f"--device must be one of cuda, cpu; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("thinwire bench gpu: torch sees no CUDA device here (torch.cuda.is_available() is False; "
                        f"torch {torch.__version__}); --device cpu dry-runs the same code at tiny sizes")
    sizes = dict(SIZES[args.device])
    if args.budget is not None:
        if not args.budget > 0:
            raise UserError(f"--budget must be > 0 seconds, got {args.budget}")
        sizes["budget_s"], sizes["race_steps"] = args.budget, None
    if args.numel is not None:
        if args.numel < 1:
            raise UserError(f"--numel must be >= 1, got {args.numel}")
        sizes["numel"] = args.numel
    out = args.out or os.path.join("results", "bench-gpu")
    check_writable_dir(out, "--out")
    os.makedirs(out, exist_ok=True)
    report, summary = {"device": args.device, "parts": {}}, []
    for part in parts:
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        try:
            if part == "compressors":       # `thinwire bench compressors --device DEVICE` at the part's size
                result = cbench.bench(sizes["numel"], compressors.names(), sizes["repeat"], device=args.device)
                text = cbench.table(result)
            elif part == "overhead":
                result, text = overhead_part(args.device, sizes)
            else:
                result, text = race_part(args.device, sizes, os.path.join(out, "race"))
            ok = True
        except UserError:
            raise
        except Exception as e:      # one broken part must not lose the others
            result, text, ok = {"error": f"{type(e).__name__}: {e}"}, f"error: {type(e).__name__}: {e}", False
        seconds = time.perf_counter() - t0
        print(text, flush=True)
        report["parts"][part] = {"seconds": seconds, "result": result}
        summary.append(f"{part}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s")
        with open(os.path.join(out, "bench_gpu.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("== " + "; ".join(summary) + f"; written to {out}/bench_gpu.json", flush=True)
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
    return 0 if all(s.split(": ", 1)[1].startswith("ok") for s in summary) else 1


def register(sub) -> None:
    p = sub.add_parser("gpu", help="on one GPU: compressors vs a device memcpy, step overhead on a GPT-like model, "
                                   "a 4-worker race sharing the GPU (--device cpu: a dry run at tiny sizes)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run: tiny sizes)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--out", help="directory for bench_gpu.json and the race's results (default results/bench-gpu)")
    p.add_argument("--numel", type=int, help="compressor input size (default 2^25 on cuda, 2^16 on cpu)")
    p.add_argument("--budget", type=float, help="the race's training seconds per cell (default 15 on cuda; "
                                                 "the cpu dry run races 4 steps instead)")
    p.add_argument("--json", action="store_true", help="print everything as JSON at the end")
    p.set_defaults(func=run)
