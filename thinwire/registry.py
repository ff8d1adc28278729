"""Name -> constructor tables (one per family), so the CLI, configs and tests enumerate the same list."""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from .errors import UserError


def _convert(value: Any, default: Any, annotation: Any) -> Any:
    """Turn a CLI string into the type a parameter expects (taken from its default or annotation)."""
    if not isinstance(value, str):
        return value
    kind = type(default) if default not in (inspect.Parameter.empty, None) else None
    if kind is None and isinstance(annotation, str):
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation.split("|")[0].strip())
    if kind is None and annotation in (int, float, bool, str):
        kind = annotation
    if kind is bool:
        low = value.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise UserError(f"expected true/false, got {value!r}")
    if kind in (int, float):
        try:
            number = float(value)
            if kind is int:          # "1e3" and "2.0" are integers too
                return int(number) if number.is_integer() else int(value)
            return number
        except ValueError:
            raise UserError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if kind is None:  # no type information: best effort number parsing
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
    return value


class Registry:
    """A table of named constructors of one family (compressor, algorithm, workload, ...)."""

    def __init__(self, family: str, variant_param: str | None = None, default_variant: Callable | None = None):
        self.family = family
        self._table: dict[str, Callable] = {}
        self.compose: Callable | None = None   # optional: builds the constructor of a composite "a+b" name
        # one constructor per (name, value of `variant_param`), e.g. an algorithm per architecture
        self.variant_param = variant_param
        self.default_variant = default_variant      # (with variant_param) constructor -> its default variant value
        self._variants: dict[str, dict[str, Callable]] = {}

    def register(self, name: str | None = None, variant: str | None = None):
        """Register a constructor under `name`; with `variant`, the one `get(name, <variant_param>=variant)`
        builds (the plain registration is the default variant)."""
        def deco(obj):
            key = name or getattr(obj, "name", None) or obj.__name__.lower()
            if variant is not None:
                self._variants.setdefault(key, {})[variant] = obj
            elif key in self._table and self._table[key] is not obj:
                raise RuntimeError(f"{self.family} {key!r} registered twice")
            else:
                self._table[key] = obj
            if isinstance(obj, type) and not vars(obj).get("name"):   # its own name, not a base class's
                obj.name = key
            return obj
        return deco

    def variants(self, name: str) -> dict[str, Callable]:
        """The constructors registered for the variants of `name` (besides its default)."""
        return dict(self._variants.get(name, {}))

    def constructor(self, name: str, params: dict) -> Callable:
        """The constructor `get(name, **params)` uses (the variant named by `params`, else the default)."""
        return self._variants.get(name, {}).get(params.get(self.variant_param), self.lookup(name))

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table

    def lookup(self, name: str) -> Callable:
        if name in self._table:
            return self._table[name]
        if self.compose is not None and "+" in name:
            return self.compose(name)
        raise UserError(f"unknown {self.family} {name!r}; valid: {', '.join(self.names())}")

    def parameters(self, name: str) -> dict[str, Any]:
        """The keyword parameters a constructor takes, with their defaults (None when required); with
        variants, those of every variant (the default's defaults first)."""
        out: dict[str, Any] = {}
        for ctor in [self.lookup(name), *self._variants.get(name, {}).values()]:
            for p in inspect.signature(ctor).parameters.values():
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self":
                    out.setdefault(p.name, None if p.default is inspect.Parameter.empty else p.default)
        return out

    def accepts(self, name: str, param: str) -> bool:
        return param in self.parameters(name)

    def get(self, name, **params):
        """Build `name` with `params` (CLI strings are converted to the parameter's type)."""
        if not isinstance(name, str):
            if params:
                raise UserError(f"parameters {sorted(params)} given with a ready-made {self.family} object")
            return name
        ctor = self.constructor(name, params)
        if self.variant_param is not None:      # a parameter of another variant: say which one takes it
            own = inspect.signature(ctor).parameters
            main = self.lookup(name)
            default = self.default_variant(main)
            everyone = {default: main, **self._variants.get(name, {})}
            for key in params:
                takers = [v for v, c in everyone.items() if c is not ctor and key in inspect.signature(c).parameters]
                if key not in own and takers:
                    mine = params.get(self.variant_param) or default
                    raise UserError(f"{self.family} {name!r}: {key} is for {self.variant_param}={takers[0]} "
                                    f"(--{self.variant_param} {takers[0]}); {self.variant_param} {mine!r} "
                                    f"has no {key}")
        return call(ctor, f"{self.family} {name!r}", params)

    def describe(self) -> list[dict]:
        rows = []
        for key in self.names():
            obj = self._table[key]
            own = obj.__doc__ or getattr(sys.modules.get(obj.__module__), "__doc__", None) or ""
            doc = [line for line in inspect.cleandoc(own).splitlines() if line.strip()]
            rows.append({"name": key, "summary": doc[0] if doc else "", "parameters": self.parameters(key)})
        return rows


def route(named: dict, params: dict, fixed: tuple = ()) -> list[dict]:
    """`params` by name: a dict for each `what: (registry, name)` of `named`, of the parameters the registered
    `name` declares (a ready-made object declares none), then one for each tuple of names in `fixed`; a
    parameter none of them takes is a UserError (the Trainer's routing and `ddp_hook`'s)."""
    tables = list(named.values())
    routed: list[dict] = [{} for _ in range(len(tables) + len(fixed))]
    for key, value in params.items():
        takers = [i for i, (reg, name) in enumerate(tables) if isinstance(name, str) and reg.accepts(name, key)]
        takers += [len(tables) + i for i, names in enumerate(fixed) if key in names]
        if not takers:
            valid = sorted({p for reg, name in tables if isinstance(name, str) for p in reg.parameters(name)}
                           | {p for names in fixed for p in names})
            owners = ", ".join(f"{what} {name!r}" for what, (_, name) in named.items())
            raise UserError(f"unknown parameter {key!r} for {owners}; valid: {', '.join(valid) or 'none'}")
        for i in takers:
            routed[i][key] = value
    return routed


def call(ctor: Callable, what: str, params: dict):
    """`ctor(**params)` with CLI strings converted to the types its signature declares; an unknown parameter
    or a bad value is a UserError naming `what` and its valid parameters."""
    valid = {p.name: p for p in inspect.signature(ctor).parameters.values() if p.name != "self"}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in valid.values())
    kwargs = {}
    for key, value in params.items():
        if key not in valid and not takes_kwargs:
            names = ", ".join(k for k, p in valid.items() if p.kind != p.VAR_KEYWORD) or "none"
            raise UserError(f"{what} has no parameter {key!r}; its parameters: {names}")
        p = valid.get(key)
        try:
            kwargs[key] = _convert(value, p.default if p else None, p.annotation if p else None)
        except UserError as e:
            raise UserError(f"{what} parameter {key!r}: {e}") from None
    try:
        return ctor(**kwargs)
    except TypeError as e:
        raise UserError(f"{what}: {e}") from None


def import_submodules(package_name: str, package_path) -> None:
    """Import every module of a package so each file registers itself (one concept per file)."""
    import importlib
    import pkgutil
    for mod in sorted(pkgutil.iter_modules(package_path), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{package_name}.{mod.name}")
