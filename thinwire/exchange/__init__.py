"""Aggregate a tensor across workers: compensate -> compress -> update memory -> collective -> decompress."""
from .exchange import Exchange

__all__ = ["Exchange"]
