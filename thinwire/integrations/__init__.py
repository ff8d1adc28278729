"""The integrations: thinwire's algorithms inside other training frameworks, one module each, each behind its own
extra and imported only when used (their public names are the top-level `thinwire.lightning` and
`thinwire.accelerate`).

- `lightning.py`: PyTorch Lightning's strategy (`ThinwireStrategy`);
- `accelerate.py`: Hugging Face Accelerate (`attach` on what `accelerator.prepare` returned).

An integration drives a `thinwire.Trainer` through `thinwire.attach` from the framework's own loop; it sits above
the run layer and below compare, bench and the CLI. A new one (Ray Train, say) is a module here, a top-level shim
for its public name, an extra and a page of docs.
"""
