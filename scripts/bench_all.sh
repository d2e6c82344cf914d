#!/usr/bin/env bash
# Regenerate docs/benchmarks.md and its figures (docs/figures/*.png, with the JSON results next
# to them) with one command. Extra arguments go to `python -m kvcake.bench all`, e.g.
#   scripts/bench_all.sh --quick          # a smoke run of a few minutes
#   scripts/bench_all.sh --threads 1      # on a machine whose cores other work shares
#   scripts/bench_all.sh --device cuda    # on a GPU (bfloat16 by default there)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m kvcake.bench all --out docs/figures --doc docs/benchmarks.md -v "$@"
