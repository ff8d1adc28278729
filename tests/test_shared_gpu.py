"""Workers sharing a GPU (issue 31): more workers than GPUs run over gloo, which takes CUDA tensors in its
collectives but not in send/recv (a CUDA tensor there aborts the process), so the transport stages every
point-to-point message of a device tensor through a host buffer. On the CPU the same staging path runs when it is
forced (`Staging.forced`, THINWIRE_STAGE_P2P=1): it must deliver the same bytes, count the same traffic and
train the same models as the direct path. On a GPU (`device` "cuda") the two workers of `pool2` share it."""
from __future__ import annotations

import os

import pytest
import torch


def _on(device: str) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(0)          # both workers of the pool on the one GPU
    return torch.device(device)


def _messages(rank, world, device, stage):
    """Each rank sends the other a float matrix and a bool mask and receives the other's, on a plain and on
    an emulated link; (received, their device, bytes counted) per link."""
    from thinwire.comm import Transport
    dev, peer, out = _on(device), 1 - rank, {}
    for net in ("lan", "dc"):
        tp = Transport(network=net, device=dev)
        tp.staging.forced = stage
        x = torch.arange(12, dtype=torch.float32, device=dev).view(3, 4) + 100 * rank
        mask = torch.arange(5, device=dev) % 2 == rank
        got, got_mask = torch.empty_like(x), torch.empty_like(mask)
        hs = [tp.isend(x, peer), tp.isend(mask, peer, tag=1), tp.irecv(got, peer), tp.irecv(got_mask, peer, tag=1)]
        for h in hs:
            h.wait()
        out[net] = (got.cpu(), got_mask.cpu(), got.device.type, tp.meter.totals()["bytes_sent"])
    return out


@pytest.mark.parametrize("stage", [True, False])
def test_point_to_point_through_host_buffers_delivers_the_same_bytes(pool2, device, stage):
    if device == "cuda" and not stage:
        pytest.skip("a CUDA tensor under gloo is always staged")
    res = pool2.run(_messages, device, stage)
    for rank, out in enumerate(res):
        peer = 1 - rank
        for net, (got, mask, where, sent) in out.items():
            assert torch.equal(got, torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * peer), net
            assert torch.equal(mask, torch.arange(5) % 2 == peer), net
            assert where == device, net
            assert sent == 12 * 4 + 5, net      # the payload, as on the direct path (an emulated stamp is free)


# algorithms whose exchanges are point-to-point: gossip, a ring all-reduce, the parameter server
P2P = [("dpsgd", {}), ("choco", {"compressor": "topk", "ratio": 0.25}), ("sgp", {}),
       ("bsp", {"allreduce": "ring"}), ("asp", {}), ("bsp", {"architecture": "ps", "compressor": "topk",
                                                             "ratio": 0.25, "downlink_compressor": "topk"})]


def _train(rank, world, device, stage):
    """A small MLP trained 6 steps with each P2P algorithm; (flat parameters on the host, all on `device`)."""
    import thinwire as tw
    dev = _on(device)
    before = os.environ.get("THINWIRE_STAGE_P2P")
    os.environ["THINWIRE_STAGE_P2P"] = "1" if stage else "0"
    out = []
    try:
        for algorithm, params in P2P:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            tr = tw.Trainer(model, opt, algorithm=algorithm, **params)
            if getattr(tr.algorithm, "role", "worker") == "server":
                tr.algorithm.serve()
            else:
                g = torch.Generator().manual_seed(rank)
                x, y = torch.randn(32, 8, generator=g).to(dev), torch.randint(3, (32,), generator=g).to(dev)
                for _ in range(6):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    tr.step()
                    opt.zero_grad()
                tr.close()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out.append((flat.cpu(), all(p.device.type == device for p in model.parameters())))
    finally:
        os.environ.pop("THINWIRE_STAGE_P2P") if before is None else os.environ.update(THINWIRE_STAGE_P2P=before)
    return out


def test_point_to_point_algorithms_train_the_same_through_host_buffers(pool2, device):
    """Staged (forced on the CPU; always for CUDA tensors under gloo) and direct runs train the same models:
    bitwise on the CPU, to float tolerance on a GPU (other kernels). The staged run is on an emulated link,
    which only delays: a receive's data is in the caller's tensor when it reports `arrived` (the parameter
    server reads a header then; it read an empty buffer on any emulated link and gloo aborted)."""
    staged = pool2.run(_train, device, True, network="dc")
    direct = pool2.run(_train, "cpu", False)
    for rank in range(2):
        for (alg, _), (a, on), (b, _) in zip(P2P, staged[rank], direct[rank]):
            assert on, alg
            if device == "cpu":
                assert torch.equal(a, b), alg
            else:
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), alg


def test_transport_stages_device_tensors_only_under_gloo(monkeypatch):
    from thinwire.comm.staging import Staging
    monkeypatch.delenv("THINWIRE_STAGE_P2P", raising=False)
    t = Staging(nccl=False)                                # gloo
    assert not t.staged(torch.zeros(2))
    assert t.staged(torch.zeros(2, device="meta"))        # any tensor off the host
    t = Staging(nccl=True)                                 # NCCL: sends device memory itself
    assert not t.staged(torch.zeros(2, device="meta"))
    t.forced = True                                        # forced: the CPU takes the staging path too
    assert t.staged(torch.zeros(2))
