"""Single-process properties of the sparsifiers, low-rank and sketch compressors and their memories."""
from __future__ import annotations

import math

import pytest
import torch

import thinwire as tw
from thinwire.compress._sparse import index_dtype, num_kept, pack_codes, topk_indices, unpack_codes
from thinwire.compress.dgc import warmup_density
from thinwire.compress.countsketch import next_prime
from thinwire.compress.randomk import sample_without_replacement
from thinwire.compress.threshold import Scratch, mask_indices, select_beyond
from thinwire.errors import UserError
from thinwire.exchange import wire

MINE = ["topk", "threshold", "dgc", "gaussiank", "randomk", "stc", "qsparse", "countsketch", "powersgd"]


def _heavy(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4   # heavy-tailed, like gradients


@pytest.mark.parametrize("name", MINE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (33, 17), (0,)])
def test_round_trip_shape_and_dtype(name, dtype, shape, device):
    c = tw.compressors.get(name)
    x = torch.randn(shape).to(device, dtype)
    p = c.compress(x, key="t", step=0)
    y = c.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.device == x.device and all(t.device == x.device for t in p.tensors)
    assert torch.isfinite(y.float()).all()


@pytest.mark.parametrize("name", ["topk", "dgc", "gaussiank", "stc", "randomk"])
def test_ratio_one_keeps_everything(name):
    c = tw.compressors.get(name, ratio=1.0)
    x = torch.randn(40, 3)
    y = c.decompress(c.compress(x, key="t"))
    if name == "stc":   # one mean magnitude: exact signs, not values
        assert torch.equal(torch.sign(y), torch.sign(x))
    else:
        assert torch.allclose(y, x)


@pytest.mark.parametrize("d,k", [(1000, 10), (1 << 17, 1311), (1 << 18, 26), (300_001, 3000)])
def test_topk_threshold_search_is_exact(d, k):
    x = _heavy(d, seed=d)
    got = torch.sort(topk_indices(x, k, torch.Generator().manual_seed(1))).values
    want = torch.sort(torch.topk(x.abs(), k).indices).values
    assert torch.equal(got, want)


def test_topk_contraction_and_payload():
    d = 1 << 16
    x = _heavy(d, 3)
    for ratio in (0.001, 0.01, 0.1):
        c = tw.compressors.get("topk", ratio=ratio)
        p = c.compress(x, key="w")
        k = num_kept(ratio, d)
        # ‖x − C(x)‖² ≤ (1 − k/d)‖x‖²  (top-k: Stich et al. 2018, arXiv 1809.07599)
        err = (x - c.decompress(p)).pow(2).sum()
        assert err <= (1 - k / d) * x.pow(2).sum()
        assert p.nbytes == k * (4 + 4) and p.tensors[1].dtype == torch.int32   # values fp32, indices int32
    small = tw.compressors.get("topk", ratio=0.1).compress(torch.randn(1000))
    assert small.tensors[1].dtype == torch.int16 and small.nbytes == 100 * (4 + 2)


def test_randomk_scaled_is_unbiased_with_the_known_variance():
    d, ratio, trials = 200, 0.1, 4000
    x = torch.randn(d)
    c = tw.compressors.get("randomk", ratio=ratio)
    outs = torch.stack([c.decompress(c.compress(x, key="w", step=s)) for s in range(trials)])
    k = num_kept(ratio, d)
    # unbiased: the Monte-Carlo mean is within a few standard errors of x
    se = math.sqrt((d / k - 1) * x.pow(2).max().item() / trials)
    assert (outs.mean(0) - x).abs().max() < 5 * se
    # E‖C(x) − x‖² = (d/k − 1)‖x‖²  (rand-k, scaled: Stich et al. 2018)
    var = (outs - x).pow(2).sum(1).mean()
    assert var.item() == pytest.approx((d / k - 1) * x.pow(2).sum().item(), rel=0.1)
    assert c.unbiased and c.linear and c.randomness == "shared"


