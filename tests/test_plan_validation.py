"""The cost model against measurement: predicted step times of bsp, bitsgd, cdsgd, localsgd, dts and the DiLoCo
family on 4 workers under `cluster` and `wan` are within 25% of the step times `thinwire train` measures."""
from __future__ import annotations

import pytest

from thinwire.run.validate import compare


@pytest.mark.slow
def test_predicted_step_times_within_25_percent(pool4):
    rows = compare(pool4, workload="digits-mlp", networks=("cluster", "wan"), steps=48)
    assert len(rows) == 10
    # millisecond steps on a shared 2-core machine are noisy: a configuration off by more than the bound is
    # measured again (all of its runs, up to twice) before it counts as a miss of the model
    for _ in range(2):
        again = sorted({r["config"] for r in rows if abs(r["error"]) > 0.25})
        if not again:
            break
        redo = {(r["network"], r["config"]): r for r in compare(pool4, workload="digits-mlp",
                                                                networks=("cluster", "wan"), names=again, steps=48)}
        rows = [redo.get((r["network"], r["config"]), r) for r in rows]
    bad = [r for r in rows if abs(r["error"]) > 0.25]
    assert not bad, [(r["network"], r["config"], round(r["measured_s"], 4), round(r["predicted_s"], 4)) for r in bad]


@pytest.mark.slow
def test_diloco_family_predicted_within_25_percent(pool4):
    """DiLoCo (H = 4) and Streaming DiLoCo (H = 8, F = 2, τ = 1): the cost model's amortised sync and its overlap
    of a fragment's sync with an inner step, against the measured mean step."""
    names = ("diloco", "streaming-diloco")
    rows = compare(pool4, workload="digits-mlp", networks=("cluster", "wan"), names=names, steps=48)
    assert len(rows) == 4
    for _ in range(2):      # as above: a noisy configuration is measured again before it counts as a miss
        again = tuple(sorted({r["config"] for r in rows if abs(r["error"]) > 0.25}))
        if not again:
            break
        redo = {(r["network"], r["config"]): r for r in compare(pool4, workload="digits-mlp",
                                                                networks=("cluster", "wan"), names=again, steps=48)}
        rows = [redo.get((r["network"], r["config"]), r) for r in rows]
    bad = [r for r in rows if abs(r["error"]) > 0.25]
    assert not bad, [(r["network"], r["config"], round(r["measured_s"], 4), round(r["predicted_s"], 4)) for r in bad]
