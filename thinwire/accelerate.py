"""Hugging Face Accelerate: `thinwire.accelerate.attach(accelerator, model, optimizer, algorithm=..., ...)` (the
extra: pip install 'thinwire[accelerate]'). It lives in the integrations room (`thinwire.integrations.accelerate`);
this module is its public name."""
from .integrations.accelerate import attach

__all__ = ["attach"]
