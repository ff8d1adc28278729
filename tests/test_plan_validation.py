"""The cost model against measurement: predicted step times of bsp, bitsgd, cdsgd, localsgd and dts on 4
workers under `cluster` and `wan` are within 25% of the step times `thinwire train` measures."""
from __future__ import annotations

import pytest

from thinwire.plan.validate import compare


@pytest.mark.slow
def test_predicted_step_times_within_25_percent(pool4):
    rows = compare(pool4, workload="digits-mlp", networks=("cluster", "wan"), steps=48)
    assert len(rows) == 10
    bad = [r for r in rows if abs(r["error"]) > 0.25]
    assert not bad, [(r["network"], r["config"], round(r["measured_s"], 4), round(r["predicted_s"], 4)) for r in bad]
