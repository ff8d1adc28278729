"""Checkpoints of a training run: every rank's full state, written atomically, refused when they don't fit.

Layout of a checkpoint directory: `rank-<r>.pt` per rank (trainer state — model, optimizer, algorithm,
compressor and memory — data-loader position, RNG streams, the records so far) and `checkpoint.json`, the
manifest, written last by rank 0 once every rank's file is in place: it is the commit point. Each file is
written to a temporary name and renamed, so a crash while writing leaves the previous checkpoint intact
(rank files are staged as `rank-<r>.step-<s>.pt` and promoted only after the manifest commits; see `save`).
Files are loaded with `torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary
objects. The manifest carries every rank file's sha256, checked on load: a damaged file is named, never loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..files import atomic_write

MANIFEST = "checkpoint.json"
# configuration fields that may change between the interrupted and the resumed run
_FREE = {"epochs", "steps", "progress", "trace", "eval_every", "target", "checkpoint_every", "checkpoint_dir",
         "resume", "nonfinite", "progress_timeout", "deadline", "budget_s", "stop_at_target", "tensorboard",
         "elastic", "replace_delay", "join", "listen"}


def config_fields(cfg) -> dict:
    """The configuration fields a checkpoint (and an elastic job's newcomer) must share with the run."""
    fields = {k: v for k, v in cfg.to_dict().items() if k not in _FREE}
    fields["servers"] = cfg.resolve_servers()   # omitted (None) and the default it stands for are the same run
    if cfg.elastic or cfg.join:
        fields["workers"] = "elastic"          # the members come and go: the world size is checked by itself
    return fields


def fingerprint(cfg) -> str:
    return hashlib.sha256(json.dumps(config_fields(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": torch.tensor(bytearray(json.dumps(
        [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]]).encode()), dtype=torch.uint8),
        "numpy": torch.tensor(np.random.get_state()[1].astype(np.int64))}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    inner, version, gauss = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((version, tuple(inner), gauss))
    st = np.random.get_state()
    np.random.set_state((st[0], state["numpy"].numpy().astype(np.uint32), *st[2:]))


def _staged(directory: str, rank: int, step: int) -> str:
    return os.path.join(directory, f"rank-{rank}.step-{step}.pt")


def _digest_file(directory: str, rank: int, step: int) -> str:
    """Where a rank leaves the sha256 of its staged file for rank 0 to put in the manifest (removed after)."""
    return os.path.join(directory, f"rank-{rank}.step-{step}.sha256")


def save(directory: str, rank: int, world_size: int, step: int, cfg, state: dict, barrier) -> None:
    """Three phases, so a crash at any point leaves a loadable checkpoint: every rank stages
    `rank-<r>.step-<s>.pt`; after `barrier()` rank 0 commits the manifest (the commit point); after another
    barrier every rank promotes its staged file to `rank-<r>.pt` and drops stale staged ones. `load` reads the
    staged file of the committed step when a crash came before its promotion. Each rank leaves the sha256 of
    its staged file in a sidecar, which rank 0 copies into the manifest."""
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(_staged(directory, rank, step), data)
    atomic_write(_digest_file(directory, rank, step), hashlib.sha256(data).hexdigest().encode())
    barrier()
    if rank == 0:
        sums = {str(r): Path(_digest_file(directory, r, step)).read_text().strip() for r in range(world_size)}
        manifest = {"step": step, "world_size": world_size, "fingerprint": fingerprint(cfg),
                    "algorithm": cfg.algorithm, "workload": cfg.workload, "sha256": sums}
        atomic_write(os.path.join(directory, MANIFEST), json.dumps(manifest))
    barrier()
    os.replace(_staged(directory, rank, step), os.path.join(directory, f"rank-{rank}.pt"))
    for name in os.listdir(directory):
        if name.startswith(f"rank-{rank}.") and (name.startswith(f"rank-{rank}.step-") or name.endswith(".tmp")):
            os.remove(os.path.join(directory, name))
    barrier()


def exists(directory: str | None) -> bool:
    """Whether `directory` holds a committed checkpoint (its manifest)."""
    return bool(directory) and os.path.exists(os.path.join(directory, MANIFEST))


