#!/usr/bin/env bash
# Build thinwire's sdist and wheel, install the wheel (not editable) into a clean virtual environment of its own
# (no system or project site-packages) and run the installed command from a folder outside the checkout, so the
# source tree cannot be imported: `thinwire --version`, `thinwire list` and one short `thinwire train`.
# Usage: tools/wheel_check.sh [PYTHON]   (PYTHON builds the wheel and needs the `build` package; default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m build --outdir "$TMP/dist" . >"$TMP/build.log" 2>&1 || { cat "$TMP/build.log"; exit 1; }
ls "$TMP"/dist/thinwire-*.tar.gz >/dev/null
WHEEL=$(ls "$TMP"/dist/thinwire-*.whl)
python3 -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --no-compile "$WHEEL" 'torch==2.13.0' 2>&1 | grep -v '^WARNING: Location' || true
cd "$TMP"  # not the checkout: what runs below is the installed wheel or nothing
BIN="$TMP/venv/bin"
where=$("$BIN/python" -c 'import thinwire, os; print(os.path.dirname(thinwire.__file__))')
case "$where" in "$TMP/venv/"*) ;; *) echo "wheel check: thinwire imported from $where, not the wheel" >&2; exit 1;; esac
version=$("$BIN/thinwire" --version)
meta=$("$BIN/python" -c 'import importlib.metadata as m; print(m.version("thinwire"))')
[ "$version" = "thinwire $meta" ] || { echo "wheel check: '$version' but the wheel's metadata says $meta" >&2; exit 1; }
"$BIN/thinwire" list >"$TMP/list.txt"
grep -q diloco "$TMP/list.txt" || { echo "wheel check: thinwire list names no diloco" >&2; exit 1; }
"$BIN/thinwire" train --workload digits-mlp --workers 2 --algorithm diloco --period 5 --steps 20 --network lan \
    --out "$TMP/run" --quiet
test -s "$TMP/run/summary.json"
echo "wheel check: $(basename "$WHEEL") installed in a clean venv; $version, list and train ran outside the checkout"
