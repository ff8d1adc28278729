"""Quantizers, bit packing, residual memories and the compressor benchmark (single process, pure logic)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.compress import Payload, compressors, memories
from thinwire.compress.bitpack import pack, packed_nbytes, unpack
from thinwire.compress.finite import NonFiniteError
from thinwire.compress.rounding import Uniforms
from thinwire.errors import UserError
from thinwire.exchange.choose import resolve_collective

QUANTIZERS = ["fp16", "bf16", "int8", "onebit", "signsgd", "signum", "efsignsgd", "qsgd", "terngrad", "natural"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def payload_bytes(name: str, n: int) -> int:
    """What each quantizer must send for n elements, from its definition (packed sizes, scales, norms)."""
    ones = packed_nbytes(n, 1)
    return {"fp16": 2 * n, "bf16": 2 * n, "int8": n + 4, "onebit": ones + 8, "signsgd": ones + 4, "signum": ones + 4,
            "efsignsgd": ones + 4, "qsgd": packed_nbytes(n, 4) + 4 * math.ceil(n / 512),
            "terngrad": packed_nbytes(n, 2) + 4, "natural": n + ones}[name]


# ---------------------------------------------------------------- bit packing

@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert packed.numel() * 8 >= n * bits and packed.numel() * 8 - n * bits < 8 * bits   # < 8 codes of padding
    assert torch.equal(unpack(packed, bits, n), codes)
    assert torch.equal(codes, torch.randint(0, 2 ** bits, (n,), generator=torch.Generator().manual_seed(seed),
                                            dtype=torch.uint8)), "pack must not modify its input by default"


def test_pack_layout_is_little_endian_bits():
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    assert pack(codes, 1).tolist() == [0b10000001, 0b00000011]
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4, 0]
    with pytest.raises(ValueError):
        unpack(torch.zeros(3, dtype=torch.uint8), 2, 100)


def test_pack_is_exact_on_every_byte_value():
    import itertools
    for bits in (1, 2, 4):         # the one-multiply paths: no carries between the gathered codes
        per = 8 // bits
        combos = torch.tensor(list(itertools.product(range(2 ** bits), repeat=per)), dtype=torch.uint8).flip(1)
        values = (combos.long() << (bits * torch.arange(per))).sum(1)
        assert torch.equal(pack(combos.reshape(-1), bits).long(), values)
        assert torch.equal(unpack(values.to(torch.uint8), bits, combos.numel()), combos.reshape(-1))


# ---------------------------------------------------------------- round trips, sizes, exact cases

@pytest.mark.parametrize("name", QUANTIZERS)
def test_round_trip_shapes_dtypes_and_payload_sizes(name, device):
    comp = compressors.get(name)
    for shape in [(), (0,), (1,), (7,), (3, 5), (2, 3, 11), (1025,)]:
        for dtype in DTYPES:
            x = torch.randn(shape).to(device, dtype)
            p = comp.compress(x, key=("t", shape), step=1)
            y = comp.decompress(p)
            assert y.shape == x.shape and y.dtype == x.dtype, (name, shape, dtype)
            assert y.device == x.device and all(t.device == x.device for t in p.tensors), (name, shape, dtype)
            assert p.nbytes == payload_bytes(name, x.numel()), (name, shape, p.nbytes)
            assert all(t.dtype in (torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.int8)
                       for t in p.tensors)
    n = 8 * 4096
    actual = comp.compress(torch.randn(n, device=device), key="big").nbytes * 8 / n
    assert abs(actual - comp.nominal_bits(n)) <= 0.03 * comp.nominal_bits(n)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 1000))
def test_sign_methods_send_the_signs(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    sign = torch.where(x >= 0, 1.0, -1.0)
    bare = compressors.get("signsgd", scale=False)
    assert torch.equal(bare.decompress(bare.compress(x)), sign)
    scaled = compressors.get("signsgd")          # EF-SignSGD's scale ‖x‖₁/d (Karimireddy et al. 2019)
    assert torch.allclose(scaled.decompress(scaled.compress(x)), sign * x.abs().mean(), rtol=1e-5)
    ef = compressors.get("efsignsgd")
    assert torch.allclose(ef.decompress(ef.compress(x)), sign * x.abs().mean(), rtol=1e-5)
    ob = compressors.get("onebit")
    y = ob.decompress(ob.compress(x))
    pos, neg = x[x >= 0], x[x < 0]
    if len(pos):
        assert torch.allclose(y[x >= 0], pos.mean().expand(len(pos)), rtol=1e-4, atol=1e-6)
    if len(neg):
        assert torch.allclose(y[x < 0], neg.mean().expand(len(neg)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum", "onebit"])
def test_sign_methods_round_an_integer_tensor_to_the_nearest(name):
    """On an integer tensor the float scale is rounded to the nearest integer, not truncated toward zero: [1, 2]
    (scale ‖x‖₁/d = 1.5) was sent back as [1, 1]."""
    comp = compressors.get(name)
    x = torch.tensor([1, 2])
    out = comp.decompress(comp.compress(x, key="w"))
    assert out.dtype == torch.int64 and out.tolist() == [2, 2]
    if name != "onebit":
        assert comp.vote([comp.compress(x, key="w")] * 2).tolist() == [2, 2]
    y = torch.tensor([-4, 1, 2], dtype=torch.int32)        # scale 7/3: ±2
    assert comp.decompress(comp.compress(y, key="v")).tolist() == ([-4, 2, 2] if name == "onebit" else [-2, 2, 2])


def test_lossless_cases_are_exact():
    ints = torch.arange(-127, 128, dtype=torch.float32)
    cases = {"fp16": ints, "bf16": ints, "int8": ints, "natural": torch.tensor([0.0, 1, -2, 0.25, -1024, 2.0**-20]),
             "signsgd": torch.tensor([1.0, -1, 1, 1, -1]), "efsignsgd": torch.tensor([3.0, -3, 3]),
             "onebit": torch.tensor([2.0, -5, 2, -5, 2]), "terngrad": torch.tensor([0.5, 0, -0.5, 0.5]),
             "qsgd": torch.arange(-4, 5, dtype=torch.float32) / 4}
    params = {"terngrad": {"clip": 0}, "qsgd": {"norm": "max", "levels": 4}}
    for name, x in cases.items():
        comp = compressors.get(name, **params.get(name, {}))
        for step in range(3):
            assert torch.equal(comp.decompress(comp.compress(x, step=step)), x), name


# ---------------------------------------------------------------- randomness, unbiasedness, variance

def test_uniforms_are_uniform_and_pairwise_uncorrelated():
    u = Uniforms(seed=3)
    for offset in (1, 7, 100):
        a = u.offset_uniforms(100_003, offset).clone() - offset
        assert 0 <= float(a.min()) and float(a.max()) < 1
        assert abs(float(a.mean()) - 0.5) < 0.01 and abs(float(a.var()) - 1 / 12) < 0.005
        b = u.offset_uniforms(100_003, offset) - offset
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02           # fresh numbers each call
    # pairwise independence is over draws: cells in the same row, the same column, or neither
    cells = torch.stack([u.offset_uniforms(2 * 4096, 1)[[0, 1, 4096, 4097]].clone() for _ in range(3000)])
    corr = torch.corrcoef(cells.T)
    assert float((corr - torch.eye(4)).abs().max()) < 0.07
    assert not torch.equal(Uniforms(seed=3).offset_uniforms(10, 1), Uniforms(seed=4).offset_uniforms(10, 1))
    assert torch.equal(Uniforms(seed=3).offset_uniforms(10, 1), Uniforms(seed=3).offset_uniforms(10, 1))


def _monte_carlo(comp, x, trials, copies=100):
    """Mean, variance and mean squared error of `trials` draws of C(x): `copies` copies of x per call (each its own
    bucket when len(x) is a multiple of the bucket, same max and norms), so fresh rounding across and within calls."""
    ys = torch.cat([comp.decompress(comp.compress(x.repeat(copies), key="k", step=t)).view(copies, -1)
                    for t in range(trials // copies)])
    return ys.mean(0), ys.var(0), ((ys - x) ** 2).sum(1).mean()


def _spacing_bucketed(s, bucket):
    return lambda x: torch.cat([b.norm().expand(len(b)) for b in x.split(bucket)]) / s


@pytest.mark.parametrize("name,params,spacing", [
    ("qsgd", {}, _spacing_bucketed(7, 512)),
    ("qsgd", {"levels": 2, "bucket": 16}, _spacing_bucketed(2, 16)),
    ("qsgd", {"norm": "max"}, lambda x: x.abs().max().expand(len(x)) / 7),
    ("terngrad", {"clip": 0}, lambda x: x.abs().max().expand(len(x))),
    ("natural", {}, lambda x: x.abs()),
    ("int8", {"stochastic": True}, lambda x: x.abs().max().expand(len(x)) / 127)])
def test_unbiased_compressors_are_unbiased(name, params, spacing):
    comp = compressors.get(name, **params)
    assert comp.unbiased
    x = torch.randn(512, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3, 512)
    trials = 3000
    mean, var, _ = _monte_carlo(comp, x, trials)
    # 5 standard errors; the variance is at least that of a 1/trials-probability jump of one level spacing (so an
    # element that rounds the rare way ~once in `trials` is not judged on an empirical variance of 0)
    var = torch.maximum(var, spacing(x) ** 2 / trials)
    tol = 5 * (var / trials).sqrt() + 1e-5 * (x.abs() + 1e-3)     # exact levels still round in fp32
    assert bool(((mean - x).abs() <= tol).all()), float(((mean - x).abs() / tol).max())


def test_terngrad_is_unbiased_for_the_clipped_gradient():
    comp = compressors.get("terngrad")        # clip = 2.5 sigma
    x = torch.randn(400, generator=torch.Generator().manual_seed(2))
    x[:3] = torch.tensor([9.0, -8.0, 7.5])    # outliers beyond 2.5 sigma
    c = 2.5 * float(x.repeat(100).std())      # the sigma of what is compressed (100 copies per call)
    mean, var, _ = _monte_carlo(comp, x, 3000)
    tol = 5 * (torch.maximum(var, torch.tensor(c) ** 2 / 3000) / 3000).sqrt() + 1e-5
    assert bool(((mean - x.clamp(-c, c)).abs() <= tol).all())


def test_variance_bounds():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1024, generator=g) * torch.rand(1024, generator=g)
    for s, bucket in [(1, 1024), (4, 256), (7, 512)]:
        _, _, err = _monte_carlo(compressors.get("qsgd", levels=s, bucket=bucket), x, 400)
        bound = sum(min(bucket / s**2, math.sqrt(bucket) / s) * float(b.norm()) ** 2 for b in x.split(bucket))
        assert float(err) <= 1.05 * bound        # QSGD (arXiv 1610.02132), Lemma 3.1: E||C(g) - g||^2 <= min(d/s^2, sqrt(d)/s)||g||^2
    _, _, err = _monte_carlo(compressors.get("natural"), x, 400)
    assert float(err) <= 1.05 * float(x.norm()) ** 2 / 8     # natural compression (arXiv 1905.10988): omega = 1/8
    _, _, err = _monte_carlo(compressors.get("terngrad", clip=0), x, 400)
    assert float(err) <= 1.05 * float(x.abs().max() * x.abs().sum())   # E||C||^2 <= ||g||_inf ||g||_1


def test_local_randomness_is_seeded():
    x = torch.randn(1000)
    a, b, c = (compressors.get("qsgd", seed=s) for s in (1, 1, 2))
    pa, pb, pc = (comp.compress(x, key="k", step=0) for comp in (a, b, c))
    assert torch.equal(pa.tensors[0], pb.tensors[0]) and not torch.equal(pa.tensors[0], pc.tensors[0])


# ---------------------------------------------------------------- all-reduce algebra

@pytest.mark.parametrize("name,params", [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"stochastic": True}),
                                         ("qsgd", {}),
                                         ("qsgd", {"levels": 100}), ("terngrad", {})])
@pytest.mark.parametrize("world", [1, 3, 40])
def test_linear_payloads_sum_like_the_decompressed_values(name, params, world):
    comp = compressors.get(name, **params)
    assert comp.linear and resolve_collective(comp, "allreduce") == "allreduce"   # (int8: the exchange's choice)
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(37, 29, generator=g) * (r + 1) for r in range(world)]
    agreed = None
    if comp.agree(xs[0]) is not None:
        agreed = torch.stack([comp.agree(x) for x in xs]).amax(0)      # what all-reduce MAX gives every rank
    payloads = [comp.compress(x, key="k", step=0, agreed=agreed) for x in xs]
    wide = [comp.sum_payload(p, world) for p in payloads]
    summed = [torch.stack([w.tensors[i] for w in wide]).sum(0, dtype=wide[0].tensors[i].dtype)
              for i in range(len(wide[0].tensors))]
    for w in summed:
        if not w.is_floating_point():
            assert w.abs().max() <= torch.iinfo(w.dtype).max
    total = comp.decompress(Payload(summed, ctx=wide[0].ctx))
    expect = sum(comp.decompress(p) for p in payloads)
    exact = name not in ("fp16", "bf16")
    tol = dict(rtol=0, atol=1e-4 * world) if exact else dict(rtol=2e-2, atol=2e-2 * world)
    assert total.shape == xs[0].shape and torch.allclose(total, expect, **tol)


def test_fp16_sum_of_ranks_does_not_overflow():
    comp = compressors.get("fp16")
    x = torch.full((10,), 40000.0)
    wide = [comp.sum_payload(comp.compress(x), 4) for _ in range(4)]
    total = comp.decompress(Payload([sum(w.tensors[0] for w in wide)], ctx=wide[0].ctx))
    assert torch.isfinite(total).all() and torch.allclose(total, 4 * x, rtol=1e-3)


@pytest.mark.parametrize("name,params", [("onebit", {}), ("signsgd", {}), ("signum", {}), ("efsignsgd", {}),
                                         ("natural", {}), ("qsgd", {}), ("terngrad", {}), ("int8", {})])
def test_gathered_payloads_decompress_with_the_receivers_ctx(name, params):
    """Other ranks' payloads arrive as flat tensors with THIS rank's ctx: ctx must hold nothing rank-specific."""
    comp = compressors.get(name, **params)
    assert comp.fixed_size
    g = torch.Generator().manual_seed(7)
    mine = comp.compress(torch.randn(33, 17, generator=g), key="k", step=3)
    for r in range(3):
        theirs = comp.compress(torch.randn(33, 17, generator=g) * (r + 2), key=("k", r), step=3)
        arrived = Payload([t.reshape(-1).clone() for t in theirs.tensors], ctx=mine.ctx)
        assert [t.numel() for t in arrived.tensors] == [t.numel() for t in mine.tensors]
        assert torch.equal(comp.decompress(arrived), comp.decompress(theirs))
        assert torch.equal(comp.aggregate([arrived, mine]), comp.decompress(theirs) + comp.decompress(mine))


def test_majority_vote_carries_the_ranks_mean_scale():
    """signsgd's exchange result: sign(Σ_r sign(x_r)) · mean_r ‖x_r‖₁/d (unscaled: the bare vote)."""
    xs = [torch.tensor([1.0, -2.0, 3.0, -4.0]), torch.tensor([-1.0, -1.0, 1.0, 1.0]), torch.tensor([2.0, 2.0, -2.0, 2.0])]
    comp, bare = compressors.get("signsgd"), compressors.get("signsgd", scale=False)
    vote = torch.tensor([1.0, -1.0, 1.0, 1.0])
    mean_scale = sum(x.abs().mean() for x in xs) / 3
    assert torch.allclose(comp.vote([comp.compress(x) for x in xs]), vote * mean_scale)
    assert torch.equal(bare.vote([bare.compress(x) for x in xs]), vote)


