"""`thinwire list [--json]`: every registered workload, network profile, worker speed profile, algorithm,
compressor and memory."""
from __future__ import annotations

import json

from .. import algorithms, speeds
from ..compress import coders, compressors, memories
from ..net import PROFILES
from ..run import workloads


def catalog() -> dict:
    return {
        "workloads": workloads.registry.describe(),
        "networks": [{"name": k, "bandwidth_bps": bw, "latency_s": lat, "summary": doc}
                     for k, (bw, lat, doc) in PROFILES.items()]
                    + [{"name": "custom:bandwidth=...,latency=...,jitter=...,loss=...", "bandwidth_bps": None,
                        "latency_s": None, "summary": "any link, e.g. custom:bandwidth=200mbit,latency=25ms"}],
        "speeds": [{"name": k, "summary": doc} for k, doc in speeds.NAMES.items()]
                  + [{"name": "1,1,1,0.5", "summary": "a factor per worker, the fastest at 1"},
                     {"name": "A:B", "summary": "two speeds, half the workers each (e.g. 1:3)"},
                     {"name": "SPEC@SECONDS>SPEC", "summary": "a change when the training clock reaches SECONDS "
                                                            "(e.g. equal@30>one-half)"}],
        "algorithms": algorithms.registry.describe(),
        "compressors": compressors.describe(),
        "memories": memories.describe(),
        "coders": coders.describe(),   # composed by name: --compressor qsgd+elias
    }


def run(args) -> int:
    cat = catalog()
    if args.json:
        print(json.dumps(cat, indent=2, default=str))
        return 0
    for family, rows in cat.items():
        print(f"{family}:")
        for row in rows:
            ptxt = ", ".join(f"{k}={v!r}" for k, v in (row.get("parameters") or {}).items())
            print(f"  {row['name']:<22} {row['summary']}" + (f"  [{ptxt}]" if ptxt else ""))
        print()
    return 0


def register(sub) -> None:
    p = sub.add_parser("list", help="list registered workloads, networks, worker speeds, algorithms, compressors, "
                                    "memories")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
