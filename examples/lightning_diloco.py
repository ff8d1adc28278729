"""PyTorch Lightning with a thinwire algorithm: `ThinwireStrategy` in place of DDP (here DiLoCo, 10 local steps
between synchronisations, pseudo-gradients in 4 bits, over an emulated world link). Lightning starts the 2
processes itself (`pip install 'thinwire[lightning]'`); about 15 s.

    python examples/lightning_diloco.py
"""
import lightning as L
import torch
import torch.nn.functional as F

from _digits import accuracy, digits, mlp
from thinwire.lightning import ThinwireStrategy


class Digits(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    x, y = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    strategy = ThinwireStrategy(algorithm="diloco", period=10, compressor="fp4", network="world")
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Digits()
    trainer.fit(module, loader)                # Lightning shards the loader over the processes
    m = strategy.metrics()
    if trainer.is_global_zero:
        print(f"accuracy {accuracy(module.net, x, y):.3f}, {m['steps']} steps, "
              f"{m['bytes_sent'] / 1e6:.2f} MB sent by rank 0, {m['emulated_s']:.1f} s on the emulated wire")
