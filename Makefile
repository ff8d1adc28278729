# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: install
	$(BIN)/thinwire compare --preset quick --out results/demo

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests

# the inner loop: everything but the long end-to-end runs and the tests of killed or stalled processes
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not processes" tests

clean:
	rm -rf $(VENV) results build *.egg-info
