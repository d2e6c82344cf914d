"""What ``kvcake.generate`` and ``kvcake.compress`` size a cache with when no size is given, and
what they refuse: a padded batch sizes each prompt as it is sized alone (the scenario's keep
ratio, or the whole of a prompt too short for it), a :class:`Method` object keeps its own window,
and ``compress`` refuses keywords that neither it nor the model's forward takes."""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake.budget import DEFAULT_KEEP_RATIO, MAX_BUDGET, BudgetSpec, default_budget
from shared_checks import assert_batch_matches_each_alone, left_padded


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 100, (n,), generator=torch.Generator().manual_seed(seed))


def test_default_budget_keeps_a_batchs_short_prompts_whole():
    assert default_budget("question", 100) == {"budget": MAX_BUDGET}  # 25 < the 32-token window
    assert default_budget("question", 200) == {"ratio": DEFAULT_KEEP_RATIO["question"], "keep_short": True}
    spec = BudgetSpec(ratio=0.25, keep_short=True)
    got = spec.per_layer(torch.tensor([200, 100, 20]))
    assert got.tolist() == [50, MAX_BUDGET, 32]  # a ratio; too short for it: whole; all window
    assert spec.describe() == "ratio=0.25 (a prompt too short for it kept whole)"
    with pytest.raises(ValueError, match="ratio 0.25 of a 100-token prompt gives a budget of 25"):
        BudgetSpec(ratio=0.25).per_layer(torch.tensor([200, 100]))  # a ratio given: refused, as before
    with pytest.raises(ValueError, match="keep_short applies to a keep ratio: give keep_ratio= with it"):
        BudgetSpec(budget=64, keep_short=True)
    with pytest.raises(TypeError, match="keep_short must be True or False, got 'yes'"):
        BudgetSpec(ratio=0.25, keep_short="yes")


@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv"])
def test_generate_sizes_each_padded_prompt_as_alone(tiny_llama, name):
    """No size given, rows of 200 and 100 tokens: the longer keeps 0.25 of its prompt, the shorter
    (25 entries would be under the window) every entry, each as it does alone (tokens, counts,
    kept positions); this batch was refused before, naming a keep_ratio= never given."""
    a, b = ids(200), ids(100, seed=1)
    assert_batch_matches_each_alone(tiny_llama, name, a, b, n_pad=100, max_new_tokens=6)
    _, cache = kvcake.generate(tiny_llama, *left_padded(a, b)[:1], name, max_new_tokens=2,
                               attention_mask=left_padded(a, b)[1])  # fmt: skip
    assert cache.method.budget.keep_short and cache.seq.per_layer.tolist() == [50, MAX_BUDGET]


def test_compress_sizes_each_padded_document_as_alone(tiny_llama):
    a, b = ids(200), ids(60, seed=1)
    batch, mask = left_padded(a, b)
    ctx = kvcake.compress(tiny_llama, batch, "snapkv", attention_mask=mask)
    question = ids(5, seed=2)[None].expand(2, -1)
    both = ctx.generate(question, max_new_tokens=6)
    for i, seq in enumerate((a, b)):
        alone = kvcake.compress(tiny_llama, seq[None], "snapkv")
        assert ctx.cache.budgets[i].tolist() == alone.cache.budgets[0].tolist()
        assert torch.equal(both[i], alone.generate(question[:1], max_new_tokens=6)[0])
    assert ctx.cache.budgets[1].tolist() == [60] * len(ctx.cache.compressed)  # the short one whole


def test_a_context_sized_by_default_saves_and_loads(tiny_llama, tmp_path):
    batch, mask = left_padded(ids(200), ids(60, seed=1))
    ctx = kvcake.compress(tiny_llama, batch, "snapkv", attention_mask=mask)
    kvcake.save_context(ctx, tmp_path / "doc.kvc")
    loaded = kvcake.load_context(tiny_llama, tmp_path / "doc.kvc")
    assert loaded.cache.method == ctx.cache.method and loaded.cache.method.budget.keep_short
    question = ids(5, seed=2)[None].expand(2, -1)
    assert torch.equal(loaded.generate(question, max_new_tokens=4), ctx.generate(question, max_new_tokens=4))


def test_a_method_objects_window_is_its_own(tiny_llama):
    method = kvcake.make_method("snapkv", budget=16, window=8)
    prompt = ids(40)[None]
    for call in (
        lambda **kw: kvcake.generate(tiny_llama, prompt, method, max_new_tokens=2, **kw),
        lambda **kw: kvcake.compress(tiny_llama, prompt, method, **kw),
    ):
        with pytest.raises(
            ValueError, match="window=4 here, and the Method object's is 8: give window= to make_method"
        ):
            call(window=4)
        call(window=8)  # the same window: nothing dropped
        call()
    _, cache = kvcake.generate(tiny_llama, prompt, method, max_new_tokens=2)
    assert cache.method.budget.window == 8


def test_compress_refuses_keywords_nothing_takes(tiny_llama):
    """A forward taking ``**kwargs`` would have dropped these without a word."""
    prompt = ids(40)[None]
    cases = {
        "keep_rato": "did you mean 'keep_ratio'",
        "kv_dtyp": "did you mean 'kv_dtype'",
        "max_new_tokens": "",
    }
    for name, hint in cases.items():
        match = f"kvcake.compress got '{name}', which neither it nor LlamaForCausalLM's forward takes.*{hint}"
        with pytest.raises(TypeError, match=match):
            kvcake.compress(tiny_llama, prompt, "snapkv", budget=16, window=8, **{name: 0.1})
    positions = torch.arange(40)[None]  # the model's own inputs still go through
    ctx = kvcake.compress(
        tiny_llama, prompt, "snapkv", budget=16, window=8, position_ids=positions, output_attentions=False
    )
    assert ctx.cache.budgets is not None