def test_randomk_unscaled_contraction_and_shared_indices():
    d = 5000
    x = torch.randn(d)
    c = tw.compressors.get("randomk", ratio=0.05, scale=False)
    assert not c.unbiased
    y = c.decompress(c.compress(x, key="w", step=3))
    k = num_kept(0.05, d)
    assert int((y != 0).sum()) == k and torch.equal(y[y != 0], x[y != 0])
    # the same (seed, key, step) gives the same indices in another process's compressor; other steps differ
    other = tw.compressors.get("randomk", ratio=0.05, scale=False)
    assert torch.equal(other.decompress(other.compress(x, key="w", step=3)), y)
    assert not torch.equal(other.decompress(other.compress(x, key="w", step=4)), y)
    # linear: C(a) + C(b) = C(a + b) under the shared indices
    a, b = torch.randn(d), torch.randn(d)
    ca, cb, cab = (c.compress(t, key="w", step=9) for t in (a, b, a + b))
    assert torch.allclose(ca.tensors[0] + cb.tensors[0], cab.tensors[0])


def test_sampling_without_replacement_is_uniform():
    d, k = 50, 5
    counts = torch.zeros(d)
    for s in range(3000):
        idx = sample_without_replacement(d, k, torch.Generator().manual_seed(s))
        assert idx.unique().numel() == k
        counts[idx] += 1
    expected = 3000 * k / d
    assert (counts - expected).abs().max() < 5 * math.sqrt(expected)
    big = sample_without_replacement(10**6, 10**4, torch.Generator().manual_seed(0))
    assert big.unique().numel() == 10**4 and int(big.max()) < 10**6


def test_dgc_and_gaussiank_counts_and_warmup():
    d = 1 << 16
    x = _heavy(d, 5)
    k = num_kept(0.01, d)
    n_dgc = tw.compressors.get("dgc", ratio=0.01).compress(x, key="w").tensors[0].numel()
    assert 0.7 * k <= n_dgc <= 1.3 * k
    n_gk = tw.compressors.get("gaussiank", ratio=0.01).compress(torch.randn(d), key="w").tensors[0].numel()
    assert 2 * k / 3 <= n_gk <= 4 * k / 3
    # DGC warm-up: density 25% → 6.25% → 1.5625% → 0.39% over 4 stages, then the target
    assert [warmup_density(0.001, s, 400) for s in (0, 100, 200, 300, 400)] == [0.25, 0.0625, 0.015625,
                                                                             0.25 ** 4, 0.001]
    w = tw.compressors.get("dgc", ratio=0.01, warmup_steps=100)
    assert w.compress(x, key="w", step=0).tensors[0].numel() >= 0.7 * d / 4


def test_threshold_sends_exactly_the_large_ones():
    x = torch.tensor([0.5, -0.001, 0.002, -3.0, 0.0])
    c = tw.compressors.get("threshold", threshold=0.002)
    assert torch.equal(c.decompress(c.compress(x)), torch.tensor([0.5, 0.0, 0.002, -3.0, 0.0]))


def test_stc_and_qsparse_payloads_are_packed():
    d = 1 << 16
    x = _heavy(d, 7)
    k = num_kept(0.01, d)
    stc = tw.compressors.get("stc", ratio=0.01)
    p = stc.compress(x)
    assert p.nbytes == 4 * k + math.ceil(k / 8) + 4             # int32 indices, 1 bit per sign, one fp32 mean
    y = stc.decompress(p)
    mu = x[y != 0].abs().mean()
    assert torch.allclose(y[y != 0].abs(), mu.expand(k)) and torch.equal(torch.sign(y[y != 0]),
                                                                         torch.sign(x[y != 0]))
    q = tw.compressors.get("qsparse", ratio=0.01, levels=7)       # 15 levels → 4 bits each
    p = q.compress(x)
    assert p.nbytes == 4 * k + 4 * math.ceil(k / 8) + 4
    assert abs(q.nominal_bits(d) - 8 * p.nbytes / d) / q.nominal_bits(d) < 0.03
    # Q_s is unbiased on the kept values: averaged over draws, qsparse → Top_k(x)/(1+β)
    x = x[:4000]
    k = num_kept(0.01, 4000)
    beta = min(k / 49, math.sqrt(k) / 7)
    top = tw.compressors.get("topk", ratio=0.01)
    want = top.decompress(top.compress(x)) / (1 + beta)
    mean = torch.stack([q.decompress(q.compress(x)) for _ in range(300)]).mean(0)
    assert (mean - want).abs().max() < 0.2 * want.abs().max()


