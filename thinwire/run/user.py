"""A workload of the user's, named by a spec: `module:function` (a module importable from the current directory
or `sys.path`, as `python -m` finds it) or `path/to/file.py:function` (a file; a package's module is imported as
that package's). The function takes no arguments and returns a `thinwire.Workload`.

Every process resolves the spec itself (`load`): the launcher before any worker starts, then each worker, which
rebuilds the workload from the spec (data are never pickled). Workers spawned by thinwire's launcher inherit the
launcher's `sys.path`, where `load` put the module's directory; `canonical` (the CLI's) turns a module under the
current directory into its file's absolute path, which any process (a pool started earlier, `compare --resume`
from elsewhere) resolves alike. Loaded workloads are kept per process and spec.

Before any worker starts (`check`, in a process that is not a worker of thinwire's launcher), one batch goes
through the model on the CPU: forward, the loss (a finite scalar), backward (some parameter gets a gradient),
the optimizer's step where the workload brings its own factory, and one evaluation (a finite number; an
accuracy in [0, 1]). Everything wrong is one line, a `UserError` naming the spec: a module that cannot be
imported, a missing function, a function that raises or returns something else, data whose batch does not fit
the model and the loss. A metric that never moves is only seen after training: the run's summary names it
(`Workload.unmoved`).
"""
from __future__ import annotations

import importlib
import math
import os
import sys

import torch
import torch.distributed as dist

from ..errors import MissingExtra, UserError

_LOADED: dict = {}          # spec -> the workload this process built from it
_FILES: dict = {}           # module name -> the file this process imported it from (a file spec's)


def is_spec(name) -> bool:
    """`name` is a user's spec (module:function), not a built-in workload's name."""
    return isinstance(name, str) and ":" in name


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _parts(spec: str) -> tuple[str, str]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise UserError(f"workload {spec!r}: a workload of yours is module:function or path/to/file.py:function "
                        f"(a function returning a thinwire.Workload)")
    return target, attr


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _module_of_file(path: str) -> tuple[str, str]:
    """(the directory that goes on sys.path, the module's dotted name) of a `.py` file: its own directory, or
    above the packages (directories with `__init__.py`) it is in."""
    root, stem = os.path.split(path[:-3] if path.endswith(".py") else path)
    parts = [] if stem == "__init__" else [stem]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        root, package = os.path.split(root)
        parts.insert(0, package)
    return root, ".".join(parts)


