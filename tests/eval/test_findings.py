"""The results page's "findings read off the numbers": rankings compare methods on the prompts
they all have (a method run on 36 prompts beside one run on 12 was ranked by its 36-prompt mean),
and the full cache's line counts prompts, not prompt-scenario lines."""

from __future__ import annotations

from kvcake.eval.report import _findings


def rec(method, sample, kl, scenario="context", score=1.0):
    return {"method": method, "task": "t", "length": 2048, "seed": sample, "sample": sample, "scenario": scenario,
            "ratio": None if method == "full" else 0.5, "budget": None, "kl": kl, "score": score}  # fmt: skip


def test_rankings_use_the_prompts_every_method_has():
    records = [rec("a", 0, 0.1), rec("a", 1, 0.9), rec("b", 0, 0.2), rec("b", 1, 0.3), rec("c", 0, 0.15)]
    (line,) = [x for x in _findings(records, None) if "lowest KL" in x]
    # on prompt 0 alone: a 0.1 < c 0.15 < b 0.2 (over both, b's 0.25 would have been below a's 0.5)
    assert (
        line
        == "context-only, ratio 0.5: lowest KL `a` (0.100), highest `b` (0.200), on the 1 prompts every method has."
    )


def test_the_full_caches_line_counts_prompts():
    records = [rec("full", s, 0.0, sc, score=0.0) for s in (0, 1) for sc in ("question", "context")]
    (line,) = [x for x in _findings(records, None) if "full cache itself" in x]
    assert "(2 prompts, 2 scenarios)" in line
