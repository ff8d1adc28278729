"""The Exchange across real gloo workers: every compressor, every rank the same answer, honest bytes."""
from __future__ import annotations

import math

import pytest
import torch

import thinwire as tw
from thinwire.compress._sparse import num_kept
from thinwire.errors import UserError
from thinwire.exchange import Exchange
from thinwire.exchange import wire
from thinwire.exchange.choose import wire_bits

NATURAL_MEMORY = {"dgc": "dgc", "powersgd": "powersgd", "efsignsgd": "efsignsgd"}


def _memory_for(name):
    mem = NATURAL_MEMORY.get(name, "none")
    return mem if mem in tw.memories.names() else "none"


def every_compressor_worker(rank, world_size):
    """For each registered compressor: aggregate a parameter, a bucket (flat, with shapes) and the whole
    model, twice (so warm starts, residuals and per-key steps are exercised). Returns the results by name."""
    from thinwire.comm import Transport
    out = {}
    for name in tw.compressors.names():
        ex = Exchange(Transport(), name, _memory_for(name))
        results = []
        for step in range(2):
            g = torch.Generator().manual_seed(1000 * rank + step)
            w = torch.randn(48, 20, generator=g)
            b = torch.randn(48, generator=g)
            flat = torch.cat([w.reshape(-1), b])
            results.append(ex.aggregate(w, key="w"))                                   # a parameter
            results.append(ex.start(flat, key="bucket", shapes=[(48, 20), (48,)]).wait())  # a bucket
            results.append(ex.aggregate(torch.randn(3, generator=g), key="tiny"))        # odd sizes
            results.append(ex.aggregate(torch.randn((), generator=g), key="scalar"))     # 0-d
        results.append(ex.aggregate(torch.empty(0), key="empty"))
        out[name] = results
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_identical_aggregate(world, pool2, pool4):
    pool = pool2 if world == 2 else pool4
    res = pool.run(every_compressor_worker)
    for name in res[0]:
        for i, t in enumerate(res[0][name]):
            assert t.dtype == torch.float32 and torch.isfinite(t).all(), (name, i)
            for r in range(1, world):
                assert torch.equal(t, res[r][name][i]), f"{name}: rank {r} differs on result {i}"
    shapes = [t.shape for t in res[0]["none"]]
    assert shapes[:4] == [torch.Size([48, 20]), torch.Size([48 * 21]), torch.Size([3]), torch.Size([])]


