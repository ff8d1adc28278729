"""PyTorch Lightning with a thinwire algorithm: `ThinwireStrategy` in place of
DDP (here DiLoCo: 10 local steps between synchronisations, pseudo-gradients in
4 bits, over an emulated world link), on scikit-learn's 8x8 digits. Lightning
starts the 2 processes itself; about 15 s. Needs the extra, from a clone:
`pip install -e '.[lightning]' 'torch==2.13.0'`.

    python examples/lightning_diloco.py
"""
import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from thinwire.lightning import ThinwireStrategy


def digits():
    """1797 images as 64 floats in [0, 1], and their labels (no download)."""
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)


class Digits(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)          # the same initial model in every process
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    x, y = digits()
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    strategy = ThinwireStrategy(algorithm="diloco", period=10, compressor="fp4",
                                network="world")
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu",
                        max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = Digits()
    trainer.fit(module, loader)     # Lightning shards the loader over processes
    m = strategy.metrics()
    if trainer.is_global_zero:
        with torch.no_grad():
            acc = (module.net(x).argmax(1) == y).float().mean().item()
        print(f"accuracy {acc:.3f}, {m['steps']} steps, "
              f"{m['bytes_sent'] / 1e6:.2f} MB sent by rank 0, "
              f"{m['emulated_s']:.1f} s on the emulated wire")
