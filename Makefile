# Every target creates the virtual environment and installs the project on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 is pinned in pyproject; pip takes the CPU wheel that lies on the build machines.
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: install
	$(BIN)/ruff check engine telemetry policies controller bench tests
	$(BIN)/mypy

test: install lint
	$(BIN)/spectune db check-migrations
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/spectune demo

# Benchmarks are not tests: each writes JSON + PNG under bench/results/ and prints a table (see README).
bench: install
	$(BIN)/spectune bench engine
	$(BIN)/spectune bench telemetry
	$(BIN)/spectune bench policies
	$(BIN)/spectune bench controller

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
