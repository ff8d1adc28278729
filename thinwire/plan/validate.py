"""Predicted against measured: run short trainings and compare their step times with the cost model's.

τ (compute per step) is measured by the same workers running with no communication (`local`); the loopback's
own cost of each collective is added to the emulated link's (the emulator delivers an operation its link cost
after the real operation completes), with α and β of the loopback fitted on the spot.
"""
from __future__ import annotations

import statistics

from ..net import parse_network
from .costmodel import Scenario, predict

CONFIGS = {  # name -> (algorithm, parameters) as run by `thinwire train`
    "bsp": ("bsp", {}),
    "bitsgd": ("bitsgd", {}),
    "cdsgd": ("cdsgd", {"k": 5}),
    "localsgd": ("localsgd", {"period": 4}),
    "dts": ("dts", {"delay": 4, "period": 4}),
}


def _measure(pool, workload: str, algorithm: str, params: dict, network: str, steps: int, workers: int) -> float:
    from ..run.train import TrainConfig, train_worker
    cfg = TrainConfig(workload=workload, algorithm=algorithm, workers=workers, network=network, steps=steps,
                      params=dict(params), progress=False, eval_every=10 ** 6)
    results = pool.run(train_worker, cfg, network=network)
    skip = max(2, steps // 5)   # warm-up steps (connections, first buckets, profiling) are not steady state
    per_step = [max(r["steps"][i]["step_s"] for r in results) for i in range(skip, steps)]
    return statistics.mean(per_step)


def compare(pool, workload: str = "wide-mlp", networks=("cluster", "wan"), names=tuple(CONFIGS),
            steps: int = 24, workers: int = 4) -> list[dict]:
    """Rows of {network, config, measured_s, predicted_s, error} for each network × configuration."""
    from ..run import workloads
    wl = workloads.get(workload)
    n_params = wl.num_params()
    tau = _measure(pool, workload, "local", {}, "lan", steps, workers)
    lan_bsp = _measure(pool, workload, "bsp", {}, "lan", steps, workers)
    # the loopback all-reduce of this model, fitted as a link whose α-β cost equals what we measured
    loop_s = max(0.0, lan_bsp - tau)
    rows = []
    for net in networks:
        link = parse_network(net)
        for name in names:
            algorithm, params = CONFIGS[name]
            measured = _measure(pool, workload, algorithm, params, net, steps, workers)
            s = Scenario(params=n_params, compute_s=tau, link=link, workers=workers, handshake=True)
            pred = predict(s, algorithm, **params).iteration_s
            # plus the loopback's own share of the algorithm's communication (the emulator delivers an op its
            # link cost after the real op completed), scaled like the algorithm's exposed communication
            share = predict(s, "bsp").iteration_s
            frac = (pred - tau) / (share - tau) if share > tau else 1.0
            pred += loop_s * max(0.0, min(1.0, frac))
            rows.append({"network": net, "config": name, "measured_s": measured, "predicted_s": pred,
                         "error": (pred - measured) / measured, "compute_s": tau})
    return rows
