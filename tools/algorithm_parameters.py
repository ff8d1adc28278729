"""The parameters of every registered algorithm, generated from their constructors' signatures (the registry's
`params_of`, what `tw.Trainer` and `--algorithm NAME --param value` accept).

`docs/api/algorithm-parameters.md` holds the generated tables between the markers below; tests/test_docs.py checks
them against `render()`, so the page cannot drift from the code. `python tools/algorithm_parameters.py --write`
rewrites them after a change; without `--write` it prints them.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's thinwire, installed or not

PAGE = ROOT / "docs" / "api" / "algorithm-parameters.md"
BEGIN, END = "<!-- algorithm-parameters -->", "<!-- /algorithm-parameters -->"
HEADER = "| parameter | default | takes | only with |\n| --- | --- | --- | --- |\n"


def _summary(cls) -> str:
    """The first paragraph of the algorithm's docstring (else its module's), on one line."""
    own = cls.__doc__ or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    first = inspect.cleandoc(own).split("\n\n")[0]
    return " ".join(first.split()).replace("|", "\\|")


def _default(value) -> str:
    return "required" if value is inspect.Parameter.empty else f"`{value!r}`"


def render() -> str:
    from thinwire import algorithms
    from thinwire.registry import params_of

    reg = algorithms.registry
    out = []
    for name in reg.names():
        main = reg.lookup(name)
        ctors = [(None, main)] + sorted(reg.variants(name).items())
        out.append(f"### `{name}`\n\n{_summary(main)}\n")
        rows, seen = [], set()
        for variant, ctor in ctors:
            for p in params_of(ctor).values():
                if p.name in seen:
                    continue
                seen.add(p.name)
                where = "" if variant is None else f"`{reg.variant_param}={variant!r}`"
                takes = p.describe()
                if p.name == reg.variant_param:     # None: the algorithm's own architecture
                    takes = " or ".join(f"`{v!r}`" for v in [reg.default_variant(main), *sorted(reg.variants(name))])
                rows.append(f"| `{p.name}` | {_default(p.default)} | {takes} | {where} |")
        if rows:
            out.append(HEADER + "\n".join(rows) + "\n")
        else:
            out.append("No parameters.\n")
    return "\n".join(out)


def page_tables(text: str) -> str:
    """What the page holds between its markers."""
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


if __name__ == "__main__":
    tables = render()
    if "--write" in sys.argv[1:]:
        text = PAGE.read_text()
        head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
        PAGE.write_text(f"{head}\n{tables}\n{tail}")
    else:
        print(tables)
