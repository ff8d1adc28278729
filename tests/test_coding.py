"""The lossless coding stage (single process): every coder gives back exactly what it was given, on random and
adversarial inputs; coded payloads are smaller than the uncoded ones on realistic gradients and at most a
bounded header larger on max-entropy inputs; "compressor+coder" composes by name."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.compress import coders, compressors
from thinwire.compress.coding import entropy_bits
from thinwire.errors import UserError

CODERS = ("elias", "eliasdelta", "golomb", "huffman")
COMPOSED = ("qsgd+elias", "qsgd+eliasdelta", "qsgd+huffman", "topk+golomb", "topk+elias", "dgc+golomb",
            "gaussiank+eliasdelta", "threshold+golomb", "stc+golomb", "qsparse+golomb")


def _roundtrip(name, v):
    c = coders.get(name)
    head, data = c.encode(v)
    assert head.dtype == torch.int32 and data.dtype == torch.uint8
    out = c.decode(head, data)
    assert torch.equal(out, v.to(torch.int64)), name
    return 8 * data.numel() + 32 * head.numel()


@pytest.mark.parametrize("name", CODERS)
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2 ** 31 - 1), max_size=300))
def test_lossless_on_random_integers(name, values):
    _roundtrip(name, torch.tensor(values, dtype=torch.int64))


@pytest.mark.parametrize("name", CODERS)
@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=1, max_value=12), st.integers(min_value=0, max_value=5000),
       st.integers(min_value=0, max_value=10 ** 6))
def test_lossless_on_geometric_and_small_alphabets(name, bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    _roundtrip(name, torch.randint(0, 1 << bits, (n,), generator=g))
    _roundtrip(name, torch.poisson(torch.full((n,), float(bits)), generator=g).to(torch.int64))


@pytest.mark.parametrize("name", CODERS)
def test_adversarial_inputs(name):
    n = 20000
    for v in (torch.zeros(n, dtype=torch.int64), torch.full((n,), 7), torch.zeros(0, dtype=torch.int64),
              torch.tensor([0, 2 ** 31 - 1, 1, 0, 2 ** 20]), torch.arange(n)):
        _roundtrip(name, v)
    cost = _roundtrip(name, torch.zeros(n, dtype=torch.int64))
    assert cost <= n + 128                            # one bit per zero and a header
    # max entropy for a 16-symbol alphabet: Huffman meets the 4 bits plus a bounded header (its table)
    v = torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(1))
    cost = _roundtrip(name, v)
    if name == "huffman":
        assert cost <= 4 * n + 32 * (2 + 2 * 16) + 8
    else:
        assert cost <= 12 * n                         # Elias/Golomb: bounded expansion on the worst case


def test_composed_payloads_are_lossless_and_smaller_on_gradients():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(3)) * torch.rand(20000) ** 3
    for name in COMPOSED:
        comp = compressors.get(name)
        base = compressors.get(name.split("+")[0])
        assert comp.aggregation == "allgather" and not comp.linear
        p, pb = comp.compress(x, "k", 2), base.compress(x, "k", 2)
        # the coded payload decodes to the compressor's payload: the same decompressed tensor, bit for bit
        assert torch.equal(comp.decompress(p), base.decompress(pb)), name
        assert torch.equal(comp.aggregate([p, p]), base.aggregate([pb, pb])), name
        assert p.nbytes < pb.nbytes, (name, p.nbytes, pb.nbytes)
        # on N(0, 1) entries threshold's default v keeps 99%: coded gaps cannot beat the dense tensor it sends
        # then, and the coded payload is that dense tensor plus the coder's header
        if base.nominal_bits(20000) < 32:
            assert comp.nominal_bits(20000) < base.nominal_bits(20000), name
        else:
            assert comp.nominal_bits(20000) <= 32 + 8 * 16 / 20000, name


def test_a_sparse_payload_never_outweighs_the_tensor():
    """Where (value, index) pairs would weigh more than the tensor, a sparsifier sends the tensor with the
    dropped entries zeroed (coded or not); it decodes, and sums with sparse payloads, as the pairs would."""
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(4))
    for name, params in (("threshold", {}), ("threshold", {"threshold": 0.5}), ("topk", {"ratio": 0.9}),
                         ("threshold+golomb", {}), ("dgc", {"ratio": 0.8})):
        comp = compressors.get(name, **params)
        p = comp.compress(x, "k", 1)
        assert p.nbytes <= x.nbytes + 16, (name, p.nbytes)
        y = comp.decompress(p)
        if name.startswith("threshold"):
            v = params.get("threshold", 0.01)
            assert torch.equal(y, torch.where(x.abs() >= v, x, torch.zeros(()))), name
    # a dense payload and a sparse one (another rank's, fewer kept) sum in rank order
    dense = compressors.get("threshold", threshold=0.01)
    sparse = compressors.get("threshold", threshold=2.0)
    pd, ps = dense.compress(x), sparse.compress(x)
    assert pd.tensors[1].numel() == 0 and ps.tensors[1].numel() > 0
    want = dense.decompress(pd) + sparse.decompress(ps)
    assert torch.equal(dense.aggregate([pd, ps]), want)
    assert torch.equal(dense.aggregate([ps, pd]), sparse.decompress(ps) + dense.decompress(pd))


def test_elias_levels_beat_fixed_width_and_track_the_entropy():
    from thinwire.compress.bitpack import unpack
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    q = compressors.get("qsgd", levels=7)
    codes = unpack(q.compress(x).tensors[0], q.bits, x.numel()).long()
    h = entropy_bits(codes)
    coded = compressors.get("qsgd+elias", levels=7).compress(x).tensors[1].numel() * 8 / x.numel()
    huff = compressors.get("qsgd+huffman", levels=7).compress(x).tensors[1].numel() * 8 / x.numel()
    assert h <= huff <= h + 1                         # Huffman: within one bit of the entropy
    assert h <= coded < q.bits                        # Elias: above the entropy, below the 4-bit fixed width


def test_max_entropy_sparse_indices_cost_at_most_a_header_more():
    """Dense selections (ratio 1: every gap is 0) and uniform random ones: coded ≤ uncoded + a bounded header."""
    x = torch.randn(30000, generator=torch.Generator().manual_seed(5))
    for ratio in (1.0, 0.5, 0.01):
        p = compressors.get("topk+golomb", ratio=ratio).compress(x)
        pb = compressors.get("topk", ratio=ratio).compress(x)
        assert p.nbytes <= pb.nbytes + 16, ratio


def test_composition_errors_and_parameters():
    assert compressors.get("qsgd+elias", levels=3).base.levels == 3
    assert compressors.get("topk+golomb", ratio="0.1").base.ratio == 0.1       # CLI strings converted
    assert "ratio" in compressors.parameters("topk+golomb")
    with pytest.raises(UserError, match="valid coders"):
        compressors.get("qsgd+golomb")
    with pytest.raises(UserError, match="valid coders"):
        compressors.get("topk+huffman")
    with pytest.raises(UserError, match="neither"):
        compressors.get("signsgd+elias")
    with pytest.raises(UserError, match="unknown coder"):
        compressors.get("qsgd+zip")
    with pytest.raises(UserError, match="unknown compressor"):
        compressors.get("nope+elias")


def test_entropy_helper():
    assert entropy_bits(torch.zeros(10)) == 0.0
    assert math.isclose(entropy_bits(torch.arange(16).repeat(4)), 4.0)
