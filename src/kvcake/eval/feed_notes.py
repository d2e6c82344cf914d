"""The results page's note on how its fidelity measures feed a compressed cache (``--fidelity-feed``),
written by hand from ``scripts/feed_compare.py``'s output."""

FEED_NOTE = """
- **How this page's KL feeds a compressed cache, and what generating sees (2026-12-07).** Every
  fidelity figure above teacher-forces the question (context-only) and the full cache's
  continuation through the compressed cache in one forward (`--fidelity-feed chunk`, the
  default). A `decode=fixed` preset (`cake`, `cake-oneshot`, `cake-adakv`, `h2o`, `tova`,
  `streamingllm`, and their `+fp8` rows) evicts back to its budget only after that forward, so
  each of its predictions still sees the entries that `generate`, which feeds the continuation a
  token a step and evicts after each, has evicted by then; a `decode=none` preset keeps what is
  appended, so the feeding does not change it. `--fidelity-feed steps` feeds as `generate` does
  (its logits are `generate`'s: `tests/eval/test_fidelity.py`). The same prompts at ratio 0.25,
  fed both ways (`python -m kvcake.eval --suite results --threads 1 --no-progress --methods
  cake,cake-adakv,snapkv,adakv --ratios 0.25 --samples 6 --fidelity-feed steps --out
  docs/figures/eval_results_steps.jsonl`, the same with `--methods h2o,tova,streamingllm --samples
  2`, then `python scripts/feed_compare.py`; mean KL, chunk -> steps): question-aware `cake`
  0.0279 -> 0.0324 (+16%, higher on 28 of 36 prompts) and `cake-adakv` 0.0323 -> 0.0364 (+13%),
  `h2o` 0.0362 -> 0.0346 (-4%, 12 prompts), `tova` and `streamingllm` within 0.1%; context-only,
  where the question's chunk comes first either way, `cake` 0.3671 -> 0.3673, `cake-adakv`
  0.3558 -> 0.3551, `h2o` 0.1075 -> 0.1103 (+3%); `snapkv` and `adakv` equal to the digits shown.
  Issue 24's comparisons at 0.25 keep their outcome fed as `generate` feeds: question-aware `cake`
  0.0324 against 1.1 x `snapkv`'s 0.0495, `cake-adakv` 0.0364 against 1.1 x `adakv`'s 0.0536;
  context-only `cake` 0.3673 against `snapkv`'s 0.3455 (still missed), `cake-adakv` 0.3551
  against `adakv`'s 0.3568. Not measured stepwise: ratios 0.1 and 0.5, the ablation, the
  temperature sweep, the float8 rows and Gemma 3's page; CAKE's calibration
  (`kvcake.calibration.search`) also scores its temperatures fed in one chunk.
"""
