"""Where a compressor's time goes on a GPU: for each compressor, compress and decompress of N fp32 elements
(default 2^25), timed three ways after a warm-up (which compiles the fused kernels):

- wall: CUDA-synchronised wall clock (what `thinwire bench compressors --device cuda` reports), median of 5;
- host: the time the call takes to return without a synchronisation (Python, dispatch, launches), median of 5;
- device: the kernels the call launched (count) and their summed device time, from torch.profiler.

A call is launch-bound where host >= device, memory-bound where device is near the bytes it must move. Usage,
from the checkout's root on a machine with a GPU:

    PYTHONPATH=. python tools/profile_compressors.py [--numel N] [--only a,b] [--kernels 4] [--host 4]

(`--kernels K` also prints each call's K longest kernels, `--host K` its K longest top-level host ops.) Without CUDA it runs on the CPU (device times from
the profiler's CPU ops instead), as a check that the script works.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, sync, repeat=5):
    walls, hosts = [], []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        hosts.append(t1 - t0)
        walls.append(t2 - t0)
        del out
    return statistics.median(walls) * 1e3, statistics.median(hosts) * 1e3


def _kernels(fn, cuda: bool):
    """(count, device ms, [(name, ms), ...] longest first, [(host op, ms), ...] longest first) of one call of fn:
    the kernels it launches, and the host's top-level ops (their time includes what they wait for)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    del out
    host = [(e.name, e.cpu_time_total / 1e3) for e in prof.events()
            if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU]
    if cuda:
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        times = [(e.name, e.device_time_total / 1e3) for e in evs]
    else:
        times = host
    by_name: dict = {}
    for name, ms in host:
        by_name[name] = by_name.get(name, 0.0) + ms
    return (len(times), sum(t for _, t in times), sorted(times, key=lambda t: -t[1]),
            sorted(by_name.items(), key=lambda t: -t[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 25)
    ap.add_argument("--only", default="", help="comma-separated compressors (default: every one)")
    ap.add_argument("--kernels", type=int, default=0, help="also print each call's K longest kernels")
    ap.add_argument("--host", type=int, default=0, help="also print each call's K longest host ops (by name)")
    args = ap.parse_args()
    import thinwire as tw
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn((args.numel // 1024, 1024) if args.numel % 1024 == 0 else (args.numel,),
                    generator=torch.Generator().manual_seed(0)).to(dev)
    dst = torch.empty_like(x)
    memcpy, _ = _median_ms(lambda: dst.copy_(x), sync)
    del dst
    names = [n for n in args.only.split(",") if n] or tw.compressors.names()
    print(f"numel {args.numel} on {torch.cuda.get_device_name() if cuda else 'cpu'}, memcpy {memcpy:.3f} ms; "
          f"per call: wall / host ms, kernels launched, their device ms")
    print(f"{'compressor':14s}{'x memcpy':>9s} | {'compress: wall':>15s}{'host':>7s}{'kern':>6s}{'dev':>7s} | "
          f"{'decompress: wall':>17s}{'host':>7s}{'kern':>6s}{'dev':>7s}")
    for name in names:
        try:
            comp = tw.compressors.get(name)
            for step in range(3):
                p = comp.compress(x, key="prof", step=step)
                comp.decompress(p)
            sync()
            cw, ch = _median_ms(lambda: comp.compress(x, key="prof", step=7), sync)
            p = comp.compress(x, key="prof", step=7)
            dw, dh = _median_ms(lambda: comp.decompress(p), sync)
            ck, cd, ctop, chost = _kernels(lambda: comp.compress(x, key="prof", step=8), cuda)
            dk, dd, dtop, dhost = _kernels(lambda: comp.decompress(p), cuda)
            print(f"{name:14s}{(cw + dw) / memcpy:9.2f} | {cw:15.3f}{ch:7.3f}{ck:6d}{cd:7.3f} | "
                  f"{dw:17.3f}{dh:7.3f}{dk:6d}{dd:7.3f}", flush=True)
            for label, top, host in (("compress", ctop, chost), ("decompress", dtop, dhost)):
                for kname, ms in top[:args.kernels]:
                    print(f"    {label:10s} {ms:7.3f}  {kname[:110]}")
                for hname, ms in host[:args.host]:
                    print(f"    {label:10s} {ms:7.3f}  host: {hname[:104]}")
        except Exception as exc:   # noqa: BLE001 - report and go on
            print(f"{name:14s} error: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
