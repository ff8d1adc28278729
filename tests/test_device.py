"""Device-agnostic thinwire (issue 20): every compressor, memory and algorithm keeps the tensors it makes on the
gradient's device. Each test runs on "cpu" and, where torch sees a GPU, on "cuda" (the `device` fixture)."""
from __future__ import annotations

import pytest
import torch

import thinwire as tw
from thinwire.errors import UserError

CODED = ["topk+golomb", "topk+elias", "qsgd+huffman"]


def _get(name):
    if "+" in name:
        return tw.compressors.compose(name)()
    return tw.compressors.get(name)


def _on(t: torch.Tensor, device: str) -> bool:
    return t.device.type == torch.device(device).type


@pytest.mark.parametrize("name", tw.compressors.names() + CODED)
def test_every_compressor_stays_on_the_gradients_device(name, device):
    comp = _get(name)
    for shape in [(0,), (7,), (33, 17), (70_000,)]:      # 70k: past the sparse selection's small-tensor path
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
        ps = [comp.compress(x * (r + 1), key=("t", shape), step=2) for r in range(2)]
        assert all(_on(t, device) for p in ps for t in p.tensors), (name, shape)
        y = comp.decompress(ps[0])
        s = comp.aggregate(ps)
        assert y.shape == x.shape and s.shape == x.shape and _on(y, device) and _on(s, device), (name, shape)
        assert torch.isfinite(s.float()).all(), (name, shape)


@pytest.mark.parametrize("memory", tw.memories.names())
def test_every_memory_stays_on_the_gradients_device(memory, device):
    comp = tw.compressors.get(memory if memory in tw.compressors.names() else "topk")
    mem = tw.memories.get(memory)
    mem.setup(2)
    g = torch.randn(64, 9, generator=torch.Generator().manual_seed(2)).to(device)
    for step in range(3):
        c = mem.compensate(g, "w")
        p = comp.compress(c, key="w", step=step)
        mem.update(c, "w", comp.decompress(p))
        assert _on(c, device) and all(_on(t, device) for t in p.tensors), (memory, step)
    assert all(_on(t, device) for t in mem.state_dict().get("residuals", {}).values())


def test_the_cpu_result_is_the_same_on_every_device(device):
    """Shared randomness comes from host generators: the same seed picks the same indices on any device."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    for name in ("randomk", "countsketch", "qsgd", "dgc"):
        comp_cpu, comp_dev = tw.compressors.get(name), tw.compressors.get(name)
        want = comp_cpu.decompress(comp_cpu.compress(x, key="k", step=1))
        got = comp_dev.decompress(comp_dev.compress(x.to(device), key="k", step=1)).cpu()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), name


@pytest.fixture
def one_process_group(device):
    """torch.distributed with this process alone (gloo on the CPU, NCCL on a GPU), torn down after the test."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield device
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("algorithm,params", [
    ("bsp", {}),
    ("bsp", {"compressor": "topk", "memory": "residual", "ratio": 0.1}),
    ("dts", {"delay": 2, "period": 2}),
    ("cdsgd", {}),
    ("localsgd", {}),
])
def test_a_model_on_the_device_trains_through_the_trainer(one_process_group, algorithm, params):
    device = one_process_group
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = tw.Trainer(model, opt, algorithm=algorithm, **params)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(64, 12, generator=g).to(device), torch.randint(3, (64,), generator=g).to(device)
    first = None
    try:
        for _ in range(12):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            first = float(loss.detach()) if first is None else first
            loss.backward()
            trainer.step()
            opt.zero_grad()
    finally:
        trainer.close()
    assert all(_on(p, device) for p in model.parameters())
    assert float(torch.nn.functional.cross_entropy(model(x), y).detach()) < first


