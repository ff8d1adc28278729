"""The DiLoCo family's compressors: fp8, fp4 (Streaming DiLoCo), DeMo (chunked DCT + top-k, decoupled momentum),
SparseLoCo (top-k per chunk + 2-bit values, error feedback with decay). Single-process properties first, then the
exchange across 4 gloo workers, DDP hooks, and one short training run per compressor."""
from __future__ import annotations

import math

import pytest
import torch

import thinwire as tw
from thinwire.compress import Payload, compressors, memories
from thinwire.compress._chunks import Layout, index_bits
from thinwire.compress.demo import chunked_dct, dct_basis
from thinwire.compress.finite import NonFiniteError
from thinwire.compress.fp4 import MAGNITUDES
from thinwire.errors import UserError
from thinwire.exchange import wire

CONFIGS = [("fp8", {}), ("fp8", {"format": "e5m2", "chunk": 256}), ("fp4", {}), ("fp4", {"format": "e2m1"}),
           ("demo", {}), ("demo", {"chunk": 32, "topk": 3, "sign": True}), ("sparseloco", {}),
           ("sparseloco", {"chunk": 256, "topk": 16})]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in CONFIGS]


def _x(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).mul(4).exp() * scale   # several magnitudes


# ---------------------------------------------------------------- fp8 and fp4: error bounds, exact values

@pytest.mark.parametrize("fmt,mant,subnormal", [("e4m3", 3, 2.0 ** -9), ("e5m2", 2, 2.0 ** -16)])
@pytest.mark.parametrize("chunk", [0, 64])
def test_fp8_error_is_within_half_an_ulp_of_the_scaled_format(fmt, mant, subnormal, chunk):
    comp = compressors.get("fp8", format=fmt, chunk=chunk)
    x = _x(1000, 1)
    y = comp.decompress(comp.compress(x))
    fmax = torch.finfo(comp.dtype8).max
    bucket = chunk or x.numel()
    amax = torch.cat([b.abs().max().expand(len(b)) for b in x.split(bucket)])
    scale = amax / fmax
    # round to nearest: half an ulp, 2^-(mant+1) relative in the normal range, half the smallest step below
    bound = x.abs() * 2.0 ** -(mant + 1) + scale * subnormal / 2
    assert bool(((y - x).abs() <= bound * (1 + 1e-5)).all())
    assert math.isclose(float(y.abs().max()), float(x.abs().max()), rel_tol=1e-6)     # the max maps to ±F


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_representable_values_round_trip_exactly(fmt):
    comp = compressors.get("fp8", format=fmt)
    dt = comp.dtype8
    codes = torch.arange(256, dtype=torch.uint8).view(dt).to(torch.float32)
    codes = codes[torch.isfinite(codes)]                         # every finite fp8 value (its max among them)
    for scale in (1.0, 2.0 ** -20, 2.0 ** 10):
        x = codes * scale
        assert torch.equal(comp.decompress(comp.compress(x)), x), scale
    assert torch.equal(comp.decompress(comp.compress(torch.zeros(10))), torch.zeros(10))


@pytest.mark.parametrize("fmt", ["e3m0", "e2m1"])
def test_fp4_error_bounds_and_exact_values(fmt):
    comp = compressors.get("fp4", format=fmt, chunk=128)
    x = _x(128 * 20, 2)
    y = comp.decompress(comp.compress(x))
    amax = torch.cat([b.abs().max().expand(len(b)) for b in x.split(128)])
    a = x.abs()
    if fmt == "e3m0":      # nearest power of two: |x|/3 in the normal range, half the smallest step below
        bound = torch.where(a >= amax * 2.0 ** -6, a / 3, amax * 2.0 ** -7)
    else:                  # e2m1 on 0, .5, 1, 1.5, 2, 3, 4, 6 (units of amax/6)
        bound = torch.where(a >= amax / 6, a / 5, amax / 24)
    assert bool(((y - x).abs() <= bound * (1 + 1e-5) + 1e-12).all())
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())                 # never a flipped sign
    # the table lookup picks the nearest magnitude (brute force over the 8; the smaller one on a tie)
    mags = torch.tensor(MAGNITUDES[fmt], dtype=torch.float64)
    dist = ((a / amax).double().view(-1, 1) - mags).abs()
    nearest = mags[torch.argmin(dist, dim=1)] * amax.double()       # argmin returns the first (smaller) on ties
    assert torch.allclose(y.abs().double(), nearest, rtol=1e-6, atol=0)
    # the values of the format (times the chunk's max-abs) are exact
    mags = mags.float()
    for amax_c in (1.0, 0.75, 2.0 ** -30):
        v = torch.cat([mags, -mags, mags.flip(0)]) * amax_c
        assert torch.equal(comp.decompress(comp.compress(v)), v), amax_c