def test_countsketch_is_linear_and_recovers_heavy_hitters():
    d = 4096
    c = tw.compressors.get("countsketch", ratio=0.25, rows=5, heavy=0)
    a, b = torch.randn(d) * 0.01, torch.randn(d) * 0.01
    pa, pb, pab = (c.compress(t, key="g") for t in (a, b, a + b))
    assert torch.allclose(pa.tensors[0] + pb.tensors[0], pab.tensors[0], atol=1e-6)     # S(a)+S(b) = S(a+b)
    a[[3, 100, 2000]] = torch.tensor([5.0, -4.0, 3.0])
    est = c.decompress(c.compress(a, key="g"))
    assert torch.allclose(est[[3, 100, 2000]], a[[3, 100, 2000]], atol=0.1)
    assert c.compress(a, key="g").nbytes == 5 * next_prime(math.ceil(0.25 * d / 5)) * 4


def test_countsketch_heavy_hitter_recovery_single_process():
    """heavy > 0: the sketch and the exact values at the top heavy·d coordinates of its estimate (Sketched-SGD's
    second round); tiny tensors go dense; heavy = 0 is the one-round linear sketch."""
    d = 4096
    x = torch.randn(d, generator=torch.Generator().manual_seed(3)) * 0.01
    x[[3, 100, 2000]] = torch.tensor([5.0, -4.0, 3.0])
    c = tw.compressors.get("countsketch", ratio=0.25, rows=5, heavy=0.01)
    assert c.aggregation == "custom" and not c.unbiased
    p = c.compress(x, key="g")
    y = c.decompress(p)
    support = y != 0
    assert int(support.sum()) == 40 and bool(support[[3, 100, 2000]].all())
    assert torch.equal(y[support], x[support])                       # exact values, not estimates
    assert p.nbytes * 8 / d == pytest.approx(c.nominal_bits(d))
    assert c.nominal_bits(d) == 32 * (5 * next_prime(math.ceil(0.25 * d / 5)) + 40) / d
    tiny = torch.randn(8)                                            # 5·2 + 1 floats >= 8: dense
    assert torch.equal(c.decompress(c.compress(tiny, key="t")), tiny) and c.nominal_bits(8) == 32.0
    assert tw.compressors.get("countsketch", heavy=0).aggregation == "allreduce"
    with pytest.raises(UserError):
        tw.compressors.get("countsketch", heavy=1.5)


def test_powersgd_single_process():
    c = tw.compressors.get("powersgd", rank=2)
    u, v = torch.randn(30, 1), torch.randn(1, 20)
    m = u @ v                                            # rank 1: one power iteration recovers it exactly
    y = c.decompress(c.compress(m, key="w"))
    assert torch.allclose(y, m, atol=1e-4)
    bias = torch.randn(30)
    assert torch.equal(c.decompress(c.compress(bias, key="b")), bias)     # 1-D: uncompressed
    assert c.compress(m, key="w").nbytes == (30 + 20) * 2 * 4