def _manifest(directory: str) -> dict:
    """The manifest of `directory`, checked for shape (a planted or damaged one is refused in one line)."""
    path = os.path.join(directory, MANIFEST)
    try:
        manifest = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no checkpoint in {directory!r} (missing {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint manifest {path!r} is unreadable: {_one_line(e)}") from None
    ok = (isinstance(manifest, dict) and _is_int(manifest.get("step")) and manifest["step"] >= 0
          and _is_int(manifest.get("world_size")) and isinstance(manifest.get("sha256", {}), dict))
    if not ok:
        raise UserError(f"checkpoint manifest {path!r} is not a thinwire manifest (it needs an integer step and "
                        f"world_size, and sha256 by rank)")
    return manifest


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one_line(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (torch's run to a dozen lines of advice)."""
    text = (str(e).strip().splitlines() or [""])[0].strip()
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _torch_load(data: bytes):
    """(state, None), or (None, what is wrong with it) in one line. Only tensors and plain containers are built."""
    try:
        with warnings.catch_warnings():  # e.g. torch's warning about a pickle protocol it does not expect
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True), None
    except pickle.UnpicklingError as e:  # torch's several lines of advice on loading it unsafely: not for us
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it refers to {named.group(1)}, which is" if named else "it holds something that is"
        return None, (f"is refused: {what} not a tensor or a plain container (torch.load(weights_only=True) "
                      f"refused it; nothing in it was run)")
    except Exception as e:  # noqa: BLE001 - any corruption is the same user-facing problem
        return None, f"is corrupt or unreadable: {_one_line(e)}"


def check(directory: str, world_size: int, cfg, files: bool = False) -> dict:
    """The manifest of `directory` if it fits this run; a UserError saying why not otherwise. With `files`, every
    rank's file is read and checked as `load` will check it in that rank (its sha256, its step, its contents), so
    that a damaged one is refused before any worker starts."""
    manifest = _manifest(directory)
    if manifest.get("world_size") != world_size:
        raise UserError(f"checkpoint in {directory!r} is from {manifest.get('world_size')} ranks, "
                        f"this run has {world_size}")
    if manifest.get("fingerprint") != fingerprint(cfg):
        raise UserError(f"checkpoint in {directory!r} is from a different configuration "
                        f"({manifest.get('algorithm')} on {manifest.get('workload')}); resume with the same "
                        f"workload, algorithm, parameters, workers, network and seed")
    for r in range(world_size):
        if not (os.path.exists(os.path.join(directory, f"rank-{r}.pt"))
                or os.path.exists(_staged(directory, r, manifest.get("step")))):
            raise UserError(f"checkpoint in {directory!r} lacks rank-{r}.pt")
    if files:
        for r in range(world_size):
            load(directory, r)
    return manifest


def load(directory: str, rank: int) -> dict:
    """This rank's state of the committed step (staged file first: a crash may have come before promotion),
    after checking its sha256 against the manifest's (manifests written before checksums have none). Every
    refusal is one line of thinwire's: a damaged file, one of another step, one that is no thinwire checkpoint
    (objects beyond tensors and plain containers are refused by `weights_only=True` and never built)."""
    manifest = _manifest(directory)
    step, want = manifest["step"], manifest.get("sha256", {}).get(str(rank))
    path = _staged(directory, rank, step)
    if not os.path.exists(path):
        path = os.path.join(directory, f"rank-{rank}.pt")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"checkpoint file {path!r} is corrupt or unreadable: {_one_line(e)}") from None
    got = hashlib.sha256(data).hexdigest()
    state, error = _torch_load(data)
    if state is not None and not (isinstance(state, dict) and _is_int(state.get("step"))):
        state, error = None, "is not a thinwire checkpoint (no dict with a step)"
    if state is not None and state["step"] != step:  # a whole file of another step: a torn checkpoint, not bit rot
        raise UserError(f"checkpoint file {path!r} is from step {state['step']}, the manifest says step {step}: "
                        f"the checkpoint is inconsistent")
    if want is not None and got != want:
        raise UserError(f"checkpoint file {path!r} is corrupt: its sha256 {got[:16]}... differs from the "
                        f"manifest's {want[:16]}...")
    if state is None:
        raise UserError(f"checkpoint file {path!r} {error}")
    return state