def semantics_worker(rank, world_size):
    """Exact checks: lossless paths equal the mean, all-reduce and all-gather paths agree, EF invariant."""
    from thinwire.comm import Transport
    out = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-50, 50, (1000,), generator=g).float()           # integers: every mean is exact
    means = torch.stack([torch.randint(-50, 50, (1000,), generator=torch.Generator().manual_seed(r)).float()
                         for r in range(world_size)]).mean(0)
    out["none_allreduce"] = torch.equal(Exchange(Transport(), "none").aggregate(x, "x"), means)
    out["none_allgather"] = torch.equal(Exchange(Transport(), "none", collective="allgather").aggregate(x, "x"),
                                        means)
    out["topk_full"] = torch.equal(Exchange(Transport(), tw.compressors.get("topk", ratio=1.0)).aggregate(x, "x"),
                                   means)
    if "fp16" in tw.compressors.names():
        out["fp16"] = torch.equal(Exchange(Transport(), "fp16").aggregate(x, "x"), means)
    # randomk: the shared-seed all-reduce equals the gather of the ranks' sparse payloads
    y = torch.randn(5000, generator=g)
    a = Exchange(Transport(), tw.compressors.get("randomk", ratio=0.1)).aggregate(y, "y")
    b = Exchange(Transport(), tw.compressors.get("randomk", ratio=0.1), collective="allgather").aggregate(y, "y")
    out["randomk_paths"] = float((a - b).abs().max())
    # countsketch: the all-reduced sketch's estimate equals the estimate of the sketch of the sum
    cs = tw.compressors.get("countsketch", ratio=0.5, rows=1, heavy=0)
    out["countsketch"] = Exchange(Transport(), cs).aggregate(y, "cs")
    out["y"] = y
    # countsketch + residual (heavy-hitter recovery, two rounds): the aggregate is the exact mean of the ranks'
    # compensated values on the k coordinates picked from the summed sketch, zero elsewhere, and the residual
    # keeps the rest (bounded; before: the dense median estimate grew it to ~1e5·|g| within 5 steps)
    memory = tw.memories.get("residual")
    ex = Exchange(Transport(), tw.compressors.get("countsketch", ratio=0.1, heavy=0.01), memory)
    hh = []
    for step in range(8):
        gt = torch.randn(3000, generator=g) * torch.linspace(0.01, 1, 3000)
        c = gt + memory.residuals.get("g", torch.zeros(3000))
        agg = ex.aggregate(gt, "g")
        hh.append((c, agg, float(gt.norm()), float(memory.residuals["g"].norm())))
    out["countsketch_ef"] = hh
    # powersgd's result = P̂ Qᵀ for the mean matrix when every rank holds the same M (rank-r exact case)
    m = torch.randn(40, 2, generator=torch.Generator().manual_seed(7)) @ torch.randn(
        2, 30, generator=torch.Generator().manual_seed(8))
    out["powersgd_exact"] = float((Exchange(Transport(), tw.compressors.get("powersgd", rank=2)).aggregate(m, "m")
                                   - m).abs().max())
    # EF invariant across ranks: Σ_t aggregate_t + mean_r residual_r = mean_r Σ_t g_r,t
    for comp, mem in (("topk", "powersgd"), ("powersgd", "powersgd"), ("dgc", "dgc")):
        memory = tw.memories.get(mem, momentum=0.0) if mem == "dgc" else tw.memories.get(mem)
        ex = Exchange(Transport(), comp, memory)
        total_in, total_out = torch.zeros(30, 20), torch.zeros(30, 20)
        for step in range(6):
            gt = torch.randn(30, 20, generator=g)
            total_in += gt
            total_out += ex.aggregate(gt, "w")
        resid = memory.v["w"] if mem == "dgc" else memory.e["w"]
        out[f"ef_{comp}"] = (total_in, total_out, resid)
    # start() is asynchronous: several keys in flight, waited in reverse order, same as synchronous
    ex = Exchange(Transport(), tw.compressors.get("topk", ratio=0.1))
    ts = [torch.randn(200, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    handles = [ex.start(t, f"k{i}") for i, t in enumerate(ts)]
    async_res = [h.wait() for h in reversed(handles)][::-1]
    ex2 = Exchange(Transport(), tw.compressors.get("topk", ratio=0.1))
    out["async"] = all(torch.equal(a, ex2.aggregate(t, f"k{i}")) for i, (a, t) in enumerate(zip(async_res, ts)))
    # NaN policy: a clear error before anything is sent (every rank has one here, so nobody waits)
    try:
        Exchange(Transport(), "topk").aggregate(torch.tensor([1.0, float("nan")]), "bad")
        out["nan"] = "no error"
    except FloatingPointError as e:
        out["nan"] = str(e)
    # state_dict round trip (residuals, PowerSGD's Q, per-key steps)
    ex = Exchange(Transport(), "powersgd", "powersgd")
    ex.aggregate(torch.randn(30, 20, generator=torch.Generator().manual_seed(1)), "w")
    state = ex.state_dict()
    ex_b = Exchange(Transport(), "powersgd", "powersgd")
    ex_b.load_state_dict(state)
    nxt = torch.randn(30, 20, generator=torch.Generator().manual_seed(2 + rank))
    out["resume"] = torch.equal(ex.aggregate(nxt, "w"), ex_b.aggregate(nxt, "w"))
    return out


def test_exchange_semantics(pool4):
    res = pool4.run(semantics_worker)
    n = len(res)
    for r in res:
        assert r["none_allreduce"] and r["none_allgather"] and r["topk_full"]
        assert r.get("fp16", True)
        assert r["randomk_paths"] < 1e-5
        assert r["powersgd_exact"] < 1e-3
        assert r["async"] and r["resume"]
        assert "non-finite" in r["nan"] and "'bad'" in r["nan"]
    # countsketch linearity across ranks: the all-reduced sketch decodes like the sketch of the mean
    cs = tw.compressors.get("countsketch", ratio=0.5, rows=1, heavy=0)
    mean_y = torch.stack([r["y"] for r in res]).mean(0)
    want = cs.decompress(cs.compress(mean_y, key="cs"))
    assert torch.allclose(res[0]["countsketch"], want, atol=1e-5)
    k = num_kept(0.01, 3000)
    for step in range(8):
        mean_c = sum(r["countsketch_ef"][step][0] for r in res) / n
        agg = res[0]["countsketch_ef"][step][1]
        support = agg != 0
        assert int(support.sum()) == k                          # the heavy coordinates, the same on every rank
        assert torch.allclose(agg[support], mean_c[support], atol=1e-5)
        assert all(torch.equal(r["countsketch_ef"][step][1], agg) for r in res)
        for r in res:
            _, _, g_norm, e_norm = r["countsketch_ef"][step]
            assert e_norm <= (step + 1) * 1.01 * g_norm         # the residual is what was not sent: bounded
    for comp in ("topk", "powersgd", "dgc"):
        total_in = sum(r[f"ef_{comp}"][0] for r in res) / n
        resid = sum(r[f"ef_{comp}"][2] for r in res) / n
        total_out = res[0][f"ef_{comp}"][1]
        assert torch.allclose(total_out + resid, total_in, atol=1e-4), comp


def bytes_worker(rank, world_size):
    """The meter's bytes for one exchange of each kind, next to the payload sizes."""
    from thinwire.comm import Transport
    out = {}
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
    for name, comp, coll in (("none", "none", "auto"), ("topk", tw.compressors.get("topk", ratio=0.01), "auto"),
                             ("threshold", tw.compressors.get("threshold", threshold=2.5), "auto"),
                             ("randomk", tw.compressors.get("randomk", ratio=0.01), "auto"),
                             ("qsparse", tw.compressors.get("qsparse", ratio=0.01), "auto")):
        t = Transport()
        ex = Exchange(t, comp, collective=coll)
        ex.aggregate(x, "x")
        payload = ex.compressor.compress(x, "x", 0)
        out[name] = (t.meter.totals()["bytes_sent"], payload.nbytes, wire.packed_size(payload.tensors))
    # threshold where two ranks' pairs would outweigh their tensor (61.7 % of N(0, 1) passes v = 0.5): they send
    # the tensor with the rest zeroed; the other two (a tenth of the scale) send pairs; the mean is the same
    xs = x * (1.0 if rank < 2 else 0.1)
    t = Transport()
    ex = Exchange(t, tw.compressors.get("threshold", threshold=0.5))
    got = ex.aggregate(xs, "mixed")
    payload = ex.compressor.compress(xs, "mixed", 0)
    out["mixed"] = (got, payload.nbytes, t.meter.totals()["bytes_sent"], wire.packed_size(payload.tensors))
    t = Transport()                                     # the all-gather named: it gathers whatever it costs
    gathered = Exchange(t, tw.compressors.get("threshold", threshold=0.5), collective="allgather").aggregate(xs, "g")
    out["mixed_gathered"] = (gathered, t.meter.totals()["bytes_sent"])
    t = Transport()
    m = torch.randn(200, 100)
    Exchange(t, tw.compressors.get("powersgd", rank=3)).aggregate(m, "m")
    out["powersgd"] = t.meter.totals()["bytes_sent"]
    for name in ("qsgd", "terngrad", "int8"):           # quantizers on their default path
        t = Transport()
        ex = Exchange(t, name)
        ex.aggregate(x, "x")
        out[name] = (t.meter.totals()["bytes_sent"], ex.collective_for(x.numel()),
                     len(ex.compressor.compress(x, "x", 0).tensors))
    return out


def test_bytes_on_the_wire_match_payloads(pool4):
    res = pool4.run(bytes_worker)
    n = 4
    ring = 2 * (n - 1) / n
    for r in res:
        sent, nbytes, packed = r["none"]
        assert sent == pytest.approx(ring * 4 * 100_000)
        sent, nbytes, packed = r["topk"]                      # fixed size: one gather, no size exchange
        k = num_kept(0.01, 100_000)
        assert nbytes == 8 * k and sent == (n - 1) * packed
        sent, nbytes, packed = r["randomk"]                   # values only, all-reduced
        assert sent == pytest.approx(ring * 4 * k)
        sent, nbytes, packed = r["qsparse"]
        assert sent == (n - 1) * packed
        assert r["powersgd"] == pytest.approx(ring * 4 * 3 * (200 + 100))
    # threshold: variable sizes, padded to the largest and preceded by an 8-byte size exchange per peer
    largest = max(r["threshold"][2] for r in res)
    for r in res:
        assert r["threshold"][0] == (n - 1) * (largest + 8)
    # mixed: gathering the two dense payloads would send (n − 1)·4d bytes, more than a ring all-reduce of the
    # decoded tensors (2(n − 1)/n·4d): after the size round every rank all-reduces its decoded contribution
    xs = [torch.randn(100_000, generator=torch.Generator().manual_seed(r)) * (1.0 if r < 2 else 0.1) for r in range(n)]
    want = sum(torch.where(v.abs() >= 0.5, v, torch.zeros(())) for v in xs) / n
    largest = max(r["mixed"][3] for r in res)
    assert largest > 4 * 100_000
    for rank, r in enumerate(res):
        got, nbytes, sent, _ = r["mixed"]
        kept = int((xs[rank].abs() >= 0.5).sum())
        assert nbytes == (4 * 100_000 if rank < 2 else 8 * kept)
        assert sent == pytest.approx((n - 1) * 8 + ring * 4 * 100_000)
        assert torch.allclose(got, want, atol=1e-6)
        gathered, sent = r["mixed_gathered"]
        assert sent == (n - 1) * (largest + 8) and torch.allclose(gathered, want, atol=1e-6)
        assert torch.equal(got, res[0]["mixed"][0])           # every rank the same mean
    # quantizers: the meter's bytes are what nominal_bits says at this world size, on the collective picked
    # (before: nominal_bits said 4.06 and 2 bits for qsgd and terngrad while 8-bit summed levels travelled)
    d = 100_000
    for r in res:
        for name, want in (("qsgd", "allreduce"), ("terngrad", "allgather"), ("int8", "allgather")):
            sent, coll, count = r[name]
            bits = wire_bits(tw.compressors.get(name), d, n)[1]
            assert coll == want, name
            if coll == "allreduce":
                assert sent == pytest.approx(ring * bits * d / 8), name
            else:           # the packed payload and its wire header, to n - 1 peers
                assert sent == pytest.approx((n - 1) * (bits * d / 8 + 4 + 8 * count)), name
        assert r["qsgd"][0] == pytest.approx(ring * (d + 4 * math.ceil(d / 512)))       # 8-bit levels + norms
        assert r["terngrad"][0] == (n - 1) * (math.ceil(d / 4) + 4 + 4 + 16)           # 2-bit codes + scale


class CountingTransport:
    """`world_size` ranks that all hold this process's tensor, in one process: each collective returns what that
    many equal contributions give, and its bytes are counted with the Transport's own cost functions (a ring:
    gloo's all-reduce and all-gather), so the exchange's program runs as it would at that world size."""

    def __init__(self, world_size):
        from thinwire.trace import NULL
        self.world_size, self.rank, self.allreduce, self.tracer = world_size, 0, "gloo", NULL
        self.sent, self.summed = 0.0, []

    def run(self, program, **_):
        from thinwire.comm.engine import Future, Ready, run_nested
        out = run_nested(program)
        return out if isinstance(out, Future) else Ready(out)

    def all_reduce_program(self, t, op="sum"):
        from thinwire.comm.engine import Ready
        from thinwire.net import Link, ring_allreduce
        self.sent += ring_allreduce(Link(), self.world_size, t.numel() * t.element_size()).sent
        self.summed.append(t.dtype)
        if op in ("sum", "mean"):
            t.mul_(self.world_size)
        if op == "mean":
            t.div_(self.world_size)
        return Ready(t)
        yield  # noqa: unreachable - a program

    def all_gather_program(self, t, sizes=None):
        from thinwire.comm.engine import Ready
        from thinwire.net import Link, ring_allgather
        self.sent += ring_allgather(Link(), self.world_size, t.numel() * t.element_size()).sent
        return Ready([t.reshape(-1).clone() for _ in range(self.world_size)])
        yield  # noqa: unreachable - a program


@pytest.mark.parametrize("world", [4, 19, 200])
def test_quantizer_wire_bits_at_any_world_size(world):
    """qsgd, terngrad, int8 on their default paths at 4, 19 and 200 ranks: the exchange picks the collective that
    sends fewer bytes, sums in the type `wire_bits(comp, d, world_size)` counts (at 19 ranks qsgd's levels need
    int16, which gloo sums as int32: as many bytes as fp32), and the counted bytes are those bits."""
    d = 3000
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    want = {4: {"qsgd": ("allreduce", torch.int8), "terngrad": ("allgather", None), "int8": ("allgather", None)},
            19: {"qsgd": ("allreduce", torch.int32), "terngrad": ("allreduce", torch.int8),
                 "int8": ("allreduce", torch.int32)},
            200: {"qsgd": ("allreduce", torch.int32), "terngrad": ("allreduce", torch.int32),
                  "int8": ("allreduce", torch.int32)}}[world]
    for name, (coll, dtype) in want.items():
        tp = CountingTransport(world)
        ex = Exchange(tp, name)
        comp = ex.compressor
        assert ex.collective_for(d) == coll == wire_bits(comp, d, world)[0], name
        y = ex.aggregate(x, "x")
        bits = wire_bits(comp, d, world)[1]
        ring_ar, ring_ag = 2 * (world - 1) / world, world - 1
        if coll == "allreduce":
            assert tp.summed[-1] == dtype, name      # the widened levels, after the agreed scale's max
            assert tp.sent == pytest.approx(ring_ar * bits * d / 8), name
            assert bits > comp.nominal_bits(d) + 3.9     # more than the packed codes
        else:
            count = len(comp.compress(x, "x", 0).tensors)
            assert tp.sent == pytest.approx(ring_ag * (bits * d / 8 + 4 + 8 * count)), name
            assert bits == comp.nominal_bits(d)
        # every rank holding x: the mean is this rank's own quantized x (no overflow of the widened sum)
        scale = float(x.abs().max()) if name != "qsgd" else float(x.norm())
        assert float((y - x).abs().max()) <= scale, name
        # the other collective would have sent more (or as much)
        other = "allgather" if coll == "allreduce" else "allreduce"
        forced = Exchange(CountingTransport(world), comp, collective=other)
        forced.aggregate(x, "x")
        assert forced.transport.sent >= tp.sent * 0.999, name


@pytest.mark.parametrize("world", [4, 8])
def test_gathered_payload_goes_dense_where_that_sends_less(world):
    """top-k at ratio 0.3 of 4000 elements (fp32 values, int16 indices: 14.4 bits per element, gathered): at 4
    ranks the gather of 3 payloads sends less than a ring all-reduce of the decoded fp32 tensors
    (3 · 14.4 < 2 · 3/4 · 32 bits per element); at 8 ranks it sends more (7 · 14.4 > 2 · 7/8 · 32), so the
    exchange all-reduces the decoded tensors: the same mean, the bytes `wire_bits` predicts. Naming the
    all-gather keeps it."""
    d = 4000
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    comp = tw.compressors.get("topk", ratio=0.3)
    tp = CountingTransport(world)
    y = Exchange(tp, comp).aggregate(x, "x")
    coll, bits = wire_bits(comp, d, world)
    assert coll == ("allgather" if world == 4 else "allreduce")
    forced = Exchange(CountingTransport(world), comp, collective="allgather")
    z = forced.aggregate(x, "x")
    if coll == "allreduce":
        assert bits == 32.0 and tp.sent == pytest.approx(2 * (world - 1) / world * 4 * d)
        assert tp.summed == [torch.float32]
        assert forced.transport.sent > tp.sent
    else:
        assert bits == pytest.approx(14.4) and tp.sent == forced.transport.sent and not tp.summed
    assert torch.allclose(y, z, rtol=1e-6, atol=1e-6)
    assert torch.allclose(z, comp.decompress(comp.compress(x, "x", 0)), rtol=1e-6, atol=1e-6)


def test_dense_or_gathered_by_what_it_costs_on_the_link():
    """A payload of 0.6 of its tensor at 4 ranks: gathering sends 3 · 0.6 = 1.8 tensors, a ring all-reduce of the
    decoded tensors 1.5. Where the link costs nothing (no link, `lan`) bytes decide: dense. On `world` (150 ms
    one-way, gloo's round trip per step) the all-reduce's 3 extra start-ups cost 0.9 s: a 100 KB tensor stays
    gathered; at 100 MB the 30 MB it saves (4.8 s at 50 Mbit/s) outweigh them: dense. The planner's `wire_bits`
    follows the link it is given."""
    from thinwire.exchange.choose import dense_is_cheaper
    from thinwire.net.link import parse_network
    world = parse_network("world").handshaking()
    for d in (25_000, 25_000_000):
        dense, gathered = 4 * d, 0.6 * 4 * d
        assert dense_is_cheaper(gathered, dense, 4)
        assert dense_is_cheaper(gathered, dense, 4, "gloo", parse_network("lan").handshaking())
        assert dense_is_cheaper(gathered, dense, 4, "gloo", world) == (d > 1_000_000)
    assert not dense_is_cheaper(2.0, 1.0, 1)
    comp = tw.compressors.get("topk", ratio=0.3)          # 14.4 bits per element at 8 ranks: dense by bytes
    assert wire_bits(comp, 4000, 8)[0] == "allreduce"
    assert wire_bits(comp, 4000, 8, "gloo", world) == ("allgather", pytest.approx(14.4))
    assert wire_bits(comp, 30_000, 8, "gloo", world)[0] == "allgather"


def test_construction_errors():
    class FakeTransport:
        world_size, rank = 2, 0
    t = FakeTransport()
    with pytest.raises(UserError, match="valid: allgather"):
        Exchange(t, "topk", collective="allreduce")
    with pytest.raises(UserError, match="valid: custom"):
        Exchange(t, "powersgd", collective="allgather")
    with pytest.raises(UserError, match="unknown collective"):
        Exchange(t, "none", collective="ring")
    with pytest.raises(UserError):
        Exchange(t, "none", bogus=1)
    assert Exchange(t, "randomk", collective="allgather").collective == "allgather"
    assert math.isclose(Exchange(t, "topk").compressor.ratio, 0.01)


def test_the_guard_is_given_at_construction_and_read_with_every_check():
    """The exchange reads the guard it was given (`read_with`), in its own finiteness check: no attribute set
    afterwards, and the algorithms' factory hands the training's to every exchange it makes."""
    from thinwire.algorithms.base import Context
    from thinwire.compress.finite import NonFiniteError

    class FakeTransport:
        world_size, rank = 2, 0

    class Guard:
        def __init__(self, verdict):
            self.verdict, self.reads = verdict, 0

        def read_with(self, extra):
            self.reads += 1
            if not self.verdict:
                raise NonFiniteError("an earlier gradient")
            return extra.tolist()

    t, ok = FakeTransport(), Guard(True)
    ex = Exchange(t, "topk", guard=ok)
    assert ex.guard is ok and Exchange(t, "topk").guard is None
    ex._begin(torch.ones(3), "k")
    assert ok.reads == 1
    with pytest.raises(NonFiniteError, match="key 'k'"):        # the guard's verdict holds; this tensor's does not
        ex._begin(torch.tensor([1.0, float("nan")]), "k")
    with pytest.raises(NonFiniteError, match="an earlier gradient"):
        Exchange(t, "topk", guard=Guard(False))._begin(torch.ones(3), "k")
    ctx = Context(None, None, [], None, t, None, tw.compressors.get("topk"), tw.memories.get("none"), finite=ok,
                  collectives={"sparse_collective": "gtopk"})
    mine, plain = ctx.exchange(), ctx.exchange(Exchange, "none", "none")
    assert mine.guard is ok and plain.guard is ok
    assert mine.sparse is not None and plain.sparse is None     # the user's collective: the training's compressor's
