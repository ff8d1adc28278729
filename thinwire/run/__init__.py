"""One training run: the workloads (models and bundled data, the byte-level LM), the training loop and its
steppers (thinwire's Trainer's; a peer's, from `thinwire.compare.peers`), checkpoints, and `thinwire train`'s
core (`train.py`)."""
