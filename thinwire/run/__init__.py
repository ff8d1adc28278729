"""One training run: the workloads (`workloads.py`: models and bundled data, the byte-level LM; yours by
`module:function`, `user.py`; Hugging Face causal LMs, `hf.py`), their data per worker (`data.py`), the training
loop and its steppers (thinwire's Trainer's; a peer's, from `thinwire.compare.peers`), checkpoints, `thinwire
train`'s core (`train.py`) and a workload's step timed here (`measure.py`)."""