def test_launch_rejects_a_device_it_cannot_serve():
    from thinwire.launcher.pool import pick_backend
    assert pick_backend(None, None) == ("gloo", "cpu")
    assert pick_backend("gloo", "cpu") == ("gloo", "cpu")
    with pytest.raises(UserError, match="valid: cpu, cuda"):
        tw.launch(abs, world_size=1, device="tpu")
    with pytest.raises(UserError, match="needs device cuda"):
        pick_backend("nccl", "cpu")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not have:
        with pytest.raises(UserError, match="no GPU"):
            pick_backend(None, "cuda", 1)
    else:   # one process per GPU on NCCL; more processes than GPUs share them over gloo (NCCL cannot)
        assert pick_backend(None, "cuda", have) == ("nccl", "cuda")
        assert pick_backend(None, "cuda", have + 1) == ("gloo", "cuda")
        assert pick_backend("gloo", "cuda", 1) == ("gloo", "cuda")
        with pytest.raises(UserError, match="NCCL takes one process per GPU"):
            pick_backend("nccl", "cuda", have + 1)


# -- host reads (issue 20): a value a device tensor can carry stays on the device --------------------------------
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch, device):
    """Counts every read of a tensor's value by the host (`.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)`);
    on CUDA, any synchronising call also raises (torch's sync debug mode), so a copy through the host is caught
    however it is written."""
    counts = {"n": 0}
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)

    class Guard:
        def __enter__(self):
            counts["n"] = 0
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            return counts

        def __exit__(self, *exc):
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    return Guard


@pytest.mark.parametrize("name", ["onebit", "efsignsgd", "signsgd", "terngrad", "fp4", "natural", "int8"])
def test_decompressing_reads_nothing_on_the_host(name, device, host_reads):
    """Per-tensor scales and means stay on the device: decompress and aggregate of gathered payloads read no
    value on the host (terngrad and int8 through their payload's scale, not an agreed one)."""
    comp = tw.compressors.get(name)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5)).to(device)
    ps = [comp.compress(x * (r + 1), key="h", step=1) for r in range(3)]
    want = [comp.decompress(p).cpu() for p in ps]
    with host_reads() as n:
        got = [comp.decompress(p) for p in ps]
        comp.aggregate(ps)
    assert n["n"] == 0, f"{name}: {n['n']} host reads"
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_onebit_compress_reads_the_host_once_and_keeps_its_means(device, host_reads):
    comp = tw.compressors.get("onebit")
    x = torch.tensor([1.0, 3.0, -2.0, -4.0, 0.0, 6.0, -0.5]).to(device)
    if device == "cuda":        # the finiteness check is the one read left (it raises in compress, on every device)
        torch.cuda.synchronize()
    with host_reads() as n:
        try:
            p = comp.compress(x, key="k", step=0)
        except RuntimeError:    # (cuda, sync debug mode "error": the finiteness check's one read)
            n["n"] = 1
            torch.cuda.set_sync_debug_mode("default")
            p = comp.compress(x, key="k", step=0)
    assert n["n"] == 1
    means = p.tensors[1].cpu()
    assert means.tolist() == pytest.approx([-6.5 / 3, 10.0 / 4])     # mean of the negatives, of the non-negatives
    y = comp.decompress(p).cpu()
    assert y.tolist() == pytest.approx([2.5, 2.5, -6.5 / 3, -6.5 / 3, 2.5, 2.5, -6.5 / 3])
    empty = comp.compress(torch.zeros(0, device=device), key="e", step=0)
    assert empty.tensors[1].cpu().tolist() == [0.0, 0.0] and comp.decompress(empty).numel() == 0


