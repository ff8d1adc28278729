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
    from thinwire.run.launcher import pick_backend
    assert pick_backend(None, None) == ("gloo", "cpu")
    assert pick_backend("gloo", "cpu") == ("gloo", "cpu")
    with pytest.raises(UserError, match="valid: cpu, cuda"):
        tw.launch(abs, world_size=1, device="tpu")
    with pytest.raises(UserError, match="needs device cuda"):
        pick_backend("nccl", "cpu")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(UserError, match="GPUs"):
        pick_backend(None, "cuda", have + 1)           # one process per GPU
    if have:
        assert pick_backend(None, "cuda", have) == ("nccl", "cuda")
