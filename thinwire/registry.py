"""Name -> constructor tables (one per family), so the CLI, configs and tests enumerate the same list."""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import pkgutil
import sys
from typing import Any, Callable

from .errors import UserError


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None)}
_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_KIND = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


class Limit:
    """The range a numeric parameter may take, declared beside its constructor (`limits = {"levels":
    between(1, 127)}` on the class, or the attribute of a function) and checked by the registry before the
    constructor runs, with the type its signature declares: the one validation path of the CLI, `thinwire
    compare`'s cells, the benchmarks and the Python API (`compressors.get`, `Trainer(...)`)."""

    def __init__(self, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
                 high_open: bool = False, infinite: bool = False):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.infinite = infinite      # +inf (and -inf) allowed: "no limit"

    def ok(self, v: float) -> bool:
        if math.isnan(v) or (math.isinf(v) and not self.infinite):
            return False
        return (v > self.low if self.low_open else v >= self.low) and (v < self.high if self.high_open
                                                                          else v <= self.high)

    def describe(self, integer: bool) -> str:
        if integer and not self.low_open and not self.high_open and math.isfinite(self.low) \
                and math.isfinite(self.high):
            return f"in {self.low:g}..{self.high:g}"
        if math.isinf(self.high):
            return "" if math.isinf(self.low) else f"{'>' if self.low_open else '>='} {self.low:g}"
        if math.isinf(self.low):
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def at_least(low: float, **kw) -> Limit:
    return Limit(low, **kw)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Limit:
    return Limit(low, high, low_open, high_open)


NON_NEGATIVE = at_least(0)
SEED = between(0, 2**63 - 1)


class Param:
    """One parameter as the registry checks it: the types it takes (None: unknown, taken as given), its
    default, and its declared `Limit` (None: any value of its type, finite for numbers)."""

    def __init__(self, name: str, kinds: tuple | None, default=None, limit: Limit | None = None):
        self.name, self.kinds, self.default, self.limit = name, kinds, default, limit

    def describe(self) -> str:
        kinds = [k for k in (self.kinds or ()) if k is not type(None)]
        kind = " or ".join(_KIND.get(k, k.__name__) for k in kinds) or "a value"
        span = self.limit.describe(kinds == [int]) if self.limit else ""
        if self.limit and self.limit.infinite:
            kind = kind.replace("a finite number", "a number")
        return f"{kind} {span}".strip() + (" (or none)" if type(None) in (self.kinds or ()) else "")

    def coerce(self, value, what: str):
        """`value` as this parameter takes it (a CLI string converted to its type); a UserError naming `what`,
        the parameter and what it takes otherwise."""
        got = self._typed(value)
        number = isinstance(got, (int, float)) and not isinstance(got, bool)
        if got is _BAD or (number and not (self.limit.ok(got) if self.limit else math.isfinite(got))):
            raise UserError(f"{what}: {self.name} must be {self.describe()}, got {value!r}")
        return got

    def _typed(self, value):
        kinds = self.kinds
        if kinds is None:
            return parse_scalar(value) if isinstance(value, str) else value
        if value is None:
            return None if type(None) in kinds or self.default is None else _BAD
        if isinstance(value, str):
            for kind in kinds:
                got = _from_text(value, kind)
                if got is not _BAD:
                    return got
            return _BAD
        if isinstance(value, bool):
            return value if bool in kinds else _BAD
        if int in kinds and isinstance(value, numbers.Integral):
            return int(value)
        if int in kinds and float not in kinds and isinstance(value, numbers.Real) and math.isfinite(value) \
                and float(value).is_integer():
            return int(value)                       # 2.0 is the integer 2; 2.5 is not
        if float in kinds and isinstance(value, numbers.Real):
            return float(value)
        return value if any(k not in (int, float, bool, str, type(None)) for k in kinds) else _BAD


_BAD = object()


def _from_text(text: str, kind):
    if kind is bool:
        return _WORDS.get(text.strip().lower(), _BAD)
    if kind is str:
        return text
    try:
        number = float(text)
    except ValueError:
        return _BAD
    if kind is float:
        return number
    if kind is int and math.isfinite(number) and number.is_integer():   # "1e3" and "2.0" are integers too
        return int(number) if "." in text or "e" in text.lower() else int(text)
    return _BAD


