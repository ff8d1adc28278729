# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast docs clean

install: $(STAMP)

# the integrations' extras too (Lightning, Accelerate) and torchft (peers), so their tests run against the real
# packages (measured on a fresh venv without a pip cache: +12 s of CPU time, 2 min 13 s of wall time under a load
# of 20-30; the base install took 42 s of CPU time, 8 min 20 s of wall time there)
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,lightning,accelerate,peers]' 'torch==2.13.0'
	touch $(STAMP)

# the race includes torchft's DiLoCo: its extra goes beside the torch pin (a note, not a failure, where it cannot)
demo: install
	$(BIN)/python -c "import torchft" 2>/dev/null || $(BIN)/pip install -q -e '.[peers]' 'torch==2.13.0' \
		|| echo "note: torchft could not be installed; the race skips torchft-diloco"
	$(BIN)/thinwire compare --preset quick --out results/demo

# two test processes (pytest-xdist), one test file each at a time: the suite keeps both cores busy (three processes
# took as long, the cores never idle); files in the order tests/conftest.py gives them, the longest first, so that
# no long file runs alone at the end (pytest 482-488 s on an idle 2-core machine, 404-441 s on fresh clones, 2026-11-29)
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=30 tests

# the inner loop: everything but the long end-to-end runs and the tests of killed or stalled processes
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not processes" tests

# the documentation site (MkDocs + Material + mkdocstrings) into build/site; --strict: a broken reference fails
docs: install
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(BIN)/pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) results build *.egg-info
