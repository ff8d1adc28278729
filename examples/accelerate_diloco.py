"""Hugging Face Accelerate with DiLoCo: the script Accelerate launches, with `thinwire.accelerate.attach` on the
optimizer Accelerate prepared. The model is not prepared (Accelerate would wrap it in DDP, whose all-reduce
DiLoCo does not want): it stays on `accelerator.device` as it is. `pip install 'thinwire[accelerate]'`; on CPU,
4 processes, about 15 s:

    accelerate launch --multi_gpu --num_processes 4 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/accelerate_diloco.py

(`--multi_gpu` is Accelerate's multi-process launcher; `Accelerator(cpu=True)` below makes it gloo on CPUs.)
"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator

import thinwire.accelerate
from _digits import accuracy, digits, mlp

accelerator = Accelerator(cpu=True)
x, y = digits()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
model = mlp().to(accelerator.device)                              # not prepared: no DDP wrapper
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
optimizer, loader = accelerator.prepare(optimizer, loader)        # the loader is sharded over the processes

with thinwire.accelerate.attach(accelerator, model, optimizer, algorithm="diloco", period=5,
                                compressor="fp4") as run:
    for epoch in range(2):
        for xb, yb in loader:
            accelerator.backward(F.cross_entropy(model(xb), yb))
            optimizer.step()                    # an inner step; every 5th also synchronises
            optimizer.zero_grad()
m = run.metrics()
if accelerator.is_main_process:
    print(f"accuracy {accuracy(model, x, y):.3f}, {m['steps']} steps, {m['bytes_sent'] / 1e6:.2f} MB sent by "
          f"process 0")