def parse_scalar(text: str):
    """A value given as text with no declared type: an integer, else a number, else the text itself."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _kinds(p: inspect.Parameter) -> tuple | None:
    """The types `p` takes, from its annotation ("int", "float | None", "float | str"; None where it names other
    types) or else from its default."""
    ann = p.annotation
    if isinstance(ann, str) and ann.strip():
        names = [a.strip() for a in ann.split("|")]
        return tuple(_TYPES[n] for n in names) if all(n in _TYPES for n in names) else None
    if ann in (int, float, bool, str):
        return (ann,)
    if ann is inspect.Parameter.empty and type(p.default) in (int, float, bool, str):
        return (type(p.default),)
    return None


def declared_limits(ctor) -> dict[str, Limit]:
    """The `limits` a constructor declares (a class's, merged down its bases; a function's attribute)."""
    if isinstance(ctor, type):
        out: dict[str, Limit] = {}
        for klass in reversed(ctor.__mro__):
            out.update(vars(klass).get("limits", {}))
        return out
    return dict(getattr(ctor, "limits", {}))


def params_of(ctor) -> dict[str, Param]:
    """The keyword parameters of `ctor` as the registry checks them (signature and declared limits)."""
    limits = declared_limits(ctor)
    return {p.name: Param(p.name, _kinds(p), None if p.default is inspect.Parameter.empty else p.default,
                          limits.get(p.name))
            for p in inspect.signature(ctor).parameters.values()
            if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_params(what: str, declared: dict[str, Param], params: dict, takes_more: bool = False) -> dict:
    """`params` converted and checked against `declared` (name -> Param): the same rules for a constructor's
    signature (`call`) and for a declaration of its own (the PyTorch peers' parameters). An unknown name or a bad
    value is a UserError naming `what`."""
    out = {}
    for key, value in params.items():
        p = declared.get(key)
        if p is None:
            if not takes_more:
                names = ", ".join(declared) or "none"
                raise UserError(f"{what} has no parameter {key!r}; its parameters: {names}")
            out[key] = parse_scalar(value) if isinstance(value, str) else value
            continue
        out[key] = p.coerce(value, what)
    return out


class Registry:
    """A table of named constructors of one family (compressor, algorithm, workload, ...).

    Args:
        family: what the registered things are ("compressor", "algorithm", ...), for messages.
        variant_param: a parameter whose value picks one of several constructors under one name (an
            algorithm's `architecture`), or None.
        default_variant: (with `variant_param`) a constructor -> the value of `variant_param` it is by default.
        retired: a parameter that moved elsewhere -> where it went (its use is refused naming it).
    """

    def __init__(self, family: str, variant_param: str | None = None, default_variant: Callable | None = None,
                 retired: dict[str, str] | None = None):
        self.family = family
        self.retired = dict(retired or {})     # a parameter that moved elsewhere -> where it went (`check_retired`)
        self._table: dict[str, Callable] = {}
        self.compose: Callable | None = None   # optional: builds the constructor of a composite "a+b" name
        self.variant_param, self.default_variant = variant_param, default_variant
        self._variants: dict[str, dict[str, Callable]] = {}    # name -> variant value -> constructor

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

    def unregister(self, name: str) -> None:
        """Forget `name` and its variants (a test's toy leaves the table as it found it)."""
        self._table.pop(name, None)
        self._variants.pop(name, None)

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

    def check_retired(self, name, param: str) -> None:
        """A UserError naming where `param` went, where `name` no longer takes it (`retired`)."""
        if isinstance(name, str) and param in self.retired and not self.accepts(name, param):
            raise UserError(f"{self.family} {name!r} no longer takes {param}: {self.retired[param]}")

    def get(self, name, **params):
        """Build `name` with `params` (CLI strings are converted to the parameter's type)."""
        if not isinstance(name, str):
            if params:
                raise UserError(f"parameters {sorted(params)} given with a ready-made {self.family} object")
            return name
        ctor = self.constructor(name, params)
        for key in params:
            self.check_retired(name, key)
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
            for reg, name in tables:
                reg.check_retired(name, key)
            valid = sorted({p for reg, name in tables if isinstance(name, str) for p in reg.parameters(name)}
                           | {p for names in fixed for p in names})
            owners = ", ".join(f"{what} {name!r}" for what, (_, name) in named.items())
            raise UserError(f"unknown parameter {key!r} for {owners}; valid: {', '.join(valid) or 'none'}")
        for i in takers:
            routed[i][key] = value
    return routed


def call(ctor: Callable, what: str, params: dict):
    """`ctor(**params)` with CLI strings converted to the types its signature declares and every value checked
    (type, finiteness, the `limits` it declares); an unknown parameter or a bad value is a UserError naming
    `what` and its valid parameters."""
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(ctor).parameters.values())
    kwargs = check_params(what, params_of(ctor), params, takes_more=takes_kwargs)
    try:
        return ctor(**kwargs)
    except TypeError as e:
        raise UserError(f"{what}: {e}") from None


def import_submodules(package_name: str, package_path) -> None:
    """Import every module of a package so each file registers itself (one concept per file)."""
    for mod in sorted(pkgutil.iter_modules(package_path), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{package_name}.{mod.name}")