def test_fp4_codes_are_packed_two_per_byte():
    comp = compressors.get("fp4", chunk=64)
    p = comp.compress(torch.randn(1000))
    assert p.tensors[0].dtype == torch.uint8 and p.tensors[0].numel() == 500
    assert p.tensors[1].dtype == torch.float32 and p.tensors[1].numel() == math.ceil(1000 / 64)


# ---------------------------------------------------------------- the DCT and top-k per chunk

@pytest.mark.parametrize("n", [1, 2, 7, 32, 64, 100])
def test_dct_basis_is_orthonormal_dct_ii(n):
    c = dct_basis(n).double()
    assert torch.allclose(c @ c.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    # against the DCT-II definition: X_u = c_u Σ_j x_j cos(π (2j+1) u / 2n), c_0 = √(1/n), c_u = √(2/n)
    x = torch.randn(n, dtype=torch.float64)
    want = torch.tensor([(math.sqrt(1 / n) if u == 0 else math.sqrt(2 / n))
                         * sum(float(x[j]) * math.cos(math.pi * (2 * j + 1) * u / (2 * n)) for j in range(n))
                         for u in range(n)], dtype=torch.float64)
    assert torch.allclose(c @ x, want, atol=1e-5)


@pytest.mark.parametrize("n,chunk", [(64 * 5, 64), (64 * 5 + 17, 64), (10, 64), (1, 8)])
def test_chunked_dct_inverse_is_identity(n, chunk):
    lay = Layout(n, chunk, 1)
    x = torch.randn(n)
    coeff = chunked_dct(x, lay)
    assert torch.allclose(chunked_dct(coeff, lay, inverse=True), x, atol=1e-5)
    assert math.isclose(float(coeff.norm()), float(x.norm()), rel_tol=1e-5)          # orthonormal: Parseval
    # each chunk transformed on its own: a spike in one chunk has coefficients only in that chunk
    spike = torch.zeros(n)
    spike[n - 1] = 1.0
    nz = torch.nonzero(chunked_dct(spike, lay)).squeeze(1)
    assert int(nz.min()) >= (n - 1) // chunk * chunk


@pytest.mark.parametrize("n,chunk,k", [(16 * 5 + 7, 16, 3), (64, 64, 64), (300, 100, 1), (5, 16, 4)])
def test_topk_per_chunk_keeps_the_k_largest_of_every_chunk(n, chunk, k):
    lay = Layout(n, chunk, k)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    local, vals = lay.topk(x)
    pos = lay.positions(local)
    assert torch.equal(x[pos], vals) and lay.kept == pos.numel() == len(set(pos.tolist()))
    for start in range(0, n, chunk):
        block = x[start:start + chunk]
        mine = sorted(int(p) - start for p in pos if start <= p < start + chunk)
        want = min(len(block), k if len(block) == chunk else max(1, math.ceil(k * len(block) / chunk)))
        assert len(mine) == want
        assert sorted(torch.topk(block.abs(), want).indices.tolist()) == mine
    assert index_bits(chunk) == max(1, math.ceil(math.log2(chunk)))


def test_demo_keeping_every_coefficient_is_lossless_and_sparse_otherwise():
    x = torch.randn(1000)
    full = compressors.get("demo", chunk=50, topk=50)
    assert torch.allclose(full.decompress(full.compress(x)), x, atol=1e-5)
    comp = compressors.get("demo", chunk=64, topk=4)
    p = comp.compress(x)
    y = comp.decompress(p)
    lay = Layout(1000, 64, 4)
    coeff = chunked_dct(y, lay)
    assert int((coeff.abs() > 1e-5).sum()) <= lay.kept                       # only the kept frequencies
    # the kept coefficients are the largest of each chunk's DCT: nothing else is closer in L2
    c = chunked_dct(x, lay)
    local, vals = lay.topk(c)
    assert torch.allclose(coeff[lay.positions(local)], vals, atol=1e-5)


# ---------------------------------------------------------------- memories: nothing lost

@pytest.mark.parametrize("name,mem,beta", [("demo", "demo", 0.9), ("sparseloco", "sparseloco", 0.95),
                                           ("fp4", "residual", 1.0)])
def test_error_feedback_with_decay_loses_nothing(name, mem, beta):
    """DeMo: sent + kept momentum = β m + g; SparseLoCo: sent + e_new = β e_old + Δ, at every step."""
    comp = compressors.get(name, **({"chunk": 64, "topk": 4} if name != "fp4" else {}))
    memory = memories.get(mem, beta=beta)
    g = torch.Generator().manual_seed(3)
    prev = torch.zeros(700, dtype=torch.float64)
    sent_total = torch.zeros(700, dtype=torch.float64)
    decayed_in = torch.zeros(700, dtype=torch.float64)    # Σ_t β^(T-t) g_t
    for step in range(12):
        grad = torch.randn(700, generator=g)
        c = memory.compensate(grad, "w")
        assert torch.allclose(c.double(), beta * prev + grad.double(), atol=1e-5)
        sent = comp.decompress(comp.compress(c, key="w", step=step))
        memory.update(c, "w", sent)
        kept = memory.residuals["w"].double()
        assert torch.allclose(sent.double() + kept, beta * prev + grad.double(), atol=1e-5)
        assert float(sent.abs().sum()) > 0
        prev = kept
        sent_total = beta * sent_total + sent.double()
        decayed_in = beta * decayed_in + grad.double()
    assert torch.allclose(sent_total + prev, decayed_in, atol=1e-4)     # only delayed (and decayed)


def test_memory_defaults_state_and_bad_beta():
    assert memories.get("demo").beta == 0.999 and memories.get("sparseloco").beta == 0.95
    m = memories.get("demo", beta=0.5)
    m.update(m.compensate(torch.ones(4), "a"), "a", torch.zeros(4))
    other = memories.get("demo", beta=0.5)
    other.load_state_dict(m.state_dict())
    assert torch.equal(other.compensate(torch.ones(4), "a"), torch.full((4,), 1.5))
    for name in ("demo", "sparseloco"):
        for bad in (1.0, -0.1):
            with pytest.raises(UserError, match="beta"):
                memories.get(name, beta=bad)


# ---------------------------------------------------------------- SparseLoCo's 2-bit values

def test_sparseloco_values_two_bits_within_half_the_chunk_range():
    comp = compressors.get("sparseloco", chunk=128, topk=16)
    x = _x(128 * 10 + 50, 4)
    lay = Layout(x.numel(), 128, 16)
    local, vals = lay.topk(x)
    pos = lay.positions(local)
    y = comp.decompress(comp.compress(x))
    assert torch.count_nonzero(y) == lay.kept and torch.equal(torch.sign(y[pos]), torch.sign(vals))
    rows = lay.row_of()
    for r in range(lay.rows):
        a = vals[rows == r].abs()
        err = (y[pos][rows == r] - vals[rows == r]).abs()
        assert float(err.max()) <= float(a.max() - a.min()) / 2 + 1e-6
    # a chunk whose kept values take two magnitudes is exact (dyadic values: their means are exact)
    v = torch.zeros(256)
    v[[3, 70, 100, 101]] = torch.tensor([0.5, -0.5, 2.0, -2.0])           # chunk 0: magnitudes 0.5 and 2
    v[[140, 141, 200, 250]] = torch.tensor([-0.25, 0.25, 1.0, -0.25])     # chunk 1: 0.25 and 1
    two = compressors.get("sparseloco", chunk=128, topk=4)
    assert torch.equal(two.decompress(two.compress(v)), v)


# ---------------------------------------------------------------- sizes, ctx, errors

@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_nominal_bits_are_the_packed_bytes(name, params):
    comp = compressors.get(name, **params)
    for n in (1, 7, 1000, 4096 * 3, 65536 + 5):
        p = comp.compress(torch.randn(n), key="k")
        header = 4 + 8 * len(p.tensors)
        assert wire.packed_size(p.tensors) == header + p.nbytes
        bits = 8 * p.nbytes
        nominal = comp.nominal_bits(n) * n
        # bit-packed codes take whole groups of 8: at most 7 codes of padding per packed tensor
        assert nominal - 1e-6 <= bits <= nominal + 7 * 8 * len(p.tensors), (n, bits, nominal)
    n = 4096 * 64
    assert math.isclose(comp.compress(torch.randn(n)).nbytes * 8 / n, comp.nominal_bits(n), rel_tol=1e-9)


def test_nominal_bits_formulas():
    assert compressors.get("fp8").nominal_bits(1 << 20) == 8 + 32 / (1 << 20)
    assert compressors.get("fp8", chunk=128).nominal_bits(1 << 20) == 8 + 32 / 128
    assert compressors.get("fp4").nominal_bits(1 << 20) == 4 + 32 / 128
    # DeMo: k of 64 per chunk, 6-bit indices + fp32 values
    assert compressors.get("demo", chunk=64, topk=4).nominal_bits(1 << 20) == 4 * (6 + 32) / 64
    # SparseLoCo: 64 of 4096 per chunk, 12-bit indices + 2-bit codes, two fp32 levels per chunk
    assert compressors.get("sparseloco").nominal_bits(1 << 20) == (64 * (12 + 2) + 64) / 4096


@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_gathered_payloads_decompress_with_the_receivers_ctx(name, params):
    """Other ranks' payloads arrive flat, with THIS rank's ctx, after the wire; sizes depend on the shape only."""
    comp = compressors.get(name, **params)
    assert comp.fixed_size and not comp.linear and not comp.unbiased
    assert comp.aggregation == ("majority" if params.get("sign") else "allgather")
    mine = comp.compress(_x(33 * 170, 7).view(33, 170), key="k", step=3)
    theirs = [comp.compress(_x(33 * 170, 8 + r, scale=r + 2).view(33, 170), key=("k", r), step=3) for r in range(3)]
    for t in theirs:
        arrived = Payload(wire.unpack(wire.pack(t.tensors)), ctx=mine.ctx)
        assert [x.numel() for x in arrived.tensors] == [x.numel() for x in mine.tensors]
        assert torch.equal(comp.decompress(arrived), comp.decompress(t))
    arrived = [Payload(wire.unpack(wire.pack(t.tensors)), ctx=mine.ctx) for t in theirs] + [mine]
    want = sum(comp.decompress(t).double() for t in theirs + [mine])
    got = comp.aggregate(arrived)
    assert got.shape == (33, 170) and torch.allclose(got.double(), want, atol=1e-4)


@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_shapes_dtypes_and_fp32_accumulation(name, params):
    comp = compressors.get(name, **params)
    for shape in [(), (0,), (1,), (7,), (3, 5), (2, 3, 11), (1025,)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn(shape).to(dtype)
            y = comp.decompress(comp.compress(x, key=("t", shape)))
            assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    # bf16 contributions are summed in fp32 and rounded once (not rounded after every addition)
    xs = [(torch.randn(3000, generator=torch.Generator().manual_seed(i)) * 100).to(torch.bfloat16)
          for i in range(6)]
    ps = [comp.compress(x, key="b") for x in xs]
    total = comp.aggregate(ps)
    assert total.dtype == torch.bfloat16
    if name in ("fp8", "fp4"):
        assert torch.equal(total, sum(comp._decode32(p) for p in ps).to(torch.bfloat16))
    # the fp32 sum of the fp32 contributions, rounded once to bf16 (half an ulp: 2^-8 relative)
    ref = sum(comp.decompress(Payload(p.tensors, {**p.ctx, "dtype": torch.float32})) for p in ps)
    assert torch.allclose(total.float(), ref, rtol=2.0 ** -8, atol=1e-3)


@pytest.mark.parametrize("name", ["fp8", "fp4", "demo", "sparseloco"])
def test_non_finite_input_is_a_clear_error(name):
    for bad in (float("nan"), float("inf")):
        x = torch.randn(300)
        x[17] = bad
        with pytest.raises(NonFiniteError, match=name):
            compressors.get(name).compress(x, key="layer")


def test_bad_parameters_are_user_errors():
    for name, params in [("fp8", {"format": "e3m4"}), ("fp8", {"chunk": -1}), ("fp4", {"format": "nf4"}),
                         ("fp4", {"chunk": 0}), ("demo", {"chunk": 0}), ("demo", {"topk": 65}),
                         ("demo", {"topk": 0}), ("sparseloco", {"chunk": 1 << 17}), ("sparseloco", {"topk": 0})]:
        with pytest.raises(UserError):
            compressors.get(name, **params)
    assert compressors.get("demo", topk="8", sign="true").topk == 8           # CLI strings are converted
    names = {r["name"]: r["summary"] for r in compressors.describe()}
    for name in ("fp8", "fp4", "demo", "sparseloco"):
        assert names[name]                                                   # `thinwire list` shows a summary
    assert {r["name"] for r in memories.describe()} >= {"demo", "sparseloco"}


# ---------------------------------------------------------------- across 4 gloo workers

def exchange_worker(rank, world_size, configs):
    """Each config through an Exchange (several shapes and keys, twice) and as a DDP hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thinwire.comm import Transport
    from thinwire.exchange import Exchange
    out = {}
    for i, (name, params) in enumerate(configs):
        ex = Exchange(Transport(), compressors.get(name, **params))
        ref = compressors.get(name, **params)            # this rank's contribution, computed on the side
        rows = []
        for step in range(2):
            for key, shape in (("w", (48, 40)), ("b", (48,)), ("tiny", (3,)), ("scalar", ())):
                x = _x(max(1, math.prod(shape)), 1000 * rank + 10 * step + len(key), scale=rank + 1).view(shape)
                got = ex.aggregate(x, key=key)
                rows.append((got, ref.decompress(ref.compress(x, key=key, step=step))))
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        model = DDP(net, bucket_cap_mb=0.001)
        state, hook = tw.ddp_hook(name, memory="residual", **params)
        model.register_comm_hook(state, hook)
        grads = []
        for it in range(2):
            g = torch.Generator().manual_seed(100 * it + rank)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(16, 20, generator=g)),
                                              torch.randint(0, 5, (16,), generator=g)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        out[i] = {"rows": rows, "ddp": grads, "ddp_bytes": state.meter.totals()["bytes_sent"]}
    return out


def test_exchange_result_is_the_mean_of_the_ranks_contributions(pool4):
    res = pool4.run(exchange_worker, CONFIGS)
    n = len(res)
    for i, (name, params) in enumerate(CONFIGS):
        for j, (got, _) in enumerate(res[0][i]["rows"]):
            contribs = torch.stack([r[i]["rows"][j][1].double() for r in res])
            want = torch.sign(contribs.sum(0)) if params.get("sign") else contribs.mean(0)
            assert got.dtype == torch.float32 and got.shape == contribs.shape[1:]
            assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (name, params, j)
            for r in res[1:]:
                assert torch.equal(r[i]["rows"][j][0], got), (name, "ranks disagree")
        for it in range(2):
            g0 = res[0][i]["ddp"][it]
            assert torch.isfinite(g0).all() and float(g0.abs().sum()) > 0
            assert all(torch.equal(r[i]["ddp"][it], g0) for r in res[1:]), (name, "DDP grads differ")
        assert res[0][i]["ddp_bytes"] > 0


# ---------------------------------------------------------------- training

RUNS = [("fp8", "none", {}, None), ("fp4", "residual", {}, None),
        ("demo", "demo", {"beta": 0.9}, 0.0), ("demo", "demo", {"beta": 0.9, "sign": True}, 0.0),
        ("sparseloco", "sparseloco", {"chunk": 1024, "topk": 32}, 0.0)]


@pytest.mark.parametrize("name,memory,params,momentum", RUNS, ids=[f"{r[0]}-{len(r[2])}" for r in RUNS])
def test_training_lowers_the_loss(pool4, tmp_path, name, memory, params, momentum):
    import json

    from thinwire.run.train import TrainConfig, run_training
    lr = 0.01 if params.get("sign") else None              # signed steps move every weight by lr
    cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=4, epochs=10, compressor=name, memory=memory,
                      params=dict(params), momentum=momentum, lr=lr, progress=False)
    s = run_training(cfg, out=str(tmp_path), pool=pool4)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")]
    head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert tail < 0.5 * head, (name, head, tail)
    assert s["final_accuracy"] > 0.7, (name, s["final_accuracy"])
    dense = 4 * s["num_params"] * 2 * 3 / 4 * s["steps"]    # ring all-reduce of fp32 gradients, 4 workers
    assert s["bytes_sent_per_worker"] < 0.6 * dense      # fp8's all-gather: (n-1)·N bytes against 1.5·4N
