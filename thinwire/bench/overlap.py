"""`thinwire bench overlap`: what scheduling buys, and the "no tax" check against PyTorch DDP.

For each world size and network it trains, in ONE launch, alternating round by round, copies of the same model
under: no communication (compute only), PyTorch DDP (default buckets), the same DDP model with thinwire's
identity comm hook (`ddp+hook`: `register_comm_hook(*tw.ddp_hook("none"))`), the same DDP with the least a Python
hook can do (`ddp+pyhook`: divide, `dist.all_reduce(..., async_op=True)` and a `then` that returns the tensor,
the floor of any hook written in Python, where DDP's default hook is C++), thinwire `bsp` with schedule `none`
(exchange after backward), `wfbp` (one exchange per parameter, FIFO), `fusion` (WFBP + 25 MB buckets, the
default), `mgwfbp`, `priority`, and `fp16` compression without and with the compress/communicate pipeline.
It reports the median step time and the exposed (waited-for) communication per step of each, and on `lan`
`no_tax_ratio` = thinwire `fusion` step time / DDP step time, `hook_ratio` = `ddp+hook` / DDP and `pyhook_ratio`
= `ddp+pyhook` / DDP (medians over all alternating rounds): what a DDP user pays for adopting thinwire in one line,
beside what any Python hook costs.

DDP does not go through thinwire's Transport, so under an emulated profile it would run at loopback speed:
DDP is measured on `lan` only. Its exposed communication is estimated as its step time minus the
compute-only step time. On `lan` the model is the MLP 784-2048-2048-10 (batch 32); under an
emulated profile a smaller MLP 784-512-512-10 keeps a run short (23 MB per step at 100 Mbit/s is ~3 s).

    thinwire bench overlap --workers 2,4 --network lan,wan --json
    thinwire bench overlap --render-trace run/trace.json --png docs/benchmarks/trace.png
"""
from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import UserError
from ..exchange.ddp import ddp_hook
from ..files import pyplot, save
from ..launcher import Pool
from ..net import parse_network, ring_allreduce
from ..trace import ORDER
from ..trainer import Trainer

_now = time.perf_counter

VARIANTS = {                       # name -> (trainer params, compressor)
    "none": ({"schedule": "none"}, None),
    "wfbp": ({"schedule": "wfbp"}, None),
    "fusion": ({"schedule": "fusion"}, None),
    "mgwfbp": ({"schedule": "mgwfbp"}, None),
    "priority": ({"schedule": "priority"}, None),
    "fp16": ({"schedule": "fusion", "pipeline": False}, "fp16"),
    "fp16+pipeline": ({"schedule": "fusion", "pipeline": True}, "fp16"),
}
RATIOS = {"no_tax_ratio": "fusion", "hook_ratio": "ddp+hook", "pyhook_ratio": "ddp+pyhook"}   # key -> variant (/ ddp)


