"""The documentation: every page the site lists exists, the README fits on two screens, no paragraph twice."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.M)


def test_every_nav_page_exists_and_every_page_is_in_nav():
    pages = _nav_pages()
    assert len(pages) >= 10
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.parts[len(DOCS.parts)] != "benchmarks"}
    assert on_disk - set(pages) == set(), f"pages under docs/ not in the nav: {sorted(on_disk - set(pages))}"


def test_readme_fits_on_two_screens_and_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 100
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README links to a missing file: {target}"


def _paragraphs(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)   # commands may repeat; prose may not
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if len(p) >= 120 and not p.startswith(("#", "|"))]


def test_no_paragraph_appears_in_two_documents():
    files = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))   # BENCHMARKS.md: docs/benchmarks/ holds its raw notes
    seen: dict[str, Path] = {}
    repeats = []
    for f in files:
        for p in _paragraphs(f):
            if p in seen and seen[p] != f:
                repeats.append(f"{f.relative_to(ROOT)} repeats {seen[p].relative_to(ROOT)}: {p[:80]}...")
            seen.setdefault(p, f)
    assert not repeats, "\n".join(repeats)


def test_algorithm_parameters_page_matches_the_code():
    """docs/api/algorithm-parameters.md lists every registered algorithm's parameters as its constructor takes
    them: the page's tables are `tools/algorithm_parameters.py`'s rendering of today's code."""
    import importlib.util

    from thinwire import algorithms
    spec = importlib.util.spec_from_file_location("algorithm_parameters", ROOT / "tools" / "algorithm_parameters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = mod.page_tables(mod.PAGE.read_text())
    assert page == mod.render().strip("\n"), \
        "docs/api/algorithm-parameters.md is out of date: python tools/algorithm_parameters.py --write"
    for name in algorithms.registry.names():
        assert f"### `{name}`" in page
    assert "| `outer_lr` | `0.7` |" in page and "| `period` |" in page


def test_cli_reference_is_generated_from_the_parsers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.MARKER in (DOCS / "cli-reference.md").read_text()
    page = mod.render()
    for command in ("thinwire train", "thinwire compare", "thinwire advise", "thinwire bench latency"):
        assert f"`{command}`" in page
    assert "--algorithm" in page and "--network" in page


# our working notes (the "seed NNN" paper texts and the catalogs made from them) are not the reader's: cite the paper
_NOTES = re.compile("|".join([r"\bseed 0\d\d\b", r"\bseed \d{3}\b", r"\bseed survey\b", r"\bcatalog\s*(?:§|\d|'s|Appendix|\[)",
                              r"\bthe catalog\b", r"\[(?:SUPP|O|ERRATUM)\]", r"\berratum \d+ of\b"]), re.I)


def test_citations_name_the_paper_not_our_notes():
    files = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md")) + sorted(DOCS.rglob("*.py"))
    files += sorted((ROOT / "thinwire").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files if p.name != "test_docs.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if _NOTES.search(line)]
    assert not found, "cite the paper (authors, year, title or arXiv id, equation), not a seed or catalog:\n" + \
        "\n".join(found)


def _defined(tree) -> dict[str, set[str] | None]:
    """Module-level names of a parsed module: class -> the names its body defines, function/constant -> None."""
    import ast
    out: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            names |= {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}     # self.x = ... in a method
            out[node.name] = names
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.Assign):
            out.update((t.id, None) for t in node.targets if isinstance(t, ast.Name))
    return out


def test_design_names_real_files_and_functions():
    """docs/design.md names code as `file.py:Class.method` (under thinwire/): every such file, class and function
    exists; so does every `Class.method` of a class defined in a file the page names."""
    import ast
    text = (DOCS / "design.md").read_text()
    named = re.findall(r"\b((?:\w+/)*\w+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)", text)
    assert len(named) >= 20, "design.md should name the code it describes as file.py:function"
    modules, classes, missing = {}, {}, []
    for path, name in named:
        if path == "file.py":           # the page's own notation
            continue
        file = ROOT / "thinwire" / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
            continue
        if path not in modules:
            modules[path] = _defined(ast.parse(file.read_text()))
            classes.update((c, (path, body)) for c, body in modules[path].items() if body is not None)
        top, _, attr = name.partition(".")
        if top not in modules[path] or (attr and attr not in (modules[path][top] or ())):
            missing.append(f"{path}:{name}")
    for cls, attr in re.findall(r"\b([A-Z]\w*)\.(_?[a-z]\w*)\b", text):
        if cls in classes and attr not in classes[cls][1] and not attr.startswith("__"):
            missing.append(f"{classes[cls][0]}:{cls}.{attr}")
    assert not missing, "docs/design.md names code that does not exist:\n" + "\n".join(sorted(set(missing)))


COLUMN = 80     # what the site's code box shows without scrolling (Material's column, 1400 px, 13.6 px monospace)
_SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', flags=re.M)


def _blocks(path: Path, shown: bool = True) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a page; `shown`: a `--8<-- "file"` line replaced by the file the
    site shows there (an example, which tests/test_examples.py runs as its header says)."""
    blocks = re.findall(r"```(\w*)[^\n]*\n(.*?)```", path.read_text(), flags=re.S)
    if not shown:
        return blocks
    return [(lang, _SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text().rstrip("\n"), code))
            for lang, code in blocks]


_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


def _indented_blocks(text: str) -> list[str]:
    """Markdown's other code blocks: lines indented by 4 spaces after a blank line, outside fences, lists and
    docstring sections (`Args:`), which Markdown renders as paragraphs."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks, current, context = [], None, ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if current is not None and (line.startswith("    ") or not line.strip()):
            current.append(line[4:])
            continue
        if current is not None:
            blocks.append("\n".join(current))
            current = None
        if line.startswith("    ") and i and not lines[i - 1].strip() and not _LIST_ITEM.match(context) \
                and not context.startswith(" ") and not re.match(r"^\w[\w ]*:$", context):
            current = [line[4:]]
        elif line.strip():
            context = line
    if current is not None:
        blocks.append("\n".join(current))
    return blocks


def _api_docstrings() -> dict[str, str]:
    """The docstrings the API pages render: each `::: path` entry's, and its public members' (a module's or a
    class's), one level down."""
    import importlib
    import inspect
    out = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            module, _, attr = path.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                obj = importlib.import_module(path)
            members = [(path, obj)]
            if inspect.ismodule(obj) or inspect.isclass(obj):
                members += [(f"{path}.{k}", v) for k, v in vars(obj).items() if not k.startswith("_")
                            and (inspect.isclass(v) or callable(v) or isinstance(v, property))]
            for where, member in members:
                member = member.fget if isinstance(member, property) else member
                if getattr(member, "__doc__", None) and not isinstance(member, (str, int, float, tuple, dict)):
                    out[where] = inspect.cleandoc(member.__doc__)
    return out


def test_code_blocks_fit_the_box():
    """Every line of every code block the site shows (a page's, the README's, an included example's, a
    docstring's on the API pages, the generated CLI reference) fits the box; tables are not code."""
    import importlib.util
    wide = []
    for f in [ROOT / "README.md"] + sorted(DOCS.glob("*.md")):
        for code in [c for _, c in _blocks(f)] + _indented_blocks(f.read_text()):
            wide += [f"{f.relative_to(ROOT)}: {line}" for line in code.splitlines() if len(line) > COLUMN]
    for where, doc in _api_docstrings().items():
        for code in _indented_blocks(doc):
            wide += [f"docstring of {where}: {line}" for line in code.splitlines() if len(line) > COLUMN]
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for _, code in re.findall(r"```(\w*)[^\n]*\n(.*?)```", cli.render(), flags=re.S):
        wide += [f"docs/cli-reference.md: {line}" for line in code.splitlines() if len(line) > COLUMN]
    assert not wide, f"code lines wider than {COLUMN}:\n" + "\n".join(wide)


def test_every_benchmark_page_is_linked_from_the_benchmarks_page():
    index = (DOCS / "benchmarks.md").read_text()
    pages = {p.name for p in (DOCS / "benchmarks").glob("*.md")}
    linked = set(re.findall(r"\(benchmarks/([\w.-]+\.md)\)", index))
    assert pages == linked, f"not linked: {sorted(pages - linked)}; missing: {sorted(linked - pages)}"


def test_the_api_reference_documents_every_public_name():
    """Every name `import thinwire as tw` exports, and the integrations', has an entry (`::: path`) whose object is
    that name's (or, for a registry or a package documented on its own page, a link to it)."""
    import importlib
    import inspect

    import thinwire
    entries = {}
    for page in (DOCS / "api").glob("*.md"):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            module, _, attr = path.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                obj = importlib.import_module(path)
            entries[id(obj)] = path
            if inspect.ismodule(obj):       # a module's entry documents its public members
                entries.update({id(v): f"{path}.{k}" for k, v in vars(obj).items() if not k.startswith("_")})
    api_text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    missing = []
    for name in thinwire.__all__:
        obj = getattr(thinwire, name)
        if id(obj) not in entries and f"tw.{name}" not in api_text:
            missing.append(name)
    assert not missing, f"public names without an API entry: {missing}"
    assert "thinwire.integrations.lightning.ThinwireStrategy" in entries.values()
    assert "thinwire.integrations.accelerate.attach" in entries.values()


_ARGS = re.compile(r"^(?:Args|Parameters):[ \t]*$", re.M)


def _documented_parameters(doc: str | None) -> set[str] | None:
    """The names a Google-style docstring's `Args:` section documents (None: it has none), as the site renders it
    (mkdocstrings, `docstring_style: google`)."""
    import inspect
    doc = inspect.cleandoc(doc or "")
    found = _ARGS.search(doc)
    if found is None:
        return None
    names = set()
    for line in doc[found.end():].splitlines():
        if line.strip() and not line.startswith(" "):
            break                                       # the next section
        entry = re.match(r"^ {4}\*{0,2}(\w+)(?: \([^)]*\))?:", line)
        if entry:
            names.add(entry.group(1))
    return names


def _public_api() -> dict[str, object]:
    """What a user calls: every function and class `import thinwire as tw` exports, and the integrations'."""
    import inspect

    import thinwire
    from thinwire.integrations import accelerate, lightning
    from thinwire.registry import Registry
    names = {f"tw.{n}": getattr(thinwire, n) for n in thinwire.__all__}
    names |= {"tw.Registry": Registry, "thinwire.lightning.ThinwireStrategy": lightning.ThinwireStrategy,
              "thinwire.lightning.sidecar": lightning.sidecar, "thinwire.accelerate.attach": accelerate.attach}
    return {n: o for n, o in names.items() if inspect.isclass(o) or inspect.isfunction(o)}


def test_every_public_name_documents_its_parameters():
    """The API pages show each public function's and class's parameters (an `Args:` section naming every one of
    its signature's), and every public method of the objects a training script holds (Trainer, Attachment, Pool)
    says what it does: an undocumented member is hidden by mkdocstrings."""
    import inspect

    import thinwire as tw
    missing = []

    def check(where, fn, doc):
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls") and not p.startswith("_")]
        documented = _documented_parameters(doc)
        if params and documented is None:
            missing.append(f"{where}: no Args section")
        elif params:
            missing.extend(f"{where}: parameter {p!r} undocumented" for p in params if p not in documented)

    for name, obj in _public_api().items():
        if inspect.isclass(obj):
            if any("__init__" in vars(c) for c in obj.__mro__ if c.__module__.startswith("thinwire")):
                doc = obj.__doc__ if _documented_parameters(obj.__doc__) is not None else obj.__init__.__doc__
                check(name, obj, doc)
        else:
            check(name, obj, obj.__doc__)
    for cls in (tw.Trainer, tw.Attachment, tw.Pool):
        for attr, member in vars(cls).items():
            if attr.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else member
            if not callable(fn):
                continue
            if not (fn.__doc__ or "").strip():
                missing.append(f"tw.{cls.__name__}.{attr}: no docstring")
            elif not isinstance(member, property):
                check(f"tw.{cls.__name__}.{attr}", fn, fn.__doc__)
    assert not missing, "document these on the API pages:\n" + "\n".join(missing)


def complete_programs() -> list[tuple[str, str]]:
    """(where, code) of every Python block in the README and the docs that is a whole program (it launches its
    workers under `if __name__ == "__main__":`): tests/test_examples.py runs each."""
    out = []
    for f in [ROOT / "README.md"] + sorted(DOCS.glob("*.md")):
        for i, (lang, code) in enumerate(_blocks(f, shown=False)):
            if lang == "python" and 'if __name__ == "__main__":' in code:
                out.append((f"{f.relative_to(ROOT)}#{i}", code))
    return out


@pytest.mark.slow
def test_the_two_machine_script_runs_on_one_machine(tmp_path):
    """docs/multi-host.md's torchrun script (its two machines' commands are run across two hosts by
    tests/test_hosts.py where namespaces can be made) runs under the page's one-machine command: both ranks end
    with one model."""
    import os
    import shutil
    import subprocess
    import sys
    page = DOCS / "multi-host.md"
    scripts = [code for lang, code in _blocks(page) if lang == "python" and "tw.init()" in code]
    commands = [line for lang, code in _blocks(page) if lang == "bash" for line in code.splitlines()
                if line.startswith("torchrun --standalone")]
    assert len(scripts) == 1 and len(commands) == 1, (len(scripts), commands)
    (tmp_path / "train.py").write_text(scripts[0])
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    argv = [torchrun, *commands[0].split()[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "THINWIRE_NO_PROGRESS": "1"}
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = re.findall(r"rank (\d) of 2: model (\w+), ([\d.]+) MB sent", run.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], run.stdout
    assert len({m for _, m, _ in lines}) == 1 and all(float(mb) > 0 for _, _, mb in lines)


def test_the_front_pages_hold_a_complete_program():
    where = {w.split("#")[0] for w, _ in complete_programs()}
    assert {"README.md", "docs/index.md", "docs/getting-started.md"} <= where, where
