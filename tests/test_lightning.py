"""PyTorch Lightning (`thinwire.lightning.ThinwireStrategy`, extra `lightning`): a LightningModule trains on four
processes with bsp + top-k, DiLoCo and DTS and ends where the same model through `tw.Trainer` ends (bitwise: the
strategy is `tw.attach` under Lightning's loop); a run resumed from a Lightning checkpoint ends where the
uninterrupted run ends; Lightning's gradient clipping under bsp clips the mean gradient, as under DDP; bytes and
emulated time are metered. The four processes are the shared pool's: Lightning
sees LOCAL_RANK and a process group already made, as under torchrun, and launches nothing."""
from __future__ import annotations

import os

import pytest
import torch

L = pytest.importorskip("lightning")

import thinwire as tw  # noqa: E402

STEPS_PER_EPOCH, EPOCHS = 4, 5
CLIPPED = {"network": "custom:bandwidth=100mbit,latency=5ms", "bucket_mb": 0.002, "first_bucket_mb": 0.0}
CASES = [
    ("bsp", {"compressor": "topk", "ratio": 0.25, "memory": "residual", "network": "lan"}),
    ("diloco", {"period": 5, "compressor": "fp4", "network": "custom:bandwidth=1gbit,latency=1ms"}),
    ("dts", {"delay": 2, "period": 2, "network": "lan"}),
]


class Net(L.LightningModule):
    """A small classifier on this rank's fixed shard (no sampler: the shard is the rank's)."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(16 * STEPS_PER_EPOCH, 16, generator=g)
        self.y = (self.x[:, :4] * 3).argmax(1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def full_loss(self) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(self(self.x), self.y))


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _fit(rank, algorithm, params, epochs=EPOCHS, ckpt_dir=None, ckpt_path=None, clip=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from thinwire.lightning import ThinwireStrategy
    module = Net(rank)
    strategy = ThinwireStrategy(algorithm=algorithm, **params)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    trainer = L.Trainer(strategy=strategy, devices=4, accelerator="cpu", max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(ckpt_dir),
                        callbacks=callbacks, use_distributed_sampler=False, num_sanity_val_steps=0,
                        log_every_n_steps=1, gradient_clip_val=clip)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, strategy.metrics(), trainer.callback_metrics


def _trainer(rank, algorithm, params, clip=None):
    module = Net(rank)
    opt = module.configure_optimizers()
    trainer = tw.Trainer(module, opt, algorithm=algorithm, **params)
    for _ in range(EPOCHS):
        for i, batch in enumerate(module.train_dataloader()):
            module.training_step(batch, i).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            trainer.step()
            opt.zero_grad()
    trainer.close()
    return module, trainer.metrics()


def _worker(rank, world_size, ckpt_dir):
    os.environ["LOCAL_RANK"] = str(rank)      # Lightning: processes made outside (as torchrun's), group made
    try:
        out = []
        for algorithm, params in CASES:
            ours, m, logged = _fit(rank, algorithm, params)
            ref, m_ref = _trainer(rank, algorithm, params)
            out.append((algorithm, torch.equal(_flat(ours), _flat(ref)), ours.full_loss(), ref.full_loss(),
                        m["steps"], m["bytes_sent"], m_ref["bytes_sent"], m.get("emulated_s", 0.0),
                        float(logged.get("thinwire/bytes_sent", -1))))
        # Lightning clips between the closure's backward and the step, where bsp's mean gradient has landed (as
        # DDP's): the loop that clips it there, and every rank the same model (before, the clip raced with the
        # all-reduce in flight and the ranks drifted apart)
        clipped, _, _ = _fit(rank, "bsp", CLIPPED, clip=0.05)
        ref, _ = _trainer(rank, "bsp", CLIPPED, clip=0.05)
        out.append(("clip", torch.equal(_flat(clipped), _flat(ref)), _flat(clipped), None, 0, 0, 0, 0, 0))
        # resume: a run stopped after epoch 2 and resumed from Lightning's checkpoint ends where the whole run ends
        whole, _, _ = _fit(rank, "diloco", {"period": 3}, epochs=4, ckpt_dir=ckpt_dir)
        ckpt = os.path.join(ckpt_dir, f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt")
        resumed, m_resumed, _ = _fit(rank, "diloco", {"period": 3}, epochs=4, ckpt_path=ckpt)
        out.append(("resume", torch.equal(_flat(whole), _flat(resumed)), whole.full_loss(), resumed.full_loss(),
                    m_resumed["steps"], 0, 0, 0, 0))
        return out
    finally:
        os.environ.pop("LOCAL_RANK", None)


def test_lightning_strategy_trains_like_the_trainer_and_resumes(pool4, tmp_path):
    res = pool4.run(_worker, str(tmp_path))
    for rank_out in res:
        for name, same, loss, ref_loss, steps, sent, ref_sent, emulated, logged in rank_out:
            assert same, (name, loss, ref_loss)
            if name == "resume":
                assert steps == 4 * STEPS_PER_EPOCH
                continue
            if name == "clip":
                assert torch.equal(loss, res[0][-2][2])
                continue
            assert loss == ref_loss and loss < 1.2, (name, loss)      # it learned (chance: ln 4 = 1.39)
            assert steps == EPOCHS * STEPS_PER_EPOCH and sent == ref_sent > 0, (name, steps, sent, ref_sent)
            if name == "diloco":
                assert emulated > 0                                       # the emulated network applied
    assert res[0][0][-1] == res[0][0][5]      # rank 0 logged thinwire/bytes_sent each step (the last = the total)


def test_strategy_refuses_bad_parameters_before_launch():
    from thinwire.lightning import ThinwireStrategy
    with pytest.raises(tw.UserError, match="unknown algorithm"):
        ThinwireStrategy(algorithm="nope")
    with pytest.raises(tw.UserError, match="unknown parameter"):
        ThinwireStrategy(algorithm="diloco", bogus=1)
    with pytest.raises(tw.UserError, match="network"):
        ThinwireStrategy(algorithm="diloco", network="moon")
    with pytest.raises(tw.UserError, match="parameter-server"):
        ThinwireStrategy(algorithm="bsp", architecture="ps")


def test_a_missing_extra_is_one_line_and_status_2(tmp_path):
    """Without Lightning installed (hidden here), importing thinwire.lightning ends the script with one line
    naming the pip command and status 2."""
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.modules['lightning'] = None\nfrom thinwire.lightning import ThinwireStrategy\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "thinwire: error: thinwire.lightning (PyTorch Lightning) needs the optional extra 'lightning': "
        "pip install 'thinwire[lightning]' 'torch==2.13.0'"], r.stderr
