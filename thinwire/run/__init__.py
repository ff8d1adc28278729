"""One training run: the workloads (models and bundled data, the byte-level LM), the training loop and its
steppers (thinwire's Trainer, PyTorch's DDP peers, torchft's DiLoCo), checkpoints, and `thinwire train`'s core
(`train.py`)."""