def _model(widths):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _python_allreduce_hook(state, bucket):
    """The least a Python DDP comm hook does: as DDP's C++ default, divide the bucket by the world size and
    all-reduce it; the `then` that hands DDP the tensor is what any Python hook adds."""
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def bench_worker(rank, world_size, widths, names, steps, rounds, warmup, batch):
    """Every variant keeps its own model, optimizer and trainer; rounds alternate between them."""
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(batch, widths[0], generator=g), torch.randint(0, widths[-1], (batch,), generator=g))
            for _ in range(4)]
    runs = {}
    for name in names:
        model = _model(widths)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name.startswith("ddp"):
            model = DDP(model)
            if name == "ddp+hook":
                model.register_comm_hook(*ddp_hook("none"))
            elif name == "ddp+pyhook":
                model.register_comm_hook(None, _python_allreduce_hook)
        params, comp = VARIANTS.get(name, ({}, None))
        tr = Trainer(model, opt, compressor=comp, **params) if name in VARIANTS else None  # compute only, or DDP
        runs[name] = (model, opt, tr)
    times = {n: [] for n in names}
    waits = {n: [] for n in names}

    def one(name, record):
        model, opt, tr = runs[name]
        x, y = data[len(times[name]) % len(data)]
        w0 = tr.transport.meter.wait_s if tr else 0.0
        t0 = _now()
        F.cross_entropy(model(x), y).backward()
        (opt.step if tr is None else tr.step)()
        opt.zero_grad(set_to_none=False)
        dt = _now() - t0
        if record:
            times[name].append(dt)
            waits[name].append((tr.transport.meter.wait_s - w0) if tr else 0.0)

    def settle(name, record):
        """Priority defers its update to the next forward: finish it before another variant uses the wire. The
        last step's deferred update belongs to it: `record` charges the flush to that step."""
        tr = runs[name][2]
        if tr is None or not tr.algorithm.scheduler.defers_update:
            return
        w0, t0 = tr.transport.meter.wait_s, _now()
        tr.algorithm.scheduler.flush()
        if record:
            times[name][-1] += _now() - t0
            waits[name][-1] += tr.transport.meter.wait_s - w0

    for name in names:
        for _ in range(warmup):
            one(name, False)
        settle(name, False)
    for _ in range(rounds):
        for name in names:
            for _ in range(steps):
                one(name, True)
            settle(name, True)
    for _, _, tr in runs.values():
        if tr is not None:
            tr.close()
    return {"times": times, "waits": waits}


def measure(workers: int, network: str, rounds: int, steps: int, warmup: int) -> dict:
    link = parse_network(network)
    widths = (784, 512, 512, 10) if link.emulated else (784, 2048, 2048, 10)
    names = (["compute", "ddp", "ddp+hook", "ddp+pyhook"] if not link.emulated else ["compute"]) + list(VARIANTS)
    with Pool(workers) as pool:
        res = pool.run(bench_worker, widths, names, steps, rounds, warmup, 32, network=network)
    n_params = sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    # a step ends when the slowest worker's does: per step, the max over ranks
    per_step = {name: [max(ts) for ts in zip(*(r["times"][name] for r in res))] for name in names}
    rows = {}
    for name in names:
        wait = [statistics.fmean(ws) for ws in zip(*(r["waits"][name] for r in res))]
        rows[name] = {"step_ms": 1e3 * statistics.median(per_step[name]), "exposed_ms": 1e3 * statistics.median(wait)}
        if name.startswith("ddp"):   # not through the Transport: its step time minus the compute-only one
            rows[name].update(exposed_ms=max(0.0, rows[name]["step_ms"] - rows["compute"]["step_ms"]),
                              exposed_estimated=True)
    out = {"workers": workers, "network": network, "model": "MLP " + "-".join(map(str, widths)),
           "params": n_params, "rounds": rounds, "steps_per_round": steps, "variants": rows}
    if "ddp" in rows:
        for key, name in RATIOS.items():
            out[key] = rows[name]["step_ms"] / rows["ddp"]["step_ms"]
        median = lambda name, k: statistics.median(per_step[name][k * steps:(k + 1) * steps])   # of round k
        for key, name in (("no_tax_ratio_per_round", "fusion"), ("hook_ratio_per_round", "ddp+hook")):
            out[key] = [median(name, k) / median("ddp", k) for k in range(rounds)]
    if link.emulated:   # the α-β prediction for one all-reduce per step vs one per parameter
        one = ring_allreduce(link, workers, n_params * 4).time
        per_layer = sum(ring_allreduce(link, workers, s * 4).time
                        for a, b in zip(widths[:-1], widths[1:]) for s in (a * b, b))
        out["predicted_comm_ms"] = {"one_bucket": 1e3 * one, "per_parameter_fifo": 1e3 * per_layer}
    return out


