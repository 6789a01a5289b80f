# `make test` is the README's test command and what .ci/run calls.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup test test-slow lint bench-smoke

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned here, not in pyproject: 2.13.0 is the CPU wheel this machine has on disk.
# GPU users install their own CUDA torch first; pyproject only asks for torch>=2.9.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