def _under_cwd(target: str) -> str | None:
    """The file of module `target` under the current directory (`python -m`'s first place), or None."""
    base = os.path.join(os.getcwd(), *target.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def canonical(spec: str) -> str:
    """`spec` as any process resolves it: a file's absolute path; a module under the current directory as its
    file's absolute path; a module importable from `sys.path`, a built-in name: unchanged."""
    if not is_spec(spec):
        return spec
    target, attr = _parts(spec)
    if _is_file(target):
        return f"{os.path.abspath(target)}:{attr}"
    path = _under_cwd(target)
    return spec if path is None else f"{path}:{attr}"


def _on_path(directory: str) -> None:
    if directory not in sys.path:
        sys.path.insert(0, directory)
    importlib.invalidate_caches()


def _import(spec: str, target: str):
    """The module `target` names: a file (imported under its module name, its directory first on sys.path) or a
    module (the current directory first on sys.path, as `python -m` does)."""
    path = None
    if _is_file(target):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise UserError(f"workload {spec!r}: no file {target}")
        root, name = _module_of_file(path)
        if not all(p.isidentifier() for p in name.split(".")):
            raise UserError(f"workload {spec!r}: {os.path.relpath(path)} is not importable as a Python module "
                            f"(names of letters, digits and _)")
        if _FILES.get(name, path) != path:      # another file of that name loaded before (another run's)
            for held in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[held]
        _on_path(root)
    else:
        name = target
        _on_path(os.getcwd())
    try:
        module = importlib.import_module(name)
    except MissingExtra:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (name + ".").startswith(e.name + "."):
            raise UserError(f"workload {spec!r}: no module named {e.name!r} (looked in the current directory "
                            f"and sys.path)") from None
        raise UserError(f"workload {spec!r}: importing {name} failed: {one_line(e)}") from None
    except UserError as e:
        raise UserError(f"workload {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module: any error is theirs to fix, in one line
        raise UserError(f"workload {spec!r}: importing {name} failed: {one_line(e)}") from None
    if path is not None:
        got = os.path.abspath(getattr(module, "__file__", None) or "")
        if got != path:
            raise UserError(f"workload {spec!r}: the module name {name!r} is taken by {got or 'a built-in module'}; "
                            f"rename the file")
        _FILES[name] = path
    return module


def load(spec: str, kind: type):
    """The workload `spec`'s function returns (an instance of `kind`), built once per process; checked on one
    batch unless this process is a worker of thinwire's launcher (its launcher checked it)."""
    if spec in _LOADED:
        return _LOADED[spec]
    target, attr = _parts(spec)
    obj = _import(spec, target)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"workload {spec!r}: {target} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"workload {spec!r}: {attr} is a {type(obj).__name__}, not a function returning a "
                        f"thinwire.Workload")
    try:
        wl = obj()
    except MissingExtra:
        raise
    except UserError as e:
        raise UserError(f"workload {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's function
        raise UserError(f"workload {spec!r}: {attr}() raised {one_line(e)}") from None
    if not isinstance(wl, kind):
        raise UserError(f"workload {spec!r}: {attr}() returned {type(wl).__name__}, not a thinwire.Workload")
    from ..launcher import under_torchrun   # (lazy: `tw.Workload` loads no launcher)
    if not (dist.is_available() and dist.is_initialized() and not under_torchrun()):   # not a launched worker
        check(wl, spec)
    _LOADED[spec] = wl
    return wl


def _shape(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_shape(x)}" for k, x in v.items()) + "}"
    return type(v).__name__


def check(wl, spec: str) -> None:
    """One batch through `wl` on the CPU (see the module's doc); the global random state is left as it was."""
    what = f"workload {spec!r}"
    with torch.random.fork_rng(devices=[]):
        try:
            model = wl.model(0)
            x, y = wl.loader(0, 1).next()
        except UserError as e:
            raise UserError(f"{what}: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{what}: building its model or its first batch failed: {one_line(e)}") from None
        shapes = f"x {_shape(x)}, y {_shape(y)}"
        try:
            out = model(x)
            loss = wl.loss(out, y)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{what}: one batch ({shapes}) does not fit the model and the loss: "
                            f"{one_line(e)}") from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = _shape(loss)
            raise UserError(f"{what}: the loss of one batch ({shapes}, output {_shape(out)}) must be one number "
                            f"(a scalar tensor), got {got}")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise UserError(f"{what}: the loss of one batch ({shapes}) is {value} before any training")
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{what}: backward through the loss failed: {one_line(e)}") from None
        if not any(p.grad is not None for p in model.parameters()):
            raise UserError(f"{what}: no parameter of the model got a gradient from the loss (is the loss "
                            f"computed from the model's output?)")
        if callable(wl.optimizer):
            try:
                wl.make_optimizer(model).step()
            except UserError as e:
                raise UserError(f"{what}: {e}") from None
            except Exception as e:  # noqa: BLE001
                raise UserError(f"{what}: its optimizer function failed: {one_line(e)}") from None
        try:
            value = wl.evaluate(model)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{what}: evaluating the model on the test data failed: {one_line(e)}") from None
        if not math.isfinite(value) or (wl.metric == "accuracy" and not 0 <= value <= 1):
            raise UserError(f"{what}: its {wl.metric} on the test data is {value} (an accuracy is in [0, 1], a "
                            f"loss a finite number)")