def test_aggregation_flags():
    assert {compressors.get(n).aggregation for n in ("signsgd", "signum")} == {"majority"}
    assert {compressors.get(n).aggregation for n in ("onebit", "efsignsgd", "natural", "int8")} == {"allgather"}
    assert resolve_collective(compressors.get("qsgd"), "allgather") == "allgather"   # the exchange's collective
    assert compressors.get("terngrad").randomness == "local" and compressors.get("int8").randomness == "none"


# ---------------------------------------------------------------- memories

@pytest.mark.parametrize("name", ["onebit", "signsgd", "efsignsgd", "qsgd", "terngrad", "int8"])
def test_error_feedback_invariant(name):
    comp, mem = compressors.get(name), memories.get("residual")
    g = torch.Generator().manual_seed(0)
    sent_total, in_total = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for step in range(20):
        grad = torch.randn(300, generator=g)
        c = mem.compensate(grad, "w")
        sent = comp.decompress(comp.compress(c, key="w", step=step))
        mem.update(c, "w", sent)
        sent_total += sent.double()
        in_total += grad.double()
    assert torch.allclose(sent_total + mem.residuals["w"].double(), in_total, atol=1e-4)


def test_residual_beta_gamma_and_state():
    mem = memories.get("residual", beta=0.5, gamma=2.0)
    g = torch.ones(4)
    assert torch.equal(mem.compensate(g, "a"), 2 * g)
    mem.update(2 * g, "a", torch.zeros(4))                      # nothing sent: residual 2
    assert torch.equal(mem.compensate(g, "a"), 0.5 * 2 * g + 2 * g)
    other = memories.get("residual", beta=0.5, gamma=2.0)
    other.load_state_dict(mem.state_dict())
    assert torch.equal(other.compensate(g, "a"), mem.compensate(g, "a"))
    assert torch.equal(mem.compensate(torch.ones(5), "a"), 2 * torch.ones(5))   # a new shape starts afresh
    with pytest.raises(UserError):
        memories.get("residual", gamma=0)