def render_trace(path: str, png: str, start_s: float | None = None, span_s: float | None = None) -> None:
    """One row per worker and track of a Chrome trace, drawn with matplotlib."""
    plt = pyplot()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    t_lo = min(e["ts"] for e in spans) / 1e6 + (start_s or 0.0)
    t_hi = t_lo + span_s if span_s else max(e["ts"] + e["dur"] for e in spans) / 1e6
    track = lambda k: names.get(k, "").split(" ")[0]
    rows = sorted({(e["pid"], e["tid"]) for e in spans},
                  key=lambda k: (k[0], ORDER.index(track(k)) if track(k) in ORDER else 99, k[1]))
    colors = {"forward": "tab:blue", "backward": "tab:cyan", "compute": "tab:gray", "compress": "tab:purple",
              "communicate": "tab:orange", "emulated": "tab:red", "wait": "black", "optimizer": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.2))
    for y, key in enumerate(rows):
        for e in spans:
            if (e["pid"], e["tid"]) != key:
                continue
            s, d = e["ts"] / 1e6, e["dur"] / 1e6
            if s + d < t_lo or s > t_hi:
                continue
            ax.barh(y, d * 1e3, left=(s - t_lo) * 1e3, height=0.8, color=colors.get(e.get("cat"), "tab:gray"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"worker {p}: {names.get((p, t), t)}" for p, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, (t_hi - t_lo) * 1e3)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"thinwire trace: {path.split('/')[-2] if '/' in path else path}")
    save(fig, png, dpi=120)


def _fmt(r: dict) -> str:
    lines = [f"{r['workers']} workers, {r['network']}, {r['model']} ({r['params'] / 1e6:.2f} M params), "
             f"{r['rounds']} alternating rounds x {r['steps_per_round']} steps",
             f"  {'variant':<15} {'step ms':>9} {'exposed comm ms':>16}"]
    for name, v in r["variants"].items():
        est = " (step - compute)" if v.get("exposed_estimated") else ""
        lines.append(f"  {name:<15} {v['step_ms']:>9.1f} {v['exposed_ms']:>16.1f}{est}")
    if "no_tax_ratio" in r:
        lines.append("  " + "   ".join(f"{key} ({name} / ddp) = {r[key]:.3f}" for key, name in RATIOS.items()))
    if "predicted_comm_ms" in r:
        p = r["predicted_comm_ms"]
        lines.append(f"  α-β prediction: one bucket {p['one_bucket']:.0f} ms, per-parameter FIFO "
                     f"{p['per_parameter_fifo']:.0f} ms of communication per step")
    return "\n".join(lines)


def run(args) -> int:
    if args.render_trace:
        if not args.png:
            raise UserError("--render-trace needs --png FILE")
        render_trace(args.render_trace, args.png, args.start_s, args.span_s)
        print(f"written {args.png}")
        return 0
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise UserError(f"--workers takes comma-separated integers, e.g. 2,4; got {args.workers!r}") from None
    links = [(n, parse_network(n)) for n in args.network.split(",")]   # every profile checked before any run
    results = []
    for w in workers:
        for n, link in links:
            r = measure(w, n, args.rounds, args.wan_steps if link.emulated else args.steps, args.warmup)
            results.append(r)
            if not args.json:
                print(_fmt(r), flush=True)
    if args.json:
        ratios = {key: {str(r["workers"]): r[key] for r in results if key in r} for key in RATIOS}
        print(json.dumps({"results": results, **ratios}, indent=2))
    return 0


def register(sub) -> None:
    p = sub.add_parser("overlap", help="step time of DDP vs thinwire schedules (wfbp, fusion, mgwfbp, priority)")
    p.add_argument("--workers", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--network", default="lan,wan", help="comma-separated profiles (default lan,wan)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round on lan (default 6)")
    p.add_argument("--wan-steps", type=int, default=2, help="timed steps per variant per round when emulated")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per variant first (default 4)")
    p.add_argument("--json", action="store_true", help="print the results (and no_tax_ratio) as JSON")
    p.add_argument("--render-trace", help="draw this Chrome trace file instead (needs --png)")
    p.add_argument("--png", help="output PNG for --render-trace")
    p.add_argument("--start-s", type=float, help="--render-trace: skip this many seconds from the start")
    p.add_argument("--span-s", type=float, help="--render-trace: draw this many seconds")
    p.set_defaults(func=run)
