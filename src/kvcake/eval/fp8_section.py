"""The results page's section on kept entries stored in float8 (``kv_dtype="fp8"``).

Each ``<method>+fp8`` row of the results file is compared with ``<method>`` on the prompts both
have (the same replayed prefill, the same kept positions: only the storage differs), per
scenario and ratio: KL to the full cache, task score and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcake.eval.ablation import number, paired
from kvcake.eval.tables import SCENARIO_TITLES, mean_of, scenarios_in
from kvcake.fp8 import SUFFIX, storage_spec

INTRO = (
    '## Kept entries in float8 (`kv_dtype="fp8"`)\n\n'
    "Each row compares a method with its kept entries stored in float8 (e4m3, one byte per element; "
    'README, "Kept entries in 8 bits") with the same method in the model\'s dtype, on the prompts both '
    "have: the same prompt, kept positions and budgets, only the storage differs. *KL* is the mean "
    "KL(full || compressed) as in the tables above, *float8 at or below* counts the prompts where the "
    "float8 row's KL is at or below the other's, *score* is the task score (x100), *bytes* the KV bytes "
    "kept over the full cache's. The model runs in float32 here, so float8 holds a quarter of its bytes "
    "(half of bfloat16's, the dtype users serve in), plus the last 32 tokens' entries of every compressed "
    "layer again in the model's dtype, which the attention reads instead (`kvcake.fp8.RECENT`; counted "
    "in its bytes); `scripts/fp8_kl.py` measures the default model in bfloat16. *Half the ratio* is the "
    "same method in the model's dtype keeping half as many entries: in a bfloat16 model the bytes of the "
    "float8 row but its rings (32 entries per KV head in bfloat16, 1.6% of a 2k prompt's full cache); "
    "its KL (on the prompts both have) and on how many prompts float8 is at or below it."
)


def fp8_section(records: Sequence[dict[str, Any]]) -> str:
    """The section's markdown, or ``""`` when the records hold no ``+fp8`` method with its base."""
    methods = list(dict.fromkeys(r["method"] for r in records if r["method"].endswith(SUFFIX)))
    present = {r["method"] for r in records}
    pairs = [(m, storage_spec(m)[0]) for m in methods if storage_spec(m)[0] in present]
    if not pairs:
        return ""
    lines = [
        INTRO,
        "",
        "| method | scenario | ratio | KL | KL, float8 | float8 at or below | score | score, float8 | bytes | bytes, float8 "
        "| KL, half the ratio | float8 at or below it |",
        "|---" * 12 + "|",
    ]
    for fp8, base in pairs:
        for sc in scenarios_in(records):
            ratios = sorted({r["ratio"] for r in records if r["method"] == fp8 and r["scenario"] == sc})
            for ratio in ratios:
                kl_fp8, kl, below, _, _ = paired(records, fp8, base, sc, ratio, "kl")
                score_fp8, score, _, _, _ = paired(records, fp8, base, sc, ratio, "score")
                row = [f"`{base}`", SCENARIO_TITLES[sc], f"{ratio:g}", number(kl), number(kl_fp8), below]
                row += [number(score, 100, 0), number(score_fp8, 100, 0)]
                row += [number(_bytes(records, m, sc, ratio), 1, 3) for m in (base, fp8)]
                row += _against_half(records, fp8, base, sc, ratio)
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _against_half(
    records: Sequence[dict[str, Any]], fp8: str, base: str, scenario: str, ratio: float
) -> list[str]:
    """[``base``'s mean KL at ``ratio / 2``, on how many prompts ``fp8`` at ``ratio`` is at or below
    it], over the prompts both have; ``-`` where ``base`` has no cell at half the ratio."""
    _, half, below, _, _ = paired(records, fp8, base, scenario, ratio, "kl", ref_ratio=ratio / 2)
    return [number(half), below]


def _bytes(records: Sequence[dict[str, Any]], method: str, scenario: str, ratio: float) -> float | None:
    """Mean KV bytes kept over the full cache's, of ``method``'s cells in ``scenario`` at ``ratio``."""
    return mean_of(
        r.get("kv_fraction") for r in records if r["method"] == method and r["scenario"] == scenario and r.get("ratio") == ratio
    )[0]  # fmt: skip
