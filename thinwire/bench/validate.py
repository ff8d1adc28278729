"""Predicted against measured: run short trainings and compare their step times with the cost model's.

What happens on the machine itself — compute, compression, the loopback's own cost of each operation — is
measured by running each configuration on `lan` (no emulated link); the cost model then predicts what the
emulated network adds (α-β cost of the collective with gloo's round trip per step, queueing, overlap and
delays as each algorithm's schedule allows), taking the `lan` step time as its compute τ and no separate
compression cost (it is inside τ).
"""
from __future__ import annotations

import statistics

from ..compress import compressors
from ..net import parse_network
from ..plan.costmodel import Scenario, predict

CONFIGS = {  # name -> (algorithm, parameters) as run by `thinwire train`
    "bsp": ("bsp", {}),
    "bitsgd": ("bitsgd", {}),
    "cdsgd": ("cdsgd", {"k": 5}),
    "localsgd": ("localsgd", {"period": 4}),
    "dts": ("dts", {"delay": 4, "period": 4}),
    "diloco": ("diloco", {"period": 4}),
    "streaming-diloco": ("diloco", {"period": 8, "fragments": 2, "overlap": 1}),
}
WARMUP = {"dts": 16}   # steps before steady state: the first averages are applied (t−1)·p steps after launch


def measure(pool, workload: str, algorithm: str, params: dict, network: str, steps: int, workers: int,
            skip: int | None = None) -> float:
    """Mean step time (the slowest worker's) after `skip` warm-up steps (default: the first fifth)."""
    from ..run.train import TrainConfig, train_worker
    cfg = TrainConfig(workload=workload, algorithm=algorithm, workers=workers, network=network, steps=steps,
                      params=dict(params), progress=False, eval_every=10 ** 6)
    results = pool.run(train_worker, cfg, network=network)
    skip = skip if skip is not None else max(2, steps // 5)   # connections, profiling: not steady state
    return statistics.mean(max(r["steps"][i]["step_s"] for r in results) for i in range(skip, steps))


def compare(pool, workload: str = "digits-mlp", networks=("cluster", "wan"), names=tuple(CONFIGS),
            steps: int = 48, workers: int = 4) -> list[dict]:
    """Rows of {network, config, measured_s, predicted_s, error, local_s} for each network × configuration."""
    from ..run import workloads
    n_params = workloads.get(workload).num_params()
    no_compression_cost = dict.fromkeys(compressors.names(), 0.0)   # measured inside the lan step time
    rows = []
    # millisecond steps are noisy on a shared 2-core machine: twice the steps on low-latency links (`lan`
    # included), and the local (lan) time measured before and after the networks' runs
    steps_on = lambda net: 2 * steps if parse_network(net).latency < 0.01 else steps
    for name in names:
        algorithm, params = CONFIGS[name]
        on = lambda net: measure(pool, workload, algorithm, params, net, steps_on(net), workers, WARMUP.get(name))
        before = on("lan")
        measured = {net: on(net) for net in networks}
        local = (before + on("lan")) / 2
        for net in networks:
            s = Scenario(params=n_params, compute_s=local, link=parse_network(net), workers=workers,
                         handshake=True, x_memcpy=no_compression_cost)
            predicted = predict(s, algorithm, **params).iteration_s    # (diloco's overlap: its τ_o steps)
            rows.append({"network": net, "config": name, "measured_s": measured[net], "predicted_s": predicted,
                         "error": (predicted - measured[net]) / measured[net], "local_s": local})
    return rows