def test_wire_reads_every_header_of_an_exchange_in_one_host_read(device, host_reads):
    from thinwire.exchange import wire
    g = torch.Generator().manual_seed(6)
    payloads = [[torch.randn(5 + r, generator=g), torch.randint(0, 9, (3 * r,), generator=g, dtype=torch.int32),
                 torch.rand(4, generator=g) > 0.5, torch.randn(2, generator=g).to(torch.bfloat16)]
                for r in range(4)]
    many = [[torch.arange(i + 1, dtype=torch.int16) for i in range(11)]]      # a header past the 8-tensor prefix
    bufs = [wire.pack([t.to(device) for t in ts]) for ts in payloads + many]
    assert all(_on(b, device) for b in bufs)
    with host_reads() as n:
        got = wire.unpack_all(bufs[:4])
    assert n["n"] == 1
    got += wire.unpack_all(bufs[4:])
    for want, ts in zip(payloads + many, got):
        assert [t.dtype for t in ts] == [t.dtype for t in want] and all(_on(t, device) for t in ts)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(ts, want))
    assert [t.tolist() for t in wire.unpack(bufs[1])] == [t.tolist() for t in payloads[1]]
    assert wire.unpack_all([]) == [] and wire.unpack(wire.pack([])) == []


@pytest.mark.parametrize("name", ["topk+golomb", "topk+elias", "qsgd+huffman"])
def test_coded_payloads_go_to_the_host_once_per_payload(name, device, monkeypatch):
    """The lossless coders run on the host (numpy): one copy there per payload, header and bytes together."""
    comp = _get(name)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(7)).to(device)
    p = comp.compress(x, key="c", step=1)
    want = comp.base.decompress(comp.decode(p))
    copies = []
    orig = torch.Tensor.cpu

    def cpu(self, *a, **k):
        copies.append(self.device.type)
        return orig(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    y = comp.decompress(p)
    assert _on(y, device) and torch.equal(y, want)
    assert copies.count("cuda") == (1 if device == "cuda" else 0)


# -- constants kept per device: bit-packing tables, DeMo's DCT basis, fp4's code table ----------------------------
def test_lookup_tables_and_bases_are_built_once_per_device(device):
    from thinwire.compress import base
    from thinwire.compress.bitpack import code_table, value_table
    from thinwire.compress.demo import dct_basis
    t = code_table(1, device, torch.uint8)
    assert t is code_table(1, device, torch.uint8) and _on(t, device) and t.shape == (256, 8)
    assert t[0b10110001].tolist() == [1, 0, 0, 0, 1, 1, 0, 1]
    v = value_table(2, (-1.0, 0.0, 1.0, 0.0), device)
    assert v is value_table(2, [-1.0, 0.0, 1.0, 0.0], device) and v.dtype == torch.float32 and _on(v, device)
    assert value_table(1, (-0.0, 1.0), device) is not value_table(1, (0.0, 1.0), device)   # -0.0 is its own table
    c = dct_basis(64, device)
    assert c is dct_basis(64, device) and _on(c, device) and c.dtype == torch.float32
    assert dct_basis(64, device, torch.float64).dtype == torch.float64
    assert torch.equal(c.cpu(), dct_basis(64))                  # the same numbers on every device
    x = torch.randn(5000, generator=torch.Generator().manual_seed(8)).to(device)
    for name in ("demo", "fp4", "signsgd", "terngrad", "natural", "onebit"):
        comp = tw.compressors.get(name)
        comp.decompress(comp.compress(x, key="w", step=0))      # first call: builds what it needs
        before = dict(base._CONSTANTS)
        for step in range(3):
            comp.aggregate([comp.compress(x * (r + 1), key="w", step=step) for r in range(2)])
        assert base._CONSTANTS.keys() == before.keys(), name    # nothing rebuilt, nothing new per call
        assert all(base._CONSTANTS[k] is before[k] for k in before), name


# -- the parameter server's messages: headers and bodies where the group's collectives run ---------------------
class _Loopback:
    """A transport to itself: what is sent on a tag is what the next receive on that tag gets; records every
    tensor it is handed."""

    def __init__(self, device):
        from collections import defaultdict, deque
        self.device = torch.device(device)
        self.queues, self.seen = defaultdict(deque), []

    def isend(self, tensor, dst, tag=0):
        from thinwire.comm.engine import Ready
        self.seen.append(tensor)
        self.queues[tag].append(tensor.clone())
        return Ready(None)

    def irecv(self, buf, src, tag=0):
        from thinwire.comm.engine import Ready
        self.seen.append(buf)
        buf.copy_(self.queues[tag].popleft())
        return Ready(buf)


def test_ps_messages_live_on_the_transports_device(device, monkeypatch):
    from thinwire.comm import ps
    monkeypatch.setattr(ps, "_arrived", lambda fut: True)      # the loopback delivers at once
    t = _Loopback(device)
    body = torch.arange(10, dtype=torch.uint8, device=device)
    ps.send(t, 0, ps.Header(ps.PUSH, bucket=3, clock=7, nbytes=10), body)
    ps.send(t, 0, ps.Header(ps.DONE), None)
    box = ps.Mailbox(t, 0, ps.PUSH_TAGS, stream=True)
    box.expect()
    header, got = box.queue.popleft().result()
    assert header == ps.Header(ps.PUSH, 3, 7, 0, 0, 0, 10) and torch.equal(got, body)
    header, got = box.queue.popleft().result()
    assert header.kind == ps.DONE and got is None
    assert t.seen and all(_on(x, device) for x in t.seen)


# -- compare --device ------------------------------------------------------------------------------------------
def test_compare_rejects_cuda_without_a_gpu_before_any_work(tmp_path):
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    out = tmp_path / "never"
    r = subprocess.run([sys.executable, "-m", "thinwire", "compare", "--algorithms", "bsp", "--network", "lan",
                        "--workers", "1", "--device", "cuda", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "device cuda" in lines[0] and "valid: device cpu" in lines[0]
    assert not out.exists()
    from thinwire.compare.matrix import CompareConfig
    with pytest.raises(UserError, match="valid: cpu, cuda"):
        CompareConfig(cells=["bsp"], networks=["lan"], device="tpu").validate()


def test_compare_records_the_device_in_every_result(device, pool2, tmp_path):
    from thinwire.compare.matrix import CompareConfig, compare
    workers = 2 if device == "cpu" else 1          # (a GPU per worker: one is enough here)
    cfg = CompareConfig(workload="digits-mlp", workers=workers, networks=["lan"], cells=["bsp", "localsgd"],
                        steps=4, eval_every=2, device=device)
    results = compare(cfg, str(tmp_path), progress=False, pool=pool2 if device == "cpu" else None)
    assert results["matrix"]["device"] == device
    rows = results["cells"]
    assert [r["label"] for r in rows] == ["bsp", "localsgd"]
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["device"] == device and r["config"]["device"] == device


# -- fused kernels (issue 31): blocks on the CPU, compiled on a GPU, the same payloads as one eager pass -----------
FUSED = ["signsgd", "onebit", "signum", "fp4", "fp8", "int8", "threshold2bit", "natural", "terngrad", "qsgd",
         "randomk", "topk", "countsketch"]
STOCHASTIC = {"terngrad", "qsgd"}     # x·s + u: a compiler may fuse the multiply-add (one rounding, not two)


@pytest.mark.parametrize("name", FUSED)
def test_fused_kernels_give_the_payload_of_one_eager_pass(name, device, monkeypatch):
    """The kernels run block by block on the CPU (`kernels.blockwise`) and compiled on a GPU (`fused`): the same
    payload, byte for byte, as the kernel run once over the whole tensor on the CPU. Compiled, a kernel may round
    differently in the last bit (a fused multiply-add rounds x·s + u once; Triton's casts to fp8): at most 1 in
    10^4 bytes may differ there, and as on the CPU for stochastic rounding; the top k come in the device's order
    (torch.topk's `sorted=False`), so they are compared as a set of (index, value)."""
    from thinwire.compress import kernels, randomk
    x = torch.randn(3 * kernels.BLOCK + 777, generator=torch.Generator().manual_seed(8))
    with monkeypatch.context() as m:           # one block: the whole tensor in one call
        m.setattr(kernels, "BLOCK", 1 << 30)
        m.setattr(randomk, "_BLOCK", 1 << 30)
        ref = tw.compressors.get(name)
        want = ref.compress(x, key="f", step=3)
        want_y = ref.decompress(want)
    comp = tw.compressors.get(name)
    monkeypatch.setattr(randomk, "_BLOCK", 1 << 15)       # (several of randomk's blocks too)
    got = comp.compress(x.to(device), key="f", step=3)
    assert len(got.tensors) == len(want.tensors), name
    rounds = name in STOCHASTIC or device != "cpu"     # (compiled kernels may round differently in the last bit)
    pairs = []
    for g, w in zip(got.tensors, want.tensors):
        g, w = g.cpu().reshape(-1), w.reshape(-1)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        pairs.append((g, w))
    if name == "topk":          # (values, indices) in any order: sort both by index
        (gv, wv), (gi, wi) = pairs
        go, wo = gi.argsort(), wi.argsort()
        pairs = [(gv[go], wv[wo]), (gi[go], wi[wo])]
    compiled = device != "cpu"
    for g, w in pairs:
        if compiled and g.is_floating_point():     # scales and norms: a device's reduction order, its division
            assert torch.allclose(g.float(), w.float(), rtol=1e-6, atol=0), name
            continue
        differ = (g.view(torch.uint8) != w.view(torch.uint8)).sum() if g.numel() else 0
        assert differ <= (w.nbytes // 10_000 if rounds else 0), (name, int(differ))
    y = comp.decompress(got).cpu()
    assert _on(comp.decompress(got), device)
    if not rounds:
        assert torch.equal(y, want_y), name
    elif name not in STOCHASTIC:
        far = ~torch.isclose(y, want_y, rtol=1e-6, atol=0)       # (a code the compiled kernel rounded the other way)
        assert far.sum() <= y.numel() // 10_000, name


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_the_compiled_forms_of_packing_and_bucket_scaling_agree_with_the_cpu_forms(bits):
    """What runs inside a compiled kernel off the CPU — packing by shifts and ors (`gather8_lanes`), bucket
    scaling out of place (`scaled_buckets`) — gives the CPU's bytes and products exactly."""
    from thinwire.compress.bitpack import gather8, gather8_lanes
    from thinwire.compress.qsgd import scale_buckets, scaled_buckets
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (8 * 1001,), generator=g, dtype=torch.int8)
    assert torch.equal(gather8_lanes(codes, bits), gather8(codes.clone(), bits))
    for n, bucket in ((4096, 512), (4100, 512), (7, 512), (1000, 1)):
        x, f = torch.randn(n, generator=g), torch.randn(-(-n // bucket), generator=g)
        assert torch.equal(scaled_buckets(x, f, bucket), scale_buckets(x.clone(), f, bucket)), (n, bucket)
    from thinwire.compress import int8          # int8's kernels off the CPU: the CPU path's levels and values
    x = torch.randn(5000, generator=g)
    p = tw.compressors.get("int8").compress(x)
    inv = torch.where(p.tensors[1] > 0, 127 / p.tensors[1].double(), 0.0).float()
    assert torch.equal(int8._levels.eager(x, inv.reshape(())), p.tensors[0])
    step = (p.tensors[1].double() / 127).float()
    assert torch.equal(int8._dequantize.eager(p.tensors[0], step.reshape(())), tw.compressors.get("int8").decompress(p))


def test_fresh_outputs_reuse_only_memory_nothing_references():
    """`fresh` hands a large CPU output the buffer of an earlier one only once no tensor (nor storage object)
    references it any more."""
    from thinwire.compress.kernels import fresh
    N = 3 * (1 << 20) + 12345          # (a size no other test asks for)
    a = fresh((N,))
    a.fill_(1.0)
    first = a.data_ptr()
    view, held = a[5:], a[:7].untyped_storage()
    del a
    b = fresh(N)
    assert b.data_ptr() != first and float(view[0]) == 1.0
    del view
    c = fresh(N)
    assert c.data_ptr() not in (first, b.data_ptr())         # the storage object still holds the first
    del held, b
    d = fresh((3, N // 3), torch.float32)
    assert d.shape == (3, N // 3) and d.data_ptr() == first
