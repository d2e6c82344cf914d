"""The results page's note on how its fidelity measures feed a compressed cache (``--fidelity-feed``),
written by hand from ``scripts/feed_compare.py``'s output."""

FEED_NOTE = """
- **How this page's KL feeds a compressed cache, and what generating sees (2026-12-07, before the
  rerun above: the `cake` and `cake-adakv` figures of this bullet are the old measurements, and
  their stepwise cells were removed from `eval_results_steps.jsonl`, not yet measured again).** Every
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
  KL over 36 prompts, chunk -> steps): question-aware `cake` 0.0958 -> 0.0964, 0.0279 -> 0.0324
  (+16%, higher on 28 of 36 prompts) and 0.00502 -> 0.00507 at ratios 0.1 / 0.25 / 0.5,
  `cake-adakv` +0.4% / +13% / +1.6%; context-only, where the question's chunk comes first either
  way, `cake` 0.4597 -> 0.4648 (+1.1%), 0.3671 -> 0.3673, 0.1930 -> 0.1927, `cake-adakv` +0.7% /
  -0.2% / -0.1%; at 0.25 on 12 prompts `h2o` -4% question-aware and +3% context-only, `tova` and
  `streamingllm` within 0.1%; `snapkv` and `adakv` equal to the digits shown. Issue 24's targets
  fed as `generate` feeds: every question-aware one still holds (`cake` 0.0964 / 0.0324 / 0.00507
  against 1.1 x `snapkv`'s 0.127 / 0.0544 / 0.0161; `cake-adakv` against 1.1 x `adakv`'s alike),
  and so do context-only `cake-adakv` <= `adakv` at 0.1 and 0.25 (0.4629 against 0.4729, 0.3551
  against 0.3568) and `cake` <= `pyramidkv` (0.4648 against 0.4778, 0.3673 against 0.3899); but
  context-only `cake` <= `snapkv` at 0.1, which holds in the targets table above (0.4597 against
  0.4617), does not (0.4648 against 0.4617), and at 0.25 it stays missed (0.3673 against 0.3455).
  Not measured stepwise: the ablation, the temperature sweep, the float8 rows, the 12-prompt
  presets at 0.1 and 0.5, and Gemma 3's page; CAKE's calibration (`kvcake.calibration.search`)
  also scores its temperatures fed in one chunk.
"""
