# `make test` is the README's test command and what .ci/run calls.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup test test-slow lint typecheck bench-smoke

# graphs/ and kernels/ install as compiled_engine.graphs and compiled_engine.kernels (pyproject's
# package-dir), which mypy cannot follow: build/typecheck/compiled_engine rebuilds that layout from
# symlinks, and [tool.mypy] in pyproject reads the package from there. The first run analyses torch
# and transformers too (minutes); later ones reuse build/mypy_cache (seconds).
define TYPECHECK
rm -rf build/typecheck
mkdir -p build/typecheck/compiled_engine
ln -s $(CURDIR)/compiled_engine/* $(CURDIR)/graphs $(CURDIR)/kernels build/typecheck/compiled_engine/
$(BIN)/mypy
endef

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned here, not in pyproject: 2.13.0 is the CPU wheel this machine has on disk.
# GPU users install their own CUDA torch first; pyproject only asks for torch>=2.9.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'

# Two workers, a test file each at a time (--dist loadfile: a module's fixtures are built once): on
# a 2-core machine like CI's the default suite took 13.5 minutes this way, against 21 on one worker.
test: setup
	$(BIN)/ruff check .
	$(TYPECHECK)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(TYPECHECK)

typecheck: setup
	$(TYPECHECK)
