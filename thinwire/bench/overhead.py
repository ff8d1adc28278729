"""`thinwire bench overhead`: what a thinwire step costs the host beside a plain PyTorch step.

    thinwire bench overhead                   # CPU, 75 Linear(16, 16) side by side (150 parameters), SGD
    thinwire bench overhead --device cuda     # the same on the GPU (CUDA-synchronised steps)

One process (world size 1), one model of many small parameters, so that per-parameter Python shows: each row is
the median host time of a whole training iteration (forward, backward, the step, zero_grad) over `--steps`
iterations, against plain PyTorch's (`optimizer.step()`) measured in the same run, the rows interleaved in
rounds so that a machine's drift reaches them all alike. The algorithms' rows are their steps that send nothing
(local SGD and DiLoCo with H = 1000, DTS's sparse steps with p = 1000, `local`), through `tw.Trainer` and, for
DiLoCo, through `tw.attach` (the loop calls `optimizer.step()`). `bsp` (which sends every step) is compared with
DistributedDataParallel's own all-reduce and with DDP + `tw.ddp_hook("none")`; CD-SGD sends every step too
(at world size 1 each exchange is a real one-rank collective). Targets (BENCHMARKS.md, "Step overhead"): a local
step at most 0.75 ms over plain on the CPU, at most 1.03x plain on a GPU; bsp at most 1.0x DDP.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import UserError
from ..exchange.ddp import ddp_hook
from ..files import emit
from ..trainer import Trainer, attach

LOCAL = [("local", "local", {}), ("localsgd", "localsgd", {"period": 1000}),
         ("diloco", "diloco", {"period": 1000}), ("dts (sparse steps)", "dts", {"delay": 2, "period": 1000})]
SENDING = [("bsp", "bsp", {}), ("cdsgd (sends every step)", "cdsgd", {"warmup": 0})]


def _model(n: int, width: int, device):
    """A model of many small parameters and plain SGD over them."""
    class SideBySide(torch.nn.Module):
        """`n` Linear(width, width) layers side by side: 2n small parameters."""

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

        def forward(self, x):
            out = self.layers[0](x)
            for layer in self.layers[1:]:
                out = out + layer(x)
            return out

    torch.manual_seed(0)
    model = SideBySide().to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _cases(args, device):
    """name -> (model, optimizer, step(), close()): every row, built before any is timed."""
    cases = {}

    def plain_case(wrap=None, hook=None):
        model, opt = _model(args.layers, args.width, device)
        net = model
        if wrap:
            net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            if hook:
                net.register_comm_hook(*ddp_hook(hook))
        return net, opt, opt.step, lambda: None

    cases["plain"] = plain_case()
    for name, algorithm, params in LOCAL + SENDING:
        model, opt = _model(args.layers, args.width, device)
        trainer = Trainer(model, opt, algorithm=algorithm, **params)
        cases[name] = (model, opt, trainer.step, trainer.close)
    model, opt = _model(args.layers, args.width, device)
    handle = attach(model, opt, algorithm="diloco", period=1000)
    cases["diloco (tw.attach)"] = (model, opt, opt.step, handle.close)
    if not args.no_ddp:
        cases["ddp"] = plain_case(wrap=True)
        cases['ddp + tw.ddp_hook("none")'] = plain_case(wrap=True, hook="none")
    return cases


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device here; valid: cpu")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        cases = _cases(args, device)
        x = torch.randn(args.batch, args.width, device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        times: dict[str, list[float]] = {name: [] for name in cases}
        rounds = max(1, args.steps // args.round)
        for r in range(rounds + 1):                  # round 0 warms every case up, untimed
            for name, (model, opt, step, _close) in cases.items():
                for _ in range(args.round):
                    sync()
                    t0 = clock()
                    model(x).square().mean().backward()
                    step()
                    opt.zero_grad()
                    sync()
                    if r:
                        times[name].append(clock() - t0)
        for _model_, _opt, _step, close in cases.values():
            close()
    finally:
        if mine:
            dist.destroy_process_group()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for name, t in med.items():
        row = {"case": name, "ms": 1e3 * t, "x_plain": t / med["plain"], "delta_ms": 1e3 * (t - med["plain"]),
               "steps": len(times[name])}
        if name == "bsp" and "ddp" in med:
            row["x_ddp"] = t / med["ddp"]
        rows.append(row)
    return rows


def run(args) -> int:
    if args.steps < 1 or args.round < 1 or args.layers < 1 or args.width < 1 or args.batch < 1:
        raise UserError("--steps, --round, --layers, --width and --batch must be >= 1")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UserError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.clock == "cpu" and args.device != "cpu":
        raise UserError("--clock cpu measures this thread's CPU time: CPU only (a GPU step is timed on the wall)")
    rows = measure(args)
    if not args.json:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"host time per iteration, median of {rows[0]['steps']}, {2 * args.layers} parameters "
              f"({args.layers} Linear({args.width}, {args.width})), SGD, device {args.device}, clock {args.clock}, "
              f"load average {load}")
        print(f"{'case':28s} {'ms/step':>9s} {'x plain':>8s} {'+ms':>8s}")
        for r in rows:
            extra = f"   {r['x_ddp']:.3f}x DDP" if "x_ddp" in r else ""
            print(f"{r['case']:28s} {r['ms']:9.3f} {r['x_plain']:8.3f} {r['delta_ms']:+8.3f}{extra}")
    emit(rows, args.out, args.json)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("overhead", help="host time of a step: plain optimizer.step() vs Trainer.step() "
                                               "per algorithm's local steps, DDP, bsp")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--steps", type=int, default=300, help="timed iterations per case (default 300)")
    p.add_argument("--round", type=int, default=10, help="iterations of one case before the next (default 10)")
    p.add_argument("--layers", type=int, default=75, help="Linear layers side by side (2 parameters each)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="wall (default) or this thread's CPU time (steadier on a loaded CPU machine)")
    p.add_argument("--no-ddp", action="store_true", help="leave out the DDP rows")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