def test_powersgd_rounds_equal_pytorchs_powersgd_hook_algorithm():
    """Two ranks' PowerSGD rounds (`begin`, `after_P`, `after_Q`, the sums taken by hand as the exchange takes them)
    with this rank's own contribution as the memory's, against PyTorch's `powerSGD_hook` written out: error feedback
    on the bucket against the mean approximation, Q orthogonalised before P = M Q, the sum of P orthogonalised,
    Q = Σ Mᵀ P̂ / n, warm start, 1-D tensors averaged uncompressed; the same start Q. Only the sum of the ranks'
    errors enters the next step, so the two error feedbacks give the same means (to float32's rounding: the
    compressor computes in float32)."""
    from thinwire.compress.base import Round
    from thinwire.compress.powersgd import orthogonalize
    torch.manual_seed(0)
    shapes, world = [(40, 12), (40,), (6, 40), (6,)], 2
    sizes = [math.prod(t) for t in shapes]
    comps = [tw.compressors.get("powersgd", rank=2, seed=3) for _ in range(world)]
    mems = [tw.memories.get("powersgd") for _ in range(world)]
    errors, qs = [torch.zeros(sum(sizes)) for _ in range(world)], {}
    for step in range(6):
        grads = [torch.randn(sum(sizes)) * (1 + w) for w in range(world)]
        cs = [m.compensate(g, "b") for m, g in zip(mems, grads)]
        states = [c.begin(x, "b", step, shapes, world) for c, x in zip(comps, cs)]
        while isinstance(states[0], Round):
            summed = sum(st.send for st in states)
            states = [c.advance(st, summed.clone()) for c, st in zip(comps, states)]
        for m, x, st in zip(mems, cs, states):
            m.update(x, "b", st.own)
        ins = [g + e for g, e in zip(grads, errors)]
        parts = [x.split(sizes) for x in ins]
        mean = []
        for i, shape in enumerate(shapes):
            mats = [p[i] for p in parts]
            if len(shape) == 1:
                mean.append(sum(mats) / world)
                continue
            a, b = shape
            if i not in qs:
                fresh = tw.compressors.get("powersgd", rank=2, seed=3)        # the start Q, drawn as ours draws it
                qs[i] = fresh._start("b", (sum(sizes[:i]), a, b, 2), 0, "cpu")
            q = orthogonalize(qs[i].clone())
            p_hat = orthogonalize(sum(m.view(a, b) @ q for m in mats))
            qs[i] = sum(m.view(a, b).t() @ p_hat for m in mats) / world
            mean.append((p_hat @ qs[i].t()).reshape(-1))
        mean = torch.cat(mean)
        errors = [x - mean for x in ins]
        assert torch.allclose(states[0].total / world, mean, atol=1e-5 * float(mean.abs().max()), rtol=0), step


def test_error_feedback_invariants():
    """Σ sent + final memory = Σ inputs (PowerSGD's EF); DGC: Σ sent + v = Σ u (its momentum-corrected input)."""
    torch.manual_seed(0)
    comp = tw.compressors.get("topk", ratio=0.05)
    mem = tw.memories.get("powersgd")
    inputs, sent_total = torch.zeros(500), torch.zeros(500)
    for s in range(20):
        g = torch.randn(500)
        inputs += g
        c = mem.compensate(g, "w")
        sent = comp.decompress(comp.compress(c, "w", s))
        mem.update(c, "w", sent)
        sent_total += sent
    assert torch.allclose(sent_total + mem.e["w"], inputs, atol=1e-4)

    dgc = tw.memories.get("dgc", momentum=0.5)
    u_total, sent_total, u_prev = torch.zeros(500), torch.zeros(500), torch.zeros(500)
    for s in range(20):
        g = torch.randn(500)
        u_expect = 0.5 * u_prev + g
        c = dgc.compensate(g, "w")
        assert torch.allclose(dgc.u["w"], u_expect)
        u_total += dgc.u["w"]
        sent = comp.decompress(comp.compress(c, "w", s))
        dgc.update(c, "w", sent)
        assert torch.all(dgc.u["w"][sent != 0] == 0) and torch.all(dgc.v["w"][sent != 0] == 0)  # masking
        u_prev = dgc.u["w"]
        sent_total += sent
    assert torch.allclose(sent_total + dgc.v["w"], u_total, atol=1e-4)
    state = dgc.state_dict()
    fresh = tw.memories.get("dgc", momentum=0.5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.v["w"], dgc.v["w"])


def test_dgc_local_clipping_threshold():
    mem = tw.memories.get("dgc", momentum=0.0, clip_norm=2.0)
    mem.setup(4)
    v = mem.compensate(torch.full((100,), 1.0), "w")
    assert v.norm().item() == pytest.approx(2.0 / math.sqrt(4))      # DGC's local clipping (arXiv 1712.01887): N^-1/2 · thr
    small = mem.compensate(torch.full((100,), 0.001), "x")
    assert torch.allclose(small, torch.full((100,), 0.001))


