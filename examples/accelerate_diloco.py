"""Hugging Face Accelerate with DiLoCo: the script Accelerate launches, with
`thinwire.accelerate.attach` on the optimizer Accelerate prepared, on
scikit-learn's 8x8 digits. The model is not prepared (Accelerate would wrap it
in DDP, whose all-reduce DiLoCo does not want): it stays on
`accelerator.device` as it is. Needs the extra, from a clone:
`pip install -e '.[accelerate]' 'torch==2.13.0'`. On CPU, 4 processes, about
15 s:

    accelerate launch --multi_gpu --num_processes 4 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no \\
        examples/accelerate_diloco.py

(`--multi_gpu` is Accelerate's multi-process launcher; `Accelerator(cpu=True)`
below makes it gloo on CPUs.)
"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits

import thinwire.accelerate

accelerator = Accelerator(cpu=True)
x, y = load_digits(return_X_y=True)      # 1797 images of 64 pixels, no download
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
data = torch.utils.data.TensorDataset(x, y)
loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
torch.manual_seed(0)                 # the same initial model in every process
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 10))
model = model.to(accelerator.device)     # not prepared: no DDP wrapper
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
# the loader is sharded over the processes
optimizer, loader = accelerator.prepare(optimizer, loader)

with thinwire.accelerate.attach(accelerator, model, optimizer,
                                algorithm="diloco", period=5,
                                compressor="fp4") as run:
    for epoch in range(2):
        for xb, yb in loader:
            accelerator.backward(F.cross_entropy(model(xb), yb))
            optimizer.step()        # an inner step; every 5th also synchronises
            optimizer.zero_grad()
m = run.metrics()
if accelerator.is_main_process:
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    print(f"accuracy {acc:.3f}, {m['steps']} steps, "
          f"{m['bytes_sent'] / 1e6:.2f} MB sent by process 0")
