"""Hugging Face Accelerate: `thinwire.accelerate.attach(accelerator, model, optimizer, algorithm=..., ...)` (the
extra: pip install 'thinwire[accelerate]'). It lives in the run layer (`thinwire.run.accelerate`); this module is
its public name."""
from .run.accelerate import attach

__all__ = ["attach"]
