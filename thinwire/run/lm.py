"""The byte-level language model of the `stdlib-lm` workload: its corpus (the Python standard library's own source,
found offline on every machine), the byte windows it trains on, and a small decoder-only transformer.

Corpus: the top-level `*.py` files of `sysconfig.get_paths()["stdlib"]` in sorted order (no sub-packages, so no
`test/`, `idlelib/`, `site-packages/`), the first files whose sizes sum to at most `MAX_BYTES`. Files are split by
position in that list: every `VAL_EVERY`-th file is validation, the rest training. The fingerprint is sha256 over
every file's name and bytes in order, so two results with the same fingerprint trained on the same bytes (another
Python version ships other source and gets another fingerprint).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import sys
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_BYTES = 4 * 2 ** 20  # cap on the corpus (4 MiB): loading and fingerprinting stay well under a second
VAL_EVERY = 10           # file i (in sorted order) is validation when i % VAL_EVERY == VAL_EVERY - 1
VOCAB = 256


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | None = None, max_bytes: int = MAX_BYTES) -> list[str]:
    """The corpus' file names (relative to `root`), sorted, stopping before the file that would pass `max_bytes`."""
    root = root or stdlib_dir()
    names, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        names.append(os.path.basename(path))
        total += size
    return names


@functools.lru_cache(maxsize=None)
def corpus(root: str | None = None, max_bytes: int = MAX_BYTES) -> dict:
    """{"train": bytes, "val": bytes, "files", "val_files", "sha256", "bytes"}: the training files' bytes
    concatenated in order, the validation files' likewise, and the fingerprint of the whole corpus."""
    root = root or stdlib_dir()
    names = corpus_files(root, max_bytes)
    if not names:
        raise FileNotFoundError(f"no *.py files under {root}: the stdlib-lm corpus needs the Python standard library")
    h = hashlib.sha256()
    train, val, val_files = [], [], []
    for i, name in enumerate(names):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        if i % VAL_EVERY == VAL_EVERY - 1:
            val.append(data)
            val_files.append(name)
        else:
            train.append(data)
    train_b, val_b = b"".join(train), b"".join(val)
    return {"train": train_b, "val": val_b, "files": names, "val_files": val_files, "sha256": h.hexdigest(),
            "bytes": len(train_b) + len(val_b)}


def windows(stream: bytes, context: int, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte windows of a stream as (x, y) uint8 tensors of shape (n, context), y = x shifted by one byte.
    Without `count`: every window of stride `context` (each byte is a target once). With `count`: that many
    windows at evenly spaced offsets over the whole stream (a fixed evaluation subset)."""
    t = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    if count is None:
        w = t.unfold(0, context + 1, context)
    else:
        starts = torch.linspace(0, len(t) - context - 1, count, device="cpu").round().long()   # (host data)
        w = t[starts[:, None] + torch.arange(context + 1, device="cpu")[None, :]]
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


@functools.lru_cache(maxsize=None)
def lm_data(context: int, eval_windows: int, max_bytes: int = MAX_BYTES):
    """(x_train, y_train, x_val, y_val, info): every training window, a fixed subset of validation windows, and
    what a result should record about the corpus (its fingerprint, size, file counts, Python version)."""
    c = corpus(None, max_bytes)
    x, y = windows(c["train"], context)
    xv, yv = windows(c["val"], context, eval_windows)
    info = {"corpus_sha256": c["sha256"], "corpus_bytes": c["bytes"], "corpus_files": len(c["files"]),
            "val_files": len(c["val_files"]), "python": sys.version.split()[0]}
    return x, y, xv, yv, info


# -- model -----------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP of width 4d."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """Decoder-only transformer over bytes: token + learned position embeddings, `layers` blocks, a final
    LayerNorm and an (untied) linear head to 256 logits. Initialised as GPT-2 does (normal, std 0.02; the two
    projections into the residual stream scaled by 1/sqrt(2·layers))."""

    def __init__(self, context: int = 64, width: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.context = context
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:    # (LayerNorm weights stay ones)
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, t) bytes (any integer dtype), t <= context -> (batch, t, 256) logits."""
        x = x.long()
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).long())


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) of `model` on the evaluation windows (x, y)."""
    return float(lm_loss(model(x), y))


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)