def test_lr_scaled_memory_invariant():
    comp, mem = compressors.get("efsignsgd"), memories.get("efsignsgd", ef_lr=0.05)
    g = torch.Generator().manual_seed(1)
    sent_total, in_total = torch.zeros(100, dtype=torch.float64), torch.zeros(100, dtype=torch.float64)
    for step in range(15):
        grad = torch.randn(100, generator=g)
        p = mem.compensate(grad, "w")
        sent = comp.decompress(comp.compress(p, key="w", step=step))
        mem.update(p, "w", sent)
        sent_total += sent.double()
        in_total += grad.double()
    # EF-SignSGD (arXiv 1901.09847): lr * sum(Delta / lr) + e_final = lr * sum(g)
    assert torch.allclose(0.05 * sent_total + mem.errors["w"].double(), 0.05 * in_total, atol=1e-5)
    mem.lr = 0.1               # the stored error is in update units: compensating divides by the current lr
    assert torch.allclose(mem.compensate(torch.zeros(100), "w"), mem.errors["w"] / 0.1)


def test_signum_momentum_and_state():
    comp = compressors.get("signum", beta=0.5)
    comp.compress(torch.tensor([1.0, -1.0]), key="m")
    y = comp.decompress(comp.compress(torch.tensor([-0.4, 0.4]), key="m"))    # m = 0.5 - 0.4, -0.5 + 0.4
    assert torch.allclose(y, torch.tensor([0.1, -0.1]))                      # sign(m) · ‖m‖₁/d
    other = compressors.get("signum", beta=0.5)
    other.load_state_dict(comp.state_dict())
    assert torch.equal(other.momenta["m"], comp.momenta["m"])


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("name", QUANTIZERS)
def test_non_finite_input_is_a_clear_error(name):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(50)
        x[17] = bad
        with pytest.raises(NonFiniteError, match=name):
            compressors.get(name).compress(x, key="layer")
    big = torch.full((1000,), 3e38)   # finite, but sums overflow: a result that is finite, or an overflow error
    if name not in ("fp16", "bf16"):
        comp = compressors.get(name)
        try:
            assert torch.isfinite(comp.decompress(comp.compress(big))).all()
        except NonFiniteError as err:
            assert "overflows" in str(err) and name in ("onebit", "efsignsgd", "qsgd", "signsgd", "signum")


