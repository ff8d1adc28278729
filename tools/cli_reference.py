"""The CLI reference, generated from thinwire's own argument parsers (`thinwire.cli.build_parser`).

Used two ways: as a MkDocs hook (mkdocs.yml `hooks:`), it fills the page that holds the marker
`<!-- cli-reference -->`; as a script, `python tools/cli_reference.py` prints the same Markdown.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's thinwire, installed or not

MARKER = "<!-- cli-reference -->"


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _walk(parser: argparse.ArgumentParser, path: list[str], depth: int, out: list[str]) -> None:
    os.environ["COLUMNS"] = "82"   # argparse wraps at the terminal width less 2: the site's 80-column code box
    out.append(f"{'#' * depth} `{' '.join(path)}`\n")
    out.append("```text\n" + parser.format_help().rstrip() + "\n```\n")
    sub = _subparsers(parser)
    if sub is not None:
        for name, child in sorted(sub.choices.items()):
            _walk(child, path + [name], min(depth + 1, 4), out)


def render() -> str:
    from thinwire.cli import build_parser

    out: list[str] = []
    _walk(build_parser(), ["thinwire"], 2, out)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs hook
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown


if __name__ == "__main__":
    print(render())
