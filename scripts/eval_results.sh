#!/usr/bin/env bash
# Regenerate docs/results.md and its figures (docs/figures/eval_results_*.png, with the per-cell
# results in docs/figures/eval_results.jsonl) with one command:
#   scripts/eval_results.sh                 # the full suite: every preset at 2 samples, then issue 24's six methods
#                                           # and the CAKE ablation's rows at 6 (about three hours on one core; the
#                                           # ablation's 1008 cells took 66 min of it, 2026-11-28)
#   scripts/eval_results.sh --threads 1     # on a machine whose cores other work shares
# The run is resumable: cells already in the JSONL are skipped, so rerunning after an
# interruption (or after deleting some lines) only computes what is missing, then rewrites the
# page. Extra arguments go to `python -m kvcake.eval --suite results` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m kvcake.eval --suite results "$@"