def test_bit_accounting_matches_nominal():
    d = 1 << 18
    x = _heavy(d, 11)
    for name in ["topk", "randomk", "stc", "qsparse", "countsketch"]:
        c = tw.compressors.get(name)
        actual = 8 * c.compress(x, key="w").nbytes / d
        assert abs(actual - c.nominal_bits(d)) <= 0.03 * c.nominal_bits(d), name


def test_codes_and_wire_round_trip():
    for bits in range(1, 9):
        codes = torch.randint(0, 2 ** bits, (37,))
        assert torch.equal(unpack_codes(pack_codes(codes, bits), 37, bits), codes)
    parts = [torch.randn(5), torch.arange(7, dtype=torch.int16), torch.tensor([1, 2], dtype=torch.uint8),
             torch.randn(3).half(), torch.empty(0, dtype=torch.int32)]
    buf = wire.pack(parts)
    assert buf.dtype == torch.uint8 and buf.numel() == wire.packed_size(parts)
    for a, b in zip(parts, wire.unpack(buf)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert index_dtype(1 << 15) == torch.int16 and index_dtype((1 << 15) + 1) == torch.int32


def test_bad_parameters_raise_user_errors():
    for name, params in [("topk", {"ratio": 0}), ("randomk", {"ratio": 1.5}), ("countsketch", {"rows": 0}),
                         ("powersgd", {"rank": 0}), ("qsparse", {"levels": 0}), ("threshold", {"threshold": -1}),
                         ("dgc", {"sample": 0})]:
        with pytest.raises(UserError):
            tw.compressors.get(name, **params)
    with pytest.raises(UserError):
        tw.memories.get("dgc", momentum=1.0)


def test_mask_indices_and_select_beyond_match_nonzero():
    g = torch.Generator().manual_seed(4)
    for n in (13, (1 << 16) + 5):
        for density in (0.0, 0.001, 0.05, 0.9, 1.0):
            mask = torch.rand(n, generator=g) < density
            got = mask_indices(mask)                  # dense masks: int32, full 8-flag words first
            assert torch.equal(torch.sort(got.long()).values, torch.nonzero(mask).squeeze(1)), (n, density)
            if density <= 0.01 and n >= 1 << 16:    # < 1/4 of the words hit: the sparse path
                assert got.dtype == torch.int64 and bool((got[1:] > got[:-1]).all())
    scratch = Scratch()
    x = torch.randn(1 << 17, generator=g)
    for thr, center in ((2.5, 0.0), (0.01, 0.0), (1.0, 0.3), (0.0, 0.0)):
        got, dev = select_beyond(x, thr, center, scratch)
        want = torch.nonzero((x - center).abs() >= thr if thr > 0 else x != center).squeeze(1)
        assert torch.equal(torch.sort(got.long()).values, want) and dev is not None


def test_threshold_default_and_nominal():
    assert tw.compressors.get("threshold").threshold == 0.01
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    c = tw.compressors.get("threshold", threshold=2.576)           # nominal: N(0, 1) entries
    p = c.compress(x, key="w")
    assert abs(8 * p.nbytes / x.numel() - c.nominal_bits(x.numel())) <= 0.03 * c.nominal_bits(x.numel())
    assert torch.equal(c.decompress(p), torch.where(x.abs() >= 2.576, x, torch.zeros(())))


def test_large_tensor_counts_are_within_three_percent_of_nominal():
    """dgc keeps its count in [0.97k, 1.03k] (exact top-k of the candidates above that); gaussiank fits μ, σ on
    the whole tensor, so on normal data it lands near k; randomk and powersgd are exact."""
    d = 1 << 20
    x = torch.randn(d, generator=torch.Generator().manual_seed(6))
    for name in ("dgc", "gaussiank", "randomk"):
        c = tw.compressors.get(name)
        for step in range(3):
            actual = 8 * c.compress(x, key="w", step=step).nbytes / d
            assert abs(actual - c.nominal_bits(d)) <= 0.03 * c.nominal_bits(d), (name, step, actual)
    heavy = _heavy(d, 8)
    n = tw.compressors.get("dgc").compress(heavy, key="w").tensors[0].numel()
    assert 0.97 * num_kept(0.01, d) <= n <= 1.03 * num_kept(0.01, d)
    p = tw.compressors.get("powersgd")
    m = torch.randn(1024, 1024 // 4)
    assert 8 * p.compress(m, key="m").nbytes / m.numel() == p.nominal_bits(m.numel())
    assert p.nominal_bits(30 * 20 + 30, shapes=[(30, 20), (30,)]) == 32.0 * ((30 + 20) * 2 + 30) / 630


def test_randomk_indices_are_sorted_and_distinct():
    for d, k in ((1 << 20, 10_000), (1000, 10), (100, 25)):       # k <= d / 4: the sorted draw
        idx = sample_without_replacement(d, k, torch.Generator().manual_seed(d))
        assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all()) and 0 <= int(idx[0]) and int(idx[-1]) < d


def test_countsketch_structured_hash_is_the_sketch_and_unbiased_with_one_row():
    d = 5000
    x = torch.randn(d, generator=torch.Generator().manual_seed(9))
    for rows, ratio in ((3, 0.1), (2, 0.001)):             # (2, 0.001): nb > c, fully random buckets
        c = tw.compressors.get("countsketch", ratio=ratio, rows=rows)
        p = c.compress(x, key="k")
        slots, signs, cols, nb = c._hash("k", d)
        ref = torch.zeros(rows * 2 * cols)
        for j in range(rows):                               # the definition, one element at a time (vectorised)
            z = torch.zeros(nb * cols)
            z[:d] = x
            if signs is not None:
                z = (z.view(nb, cols) * signs[j]).view(-1)
            ref.index_add_(0, slots[j].long(), z)
        ref = ref.view(rows, 2, cols)
        assert torch.allclose((ref[:, 0] - ref[:, 1]).reshape(-1), p.tensors[0], atol=1e-4)
    trials, d = 600, 400
    x = torch.randn(d, generator=torch.Generator().manual_seed(10))
    est = torch.stack([tw.compressors.get("countsketch", ratio=0.2, rows=1, heavy=0, seed=s).decompress(
        tw.compressors.get("countsketch", ratio=0.2, rows=1, heavy=0, seed=s).compress(x, key="k"))
        for s in range(trials)])
    se = math.sqrt(float(x.pow(2).sum()) / next_prime(80) / trials)   # Var <= ||x||^2 / c per estimate
    assert float((est.mean(0) - x).abs().max()) < 5 * se


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_grouped_topk_is_torch_topk_per_row(dtype):
    """The chunked compressors' CPU top-k per row (group maxima first, numpy's partition for the k-th value)
    keeps the same magnitudes as torch.topk, on random rows, on rows of ties (the fallback) and on zeros."""
    from thinwire.compress._chunks import group_size, grouped_topk
    g = torch.Generator().manual_seed(5)
    assert (group_size(4096, 64), group_size(1024, 32), group_size(64, 4), group_size(1000, 8)) == (8, 4, 0, 8)
    for rows, width, k in ((300, 4096, 64), (3, 1024, 32), (131, 1000, 8)):
        for x in (torch.randn(rows, width, generator=g), torch.randint(-3, 4, (rows, width), generator=g).float(),
                  torch.zeros(rows, width), (torch.rand(rows, width, generator=g) < 1e-3).float()):
            x = x.to(dtype)
            got = grouped_topk(x, k, group_size(width, k))
            want = torch.topk(x.abs(), k, dim=1, sorted=False).values
            assert torch.equal(torch.sort(x.abs().gather(1, got), 1).values, torch.sort(want, 1).values)
            assert torch.equal(torch.sort(got, 1).values.diff(dim=1).clamp(max=1), torch.ones(rows, k - 1,
                                                                                              dtype=torch.int64))


def test_mask_count_counts_every_length():
    from thinwire.compress.threshold import mask_count
    g = torch.Generator().manual_seed(6)
    for n in (0, 1, 7, 8, 9, 4096, 12345):
        m = torch.rand(n, generator=g) < 0.5
        assert int(mask_count(m)) == int(m.sum())
    assert int(mask_count(torch.ones(80, dtype=torch.bool))) == 80
