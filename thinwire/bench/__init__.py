"""Benchmarks behind `thinwire bench NAME`: one module each with `register(subparsers)` adding its parser, and the
planner's calibration (`calibrate`; its validation is `costmodel`).

Each benchmark prints numbers and ratios against a baseline measured in the same run (memcpy, PyTorch DDP, the
uncompressed algorithm); `--json` prints them machine-readably.
"""