def test_fp16_overflow_and_bad_parameters():
    with pytest.raises(NonFiniteError):
        compressors.get("fp16").compress(torch.tensor([1e6]))
    for name, params in [("qsgd", {"levels": 0}), ("qsgd", {"levels": 128}), ("qsgd", {"bucket": 0}),
                         ("qsgd", {"norm": "l1"}), ("qsgd", {"aggregation": "majority"}),
                         ("terngrad", {"clip": -1}), ("int8", {"aggregation": "x"}), ("signum", {"beta": 1.0}),
                         ("fp16", {"scale": 0}), ("efsignsgd", {})]:
        if name == "efsignsgd":
            with pytest.raises(UserError):
                memories.get("efsignsgd", ef_lr=0)
            continue
        with pytest.raises(UserError):
            compressors.get(name, **params)
    assert compressors.get("qsgd", levels="3").bits == 3            # CLI strings are converted


# ---------------------------------------------------------------- benchmark

def test_bench_covers_every_registered_compressor(tmp_path):
    from thinwire.bench.compressors import bench, plot, table
    result = bench(4096, compressors.names(), repeat=1)
    assert set(result) == {"numel", "world_size", "memcpy_ms", "compressors"} and result["memcpy_ms"] > 0
    assert [r["name"] for r in result["compressors"]] == compressors.names()
    keys = {"name", "warmup_s", "compress_ms", "decompress_ms", "x_memcpy", "payload_bytes", "bits_per_element",
            "nominal_bits_per_element", "wire_bits_per_element", "collective"}
    for row in result["compressors"]:
        if row["name"] in QUANTIZERS:
            assert set(row) == keys, row
            assert row["payload_bytes"] == payload_bytes(row["name"], 4096)
            nominal = row["nominal_bits_per_element"]
            assert abs(row["bits_per_element"] - nominal) <= 0.03 * nominal
    # what goes on the wire at 4 ranks: qsgd's 4-bit codes travel as 8-bit summed levels (all-reduce beats
    # the all-gather there); terngrad's 2-bit codes are gathered
    rows = {r["name"]: r for r in result["compressors"]}
    assert rows["qsgd"]["collective"] == "allreduce"
    assert rows["qsgd"]["wire_bits_per_element"] == pytest.approx(8 + 32 * 8 / 4096)
    assert rows["terngrad"]["collective"] == "allgather" and rows["terngrad"]["wire_bits_per_element"] == 2 + 32 / 4096
    assert "qsgd" in table(result)
    plot(result, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_bench_marks_issue_31s_targets_per_device(tmp_path):
    from thinwire.bench.compressors import table, target
    row = {"compress_ms": 3.0, "decompress_ms": 2.0, "x_memcpy": 5.0, "payload_bytes": 1, "bits_per_element": 1.0,
           "nominal_bits_per_element": 1.0, "wire_bits_per_element": 1.0, "collective": "allgather"}
    cpu = {"numel": 8, "world_size": 4, "memcpy_ms": 1.0,
           "compressors": [{"name": n, **row} for n in ("randomk", "qsgd", "topk", "powersgd")]}
    assert [target(cpu, n) for n in ("randomk", "qsgd", "topk", "powersgd")] == [4.0, 8.0, 12.0, None]
    lines = table(cpu).splitlines()
    assert lines[2].endswith("<= 4.0 OVER") and lines[3].endswith("<= 8.0") and not lines[5].endswith("0")
    gpu = {**cpu, "device": "cuda", "device_name": "a GPU", "torch_topk_ms": 8.0}
    assert target(gpu, "topk") == pytest.approx(9.6) and target(gpu, "randomk") == 2.0 and target(gpu, "int8") == 3.0
    assert "on a GPU" in table(gpu) and "torch.topk of 1 %" in table(gpu)
