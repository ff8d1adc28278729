"""Benchmarks behind `thinwire bench NAME`: one module each, with `register(subparsers)` adding its parser.

Each prints numbers and ratios against a baseline measured in the same run (memcpy, PyTorch DDP, the
uncompressed algorithm); `--json` prints them machine-readably.
"""
