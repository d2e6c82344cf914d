"""The results page's note on how its fidelity measures feed a compressed cache (``--fidelity-feed``),
written by hand from ``scripts/feed_compare.py``'s output."""

FEED_NOTE = """
- **How this page's KL feeds a compressed cache, and what generating sees (2026-12-07; the `cake`
  and `cake-adakv` stepwise cells measured again after the rerun above, 29 minutes).** Every
  fidelity figure above teacher-forces the question (context-only) and the full cache's
  continuation through the compressed cache in one forward (`--fidelity-feed chunk`, the
  default). A `decode=fixed` preset (`cake`, `cake-oneshot`, `cake-adakv`, `h2o`, `tova`,
  `streamingllm`, and their `+fp8` rows) evicts back to its budget only after that forward, so
  each of its predictions still sees the entries that `generate`, which feeds the continuation a
  token a step and evicts after each, has evicted by then; a `decode=none` preset keeps what is
  appended, so the feeding does not change it. `--fidelity-feed steps` feeds as `generate` does
  (its logits are `generate`'s: `tests/eval/test_fidelity.py`). The same prompts fed both ways
  (`python -m kvcake.eval --suite results --threads 1 --no-progress --methods
  cake,cake-adakv,snapkv,adakv --ratios R --samples 6 --fidelity-feed steps --out
  docs/figures/eval_results_steps.jsonl` for R = 0.1, 0.25 and 0.5, and with `--methods
  h2o,tova,streamingllm --ratios 0.25 --samples 2`, then `python scripts/feed_compare.py`; mean
  KL over 36 prompts, chunk -> steps): question-aware `cake` 0.0787 -> 0.0789, 0.0180 -> 0.0185
  (+2.5%, higher on 23 of 36 prompts) and 0.00502 -> 0.00505 at ratios 0.1 / 0.25 / 0.5,
  `cake-adakv` +0.5% / +0.7% / +1.3%; context-only, where the question's chunk comes first either
  way, `cake` 0.4687 -> 0.4733 (+1.0%), 0.3661 -> 0.3647, 0.1930 -> 0.1927, `cake-adakv` +0.8% /
  +0.1% / -0.1%; at 0.25 on 12 prompts `h2o` -4% question-aware and +3% context-only, `tova` and
  `streamingllm` within 0.1%; `snapkv` and `adakv` equal to the digits shown. (Before the rerun
  above, CAKE scored by the shared prefill's stand-in, `cake` rose by 16% question-aware at 0.25.)
  Issue 24's targets fed as `generate` feeds: every question-aware one still holds (`cake` 0.0789
  / 0.0185 / 0.00505 against 1.1 x `snapkv`'s 0.127 / 0.0544 / 0.0161; `cake-adakv` 0.0744 /
  0.0196 / 0.00364 against 1.1 x `adakv`'s 0.110 / 0.0589 / 0.0287), and so do context-only
  `cake-adakv` <= `adakv` at 0.1 and 0.25 (0.4671 against 0.4729, 0.3339 against 0.3568) and
  `cake` <= `pyramidkv` (0.4733 against 0.4778, 0.3647 against 0.3899); context-only `cake` <=
  `snapkv`, missed fed in one chunk at 0.1 and 0.25, is missed fed a token a step too (0.4733
  against 0.4617, 0.3647 against 0.3455).
  Not measured stepwise: the ablation, the temperature sweep, the float8 rows, the 12-prompt
  presets at 0.1 and 0.5, and Gemma 3's page; CAKE's calibration (`kvcake.calibration.search`)
  also scores its temperatures fed in one chunk.
"""
