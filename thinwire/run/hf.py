"""Hugging Face causal language models as workloads: `causal_lm(config, text)` is a `Workload` whose model is
`transformers.AutoModelForCausalLM.from_config(config)` (random initialisation: nothing is downloaded), trained on
bytes as tokens (no tokenizer: the config's vocabulary must hold the 256 byte values) with the language-model loss
as its metric.

Data: `text` (a str, encoded as UTF-8, or bytes), its first 90 % for training and the rest held out; without
`text`, the interpreter's own standard library source (`thinwire.run.lm.corpus`, the `stdlib-lm` workload's). The
training samples are the `context`-byte windows at stride `context` (`lm.windows`), y = x shifted by one byte;
the evaluation is `eval_windows` fixed windows spread over the held-out bytes. The loss is the mean next-byte
cross-entropy in nats of the model output's `.logits` (`logits_loss`); `derived` adds bits per byte.
Optimizer: AdamW, betas (0.9, 0.95), weight decay 0.1 (the `stdlib-lm` workload's), `lr` 1e-3 by default.
"""
from __future__ import annotations

import torch

from ..errors import UserError, require_extra
from . import lm
from .workloads import Workload


def logits_loss(output, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a model output with `.logits` (batch, t, vocab)."""
    return lm.lm_loss(output.logits, y)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """`logits_loss` of `model` on the held-out windows."""
    return float(logits_loss(model(x), y))


def byte_windows(text: str | bytes | None, context: int, eval_windows: int) -> tuple[tuple, dict]:
    """((x, y, x_val, y_val), what the results record about the bytes): `text`'s (or the stdlib corpus') windows,
    inputs as int32 token ids (what an embedding takes), targets as bytes."""
    if text is None:
        c = lm.corpus()
        train, val = c["train"], c["val"]
        info = {"corpus_sha256": c["sha256"], "corpus_bytes": c["bytes"]}
    else:
        data = text.encode() if isinstance(text, str) else bytes(text)
        cut = int(len(data) * 0.9)
        train, val = data[:cut], data[cut:]
        info = {"text_bytes": len(data)}
        if len(val) < context + 1 or len(train) < context + 1:
            raise UserError(f"the text holds {len(data)} bytes: too few for windows of {context} bytes in its "
                            f"90 % (training) and 10 % (held out)")
    x, y = lm.windows(train, context)
    xv, yv = lm.windows(val, context, eval_windows)
    return (x.int(), y, xv.int(), yv), info


def causal_lm(config, text: str | bytes | None = None, *, name: str | None = None, context: int = 64,
              batch_size: int = 8, eval_windows: int = 64, lr: float = 1e-3, target: float = 2.5,
              epochs: float = 0.5) -> Workload:
    """A workload of the causal LM `config` describes (`transformers.AutoModelForCausalLM.from_config`, random
    initialisation) trained on the bytes of `text` (default: the stdlib corpus; see the module's doc).

    Args:
        config: a `transformers` config of a causal LM (e.g. `GPT2Config(vocab_size=256, ...)`); its vocabulary
            holds at least the 256 byte values, its positions at least `context`.
        text: the training text (str or bytes); its last 10 % is held out.
        name: what the results call it (default `hf-<model_type>`).
        context: bytes per window.
        batch_size: windows per worker per step.
        eval_windows: held-out windows every evaluation reads.
        lr: AdamW's learning rate.
        target: the held-out loss (nats per byte) a race runs to.
        epochs: passes over the training windows of a run given no --steps, --epochs or --budget.
    """
    transformers = require_extra("transformers", "hf", "Hugging Face models (thinwire.run.hf)")
    vocab = getattr(config, "vocab_size", 0) or 0
    if vocab < lm.VOCAB:
        raise UserError(f"the config's vocab_size is {vocab}: bytes as tokens need at least {lm.VOCAB}")
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is not None and context > positions:
        raise UserError(f"context {context} is longer than the config's {positions} positions")
    data, info = byte_windows(text, context, eval_windows)

    def build() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_config(config)

    kind = getattr(config, "model_type", "causal-lm")
    return Workload(name or f"hf-{kind}", data, build, metric="loss", target=target, batch_size=batch_size,
                    lr=lr, momentum=0.9, epochs=epochs, optimizer="adamw",
                    optim={"adamw": {"beta2": 0.95, "weight_decay": 0.1}, "sgd": {"lr": 0.1, "momentum": 0.9}},
                    loss_fn=logits_loss, eval_fn=evaluate, derived={"bits_per_byte": lm.bits_per_byte},
                    doc=f"Hugging Face {kind} from a config, bytes as tokens; target loss {target} nats/byte",
                    extra={"model_type": kind, "context": context, **info})
