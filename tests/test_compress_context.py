"""`Compressor.context`: a payload's decompression context from what every rank knows, for a receiver that did not
compress (the parameter server decoding pushes, a worker decoding the server's compressed reply). It replaces the
old way, compressing a tensor of zeros to read its ctx, which changed the state of the stateful compressors."""
from __future__ import annotations

import copy

import pytest
import torch

from thinwire.compress import Payload, compressors

CODED = ["qsgd+elias", "qsgd+huffman", "topk+golomb", "stc+elias", "qsparse+eliasdelta", "dgc+elias"]
NAMES = compressors.names() + CODED


def _same(a, b) -> bool:
    """Deep equality of state dicts (tensors bitwise, generator states included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_context_decodes_like_the_payloads_own_ctx_and_changes_no_state(name):
    sender = compressors.get(name)
    receiver = compressors.get(name)                  # never compresses: it only decodes
    gen = torch.Generator().manual_seed(1)
    for shape, dtype in (((1000,), torch.float32), ((37, 5), torch.float32), ((1,), torch.float32)):
        for key, step in ((("bucket:0-3", 0), 0), ("other", 7)):
            x = torch.randn(shape, generator=gen, dtype=dtype)
            p = sender.compress(x, key=key, step=step)
            before = copy.deepcopy(receiver.state_dict())
            ctx = receiver.context(shape, dtype, key, step)
            assert _same(receiver.state_dict(), before), name
            # as it arrives over the wire: 1-D tensors, the receiver's own context
            wired = Payload([t.detach().reshape(-1).clone() for t in p.tensors], ctx)
            want = sender.decompress(p)
            got = receiver.decompress(wired)
            assert got.reshape(want.shape).dtype == want.dtype
            assert torch.equal(got.reshape(want.shape), want), (name, shape, dtype, key, step)
            assert _same(receiver.state_dict(), before), name


def test_compressing_zeros_changed_the_state_of_the_stateful_compressors():
    """Why `context` exists: the old PS learned a payload's ctx by compressing zeros, which advanced the local
    random streams (qsgd, terngrad, natural, stochastic int8) and overwrote signum's momentum."""
    changed = []
    for name in ("qsgd", "terngrad", "natural", "signum", "topk"):
        c = compressors.get(name)
        c.compress(torch.randn(64), key="k", step=0)          # in use: its state exists
        before = copy.deepcopy(c.state_dict())
        c.context((64,), torch.float32, "k", 1)
        assert _same(c.state_dict(), before), name            # the new way: untouched
        c.compress(torch.zeros(64), key="k", step=1)          # the old way
        if not _same(c.state_dict(), before):
            changed.append(name)
    assert changed == ["qsgd", "terngrad", "natural", "signum"]     # (topk has no state)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_is_safe_beside_decoding_and_encoding_on_other_threads(name):
    """An exchange's decompression runs on whichever thread first asks for its result (the training thread, the
    callback thread) while other buckets are decoded and the engine's thread compresses the next one: a scratch
    buffer shared between calls gave a rank wrong values now and then (natural, countsketch: ranks ended with
    different models)."""
    import threading
    c = copy.deepcopy(compressors.get(name))       # as probed: a copy decodes safely too
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(100_000 + 1000 * i, generator=gen) for i in range(3)]
    ps = [c.compress(x, key=("k", i), step=0) for i, x in enumerate(xs[:2])]
    want = [c.decompress(p).clone() for p in ps]
    wrong, stop = [], threading.Event()

    def decode(i):
        for _ in range(50):
            if not torch.equal(c.decompress(ps[i]), want[i]):
                wrong.append(i)

    def encode():
        step = 1
        while not stop.is_set():
            c.compress(xs[2], key=("k", 2), step=step)
            step += 1
    threads = [threading.Thread(target=decode, args=(i,)) for i in (0, 1)]
    encoder = threading.Thread(target=encode)
    for t in threads + [encoder]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    encoder.join()
    assert not wrong, f"{name}: {len(wrong)} of 100 decodes differed"


@pytest.mark.parametrize("name", ["qsparse", "qsgd", "terngrad", "natural", "randomk", "topk"])
def test_the_contraction_probes_measure_the_same_on_every_rank(name, monkeypatch):
    """CHOCO's γ and a PS downlink's scale come from probes each rank runs: a compressor's per-rank stream (qsparse's
    rounding, seeded by the rank on first use) gave every rank its own numbers, so CHOCO's γ differed by rank."""
    from thinwire.compress import _sparse, base, rounding
    seen = set()
    for r in range(3):
        monkeypatch.setattr(rounding, "rank", lambda r=r: r)
        monkeypatch.setattr(_sparse, "rank", lambda r=r: r)
        seen.add(base.contractive_scale(compressors.get(name), "probe", "it would not converge"))
    assert len(seen) == 1
