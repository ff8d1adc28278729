"""Each compressor with its natural memory trains digits-mlp with 4 workers under bsp to within 1 percentage
point of the uncompressed accuracy target (the issue's "done when"). One pool for all the runs."""
from __future__ import annotations

import pytest

from thinwire.run import workloads
from thinwire.run.train import TrainConfig, run_training

EPOCHS = 16
# (compressor, natural memory, its parameters, optimizer momentum: None = the workload's 0.9). The workload's
# momentum moves into residual/dgc memories (EF-SGDM; DGC's momentum correction): the optimizer runs without it.
RUNS = [
    ("onebit", "residual", {}, None),             # 1-bit SGD + EF-SGDM (momentum after EF diverged at 0.9)
    ("qsgd", "none", {}, None),                    # unbiased: no memory needed
    ("terngrad", "none", {}, None),                # unbiased: no memory needed
    ("topk", "residual", {"ratio": 0.05}, None),
    ("dgc", "dgc", {"ratio": 0.01}, None),
    ("signsgd", "residual", {}, None),             # scaled signs (EF-SignSGD's ‖g‖₁/d), majority vote
    ("powersgd", "powersgd", {"rank": 2}, None),
]


@pytest.mark.slow
def test_compressors_train_digits_to_target(pool4):
    wl = workloads.get("digits-mlp")
    dense = run_training(TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, epochs=EPOCHS,
                                     progress=False), pool=pool4)
    assert dense["final_accuracy"] >= wl.target
    failures = []
    for name, memory, params, momentum in RUNS:
        cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, epochs=EPOCHS, compressor=name,
                          memory=memory, params=dict(params), momentum=momentum, progress=False)
        s = run_training(cfg, pool=pool4)
        if s["final_accuracy"] < wl.target - 0.01:
            failures.append((name, s["final_accuracy"]))
        # compression really happened: fewer bytes than the uncompressed run
        assert s["bytes_sent_per_worker"] < 0.5 * dense["bytes_sent_per_worker"], name
    assert not failures, f"below {wl.target - 0.01:.2f}: {failures}"


def test_countsketch_with_residual_trains(pool4):
    """Issue 17: countsketch + residual (its pairing) stopped with NonFiniteError near step 20 (the dense median
    estimate is not a contraction, so the residual grew). With heavy-hitter recovery (the exact values of the
    summed sketch's top-k, Sketched-SGD's second round) it trains: finite, well above chance (0.1), fewer bytes
    than dense. It learns slowly on this 9.7 k-parameter model (at the defaults of the time, ratio 0.1 and heavy
    0.01, a sketch could not tell the top 1 % apart: 0.24 after 66 steps with EF-SGDM; the defaults are now 0.3
    and 0.05, which reach the target in 330 steps, docs/matrix.md), so the bound is the defect's: finite, above
    chance (0.1), and about 11 of 32 bits per element on the wire."""
    runs = {}
    for comp in ("none", "countsketch"):
        cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, compressor=comp,
                          memory="residual" if comp != "none" else None, progress=False)
        runs[comp] = run_training(cfg, pool=pool4)
    s = runs["countsketch"]
    assert s["final_accuracy"] >= 0.2, s["final_accuracy"]
    assert s["bytes_sent_per_worker"] < 0.4 * runs["none"]["bytes_sent_per_worker"]
