"""Adding a compressor touches one file: a toy compressor defined, declared and registered in this test module is
predicted by the planner from its declarations and raced by `thinwire compare`'s code path on 2 real workers
(registered in them by a task of the pool, which imports this module there), then unregistered."""
from __future__ import annotations

import pytest

from thinwire.compress import Compressor, Payload, compressors
from thinwire.errors import UserError
from thinwire.exchange.choose import wire_bits
from thinwire.net import parse_network
from thinwire.plan.costmodel import MEMCPY_BYTES_PER_S, Scenario, predict

TOY = "toy-scaled"


class ScaledCopy(Compressor):
    """A toy: the tensor times a power of two (exact in floating point), summed by all-reduce, divided back."""

    unbiased = True
    linear = True
    randomness = "none"
    aggregation = "allreduce"
    fixed_size = True
    is_sparse = False
    x_memcpy = 2.0            # one multiply each way

    def __init__(self, scale: float = 2.0):
        self.scale = float(scale)

    def compress(self, tensor, key=None, step=0, agreed=None):
        return Payload([tensor.reshape(-1) * self.scale], ctx=self.context(tensor.shape, tensor.dtype))

    def decompress(self, payload):
        shape, dtype, _ = payload.ctx
        return (payload.tensors[0] / self.scale).to(dtype).view(shape)


def register(rank=None, world_size=None) -> None:
    """Register the toy (here, and as a pool task in each worker)."""
    if TOY not in compressors:
        compressors.register(TOY)(ScaledCopy)


def unregister(rank=None, world_size=None) -> None:
    compressors.unregister(TOY)


@pytest.fixture
def toy():
    register()
    try:
        yield TOY
    finally:
        unregister()


def test_the_planner_predicts_a_toy_compressor_from_its_declarations(toy):
    s = Scenario(params=1e6, compute_s=0.1, link=parse_network("wan"), workers=4)
    got, plain = predict(s, "bsp", toy), predict(s, "bsp", "none")
    assert wire_bits(compressors.get(toy), 10**6, 4) == ("allreduce", 32.0)   # summed, 32 bits: as fp32 itself
    assert (got.bytes_per_step, got.collective) == (plain.bytes_per_step, plain.collective)
    # τ + δ + C: δ from the declared x_memcpy (no calibration measured the toy)
    assert s.compress_s(toy) == pytest.approx(2.0 * s.params * 4 / MEMCPY_BYTES_PER_S)
    assert got.iteration_s == pytest.approx(plain.iteration_s + s.compress_s(toy))
    assert compressors.get(toy, scale=4.0).scale == 4.0


def test_a_toy_compressor_races_through_compare(toy, pool2, tmp_path):
    from thinwire.compare import matrix as cmp
    pool2.run(register)                 # each worker imports this module and registers the toy
    try:
        cfg = cmp.CompareConfig(workload="linreg", workers=2, networks=["lan"], cells=["bsp", f"bsp+{toy}"],
                                steps=10, budget_s=5.0)
        res = cmp.compare(cfg, str(tmp_path), progress=False, pool=pool2)
    finally:
        pool2.run(unregister)
    by = {r["label"]: r for r in res["cells"]}
    bsp, mine = by["bsp"], by[f"bsp+{toy}"]
    assert mine["status"] == "ok", mine.get("error")
    # a scaled copy is synchronous SGD's exchange: bsp's steps and loss, and its bytes on the wire
    assert mine["steps"] == bsp["steps"] > 0
    assert mine["final_loss"] == pytest.approx(bsp["final_loss"], rel=1e-4)
    assert bsp["bytes_sent_per_worker_per_step"] > 0
    assert mine["bytes_sent_per_worker_per_step"] == pytest.approx(bsp["bytes_sent_per_worker_per_step"])
    assert res["predictions"]["lan"]["cells"][f"bsp+{toy}"]["step_s"] > 0   # predicted before the race
    assert f"bsp+{toy}" in open(tmp_path / "report.md").read()


def test_unregistered_the_toy_is_unknown_again():
    assert TOY not in compressors and TOY not in compressors.names()
    with pytest.raises(UserError, match=f"unknown compressor '{TOY}'"):
        compressors.get(TOY)
