"""The temperature search: grid against brute force, budgets by arithmetic == the cache's,
the fixed-budget replay == CAKE's cache, and ``kvcake.calibrate`` end to end on a tiny model."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections import Counter

import pytest
import torch
from word_tokenizer import WordTokenizer

import kvcake
from kvcake import temperatures
from kvcake.adapters import with_cache
from kvcake.budget import BudgetSpec
from kvcake.calibration.samples import (
    FORMS,
    PLAIN_ANSWER,
    ROLES,
    WORDS,
    build_texts,
    reference,
    sample_reference,
    span,
)
from kvcake.calibration.search import Evaluator, FixedLayers, choose, layer_budgets, search_grid, tau_grid
from kvcake.eval.tasks import TASKS, make_samples
from kvcake.eval.tasks.vocab import KEY_NOUNS, VALUE_WORDS
from kvcake.haystack import NoiseHaystack
from kvcake.method import make_method
from kvcake.models import model_fingerprint
from kvcake.replay import Captured, capture_queries, replay_compress


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(temperatures, "_warned", set())


def _ids(n: int = 80, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def test_tau_grid_is_log_spaced_over_the_range():
    g = tau_grid(0.2, 2.0, 5)
    assert g[0] == 0.2 and g[-1] == 2.0 and g == sorted(g)
    ratios = [b / a for a, b in itertools.pairwise(g)]
    assert max(ratios) / min(ratios) < 1.01
    for bad in ((0, 1, 3), (2, 1, 3), (0.1, 1, 1)):
        with pytest.raises(ValueError, match="temperature range"):
            tau_grid(*bad)


@pytest.mark.parametrize("seed", range(5))
def test_search_returns_the_brute_force_best_of_its_grid(seed):
    rng = random.Random(seed)
    t1s, t2s = tau_grid(0.2, 2.0, 5), tau_grid(0.4, 3.0, 4)
    table = {(a, b): rng.random() for a in t1s for b in t2s}
    inner = (t1s[rng.randrange(1, 4)], t2s[rng.randrange(1, 3)])
    table[inner] = -1.0  # an interior optimum: no edge extension
    calls = []
    result = search_grid(lambda a, b: calls.append((a, b)) or table[(a, b)], t1s, t2s)
    assert result.best == min(table, key=table.get) == inner and result.loss == -1.0
    assert sorted(calls) == sorted(table)  # every grid point once, nothing else


def test_search_extends_past_an_edge_to_the_known_optimum():
    optimum = (5.0, 0.15)  # outside the paper's ranges on both axes

    def loss(a, b):
        return (math.log(a) - math.log(optimum[0])) ** 2 + (math.log(b) - math.log(optimum[1])) ** 2

    result = search_grid(loss, tau_grid(0.2, 2.0, 5), tau_grid(0.4, 3.0, 5), max_extend=4)
    assert result.best == min(result.table, key=result.table.get)
    step1, step2 = (2.0 / 0.2) ** 0.25, (3.0 / 0.4) ** 0.25
    assert abs(math.log(result.best[0] / optimum[0])) <= math.log(step1) / 2 + 0.01
    assert abs(math.log(result.best[1] / optimum[1])) <= math.log(step2) / 2 + 0.01
    limited = search_grid(loss, tau_grid(0.2, 2.0, 5), tau_grid(0.4, 3.0, 5), max_extend=0)
    assert limited.best == (2.0, 0.4)  # no extension: the corner


def _captured(model, ids):
    from transformers import DynamicCache

    captured, cache = Captured(), DynamicCache()
    with capture_queries(model, captured), torch.no_grad():
        logits = model(ids, **with_cache(model, cache)).logits[:, -1]
    return captured, cache, logits


@pytest.mark.parametrize("tau", [(0.3, 2.5), (1.6, 0.6), (4.0, 0.2)])
def test_budgets_by_arithmetic_and_fixed_replay_equal_the_cache(tiny_llama, tau):
    ids = _ids()
    spec = f"cake,layers.tau1={tau[0]},layers.tau2={tau[1]}"
    real = kvcake.compress(tiny_llama, ids, spec, budget=24, window=4).cache
    b = layer_budgets(torch.stack(real.entropy, 1)[0], torch.stack(real.variance, 1)[0],
                      BudgetSpec(budget=24, window=4), ids.shape[1], *tau)  # fmt: skip
    assert b.tolist() == real.budgets[0].tolist()
    captured, full, logits = _captured(tiny_llama, ids)
    method = make_method("layers=uniform,score=cake,decode=fixed", budget=24, window=4)
    fixed = replay_compress(tiny_llama, method.replace(layers=FixedLayers(tuple(b.tolist()))), captured, full,
                            ids, logits).cache  # fmt: skip
    for a, c in zip(real.layers, fixed.layers, strict=True):
        assert torch.equal(a.padded_positions().sort(-1).values, c.padded_positions().sort(-1).values)
    with pytest.raises(ValueError, match="fixed budgets"):
        replay_compress(tiny_llama, method.replace(layers=FixedLayers((8,))), captured, full, ids, logits)


def test_choose_keeps_a_clear_winner_and_flattens_within_noise():
    flat, uneven = (2.0, 3.0), (0.2, 0.4)
    flatness = {flat: 0.1, uneven: 0.9}.__getitem__

    def pick(losses):
        table = {t: sum(v) / len(v) for t, v in losses.items()}
        return choose(table, lambda *t: losses[t], lambda *t: flatness(t))

    # the uneven point wins on every sample by a wide margin: it is kept
    clear = pick({flat: [1.0, 1.1, 0.9, 1.0], uneven: [0.5, 0.6, 0.4, 0.5]})
    assert clear.tau == clear.best == uneven
    # the uneven point is better on average, but by less than the noise of the differences: flat
    noisy = pick({flat: [1.0, 0.5, 1.0, 0.5], uneven: [0.5, 1.0, 0.4, 0.55]})
    assert noisy.best == uneven and noisy.tau == flat and noisy.loss == pytest.approx(0.75)
    d = [a - b for a, b in zip([1.0, 0.5, 1.0, 0.5], [0.5, 1.0, 0.4, 0.55], strict=True)]
    mean = sum(d) / 4
    assert 0 < mean <= noisy.se == pytest.approx((sum((x - mean) ** 2 for x in d) / 3 / 4) ** 0.5)
    # one sample: no noise estimate, the best point stays
    single = pick({flat: [1.0], uneven: [0.9]})
    assert single.tau == uneven and single.se == 0.0


def _reference(model, tok, kind: str, seed: int, length: int = 64, continuation: int = 4):
    """A sample built as ``kvcake.calibrate`` builds it (a question scores the greedy continuation)."""
    return sample_reference(
        model, build_texts(tok, NoiseHaystack(), kind, length, continuation, seed), kind, continuation
    )


def test_evaluator_measures_zero_at_a_budget_covering_the_prompt(tiny_llama):
    tok = WordTokenizer()
    refs = [
        _reference(tiny_llama, tok, kind, seed)
        for kind, seed in (("context", 0), ("question", 0), ("context", 1))
    ]
    assert [r.part for r in refs] == ["text", "asked-inside", "asked-after"]
    assert all(len(r.full_attn) == tiny_llama.config.num_hidden_layers for r in refs)
    whole = Evaluator(tiny_llama, refs, BudgetSpec(budget=4096, window=4))
    for i in range(3):
        m = whole.sample_measures(i, 1.0, 1.0)
        assert m.kl == pytest.approx(0.0, abs=1e-6) and m.attn == pytest.approx(0.0, abs=1e-5)
    small = Evaluator(tiny_llama, refs, BudgetSpec(budget=12, window=4))
    assert set(small.uniform) == {"kl", "attn"} and min(small.uniform["attn"].values()) > 0
    # uniform budgets need no preference statistics (record's paper evaluator, built for its baseline)
    assert small.stats == {}
    measured = [small.sample_measures(i, 0.3, 2.5) for i in range(3)]
    assert sorted(small.stats) == [0, 1, 2]
    # the loss is KL alone (issue 24): the mean KL over uniform budgets' mean KL over the same
    # samples, whatever their parts; the perturbation is reported beside it
    assert set(small.uniform["kl"]) == {"text", "asked-inside", "asked-after"}
    uniform = [small.measure(i, small._method("uniform")) for i in range(3)]
    pooled = sum(u.kl for u in uniform) / 3
    assert small.pooled("kl") == pytest.approx(pooled)
    assert small.per_sample(0.3, 2.5) == pytest.approx([m.kl / pooled for m in measured])
    assert small.loss(0.3, 2.5) == pytest.approx(sum(m.kl for m in measured) / 3 / pooled)
    attn = sum(m.attn for m in measured) / sum(u.attn for u in uniform)
    assert small.perturbation(0.3, 2.5) == pytest.approx(attn)
    assert small.unevenness(50.0, 50.0) < small.unevenness(0.2, 0.4)  # hot temperatures flatten
    # another indicator divides by the paper's uniform budgets, so its losses compare with them
    other = Evaluator(tiny_llama, refs, BudgetSpec(budget=12, window=4), indicator=("max", 7),
                      baseline=small.uniform)  # fmt: skip
    assert other.uniform is small.uniform and "score.pooling=max,score.kernel=7" in other.score
    assert other.per_sample(0.3, 2.5)[0] == pytest.approx(other.sample_measures(0, 0.3, 2.5).kl / pooled)
    # another weight of CAKE's variance term (scripts/calibration_folds.py record --gamma), the scorer's
    mean = Evaluator(tiny_llama, refs, BudgetSpec(budget=12, window=4), baseline=small.uniform, gamma=0)
    assert mean._method("uniform").scorer.gamma == 0.0 and small._method("uniform").scorer.gamma == 200.0


def test_replays_of_a_recording_score_its_prompt_once(tiny_llama, monkeypatch):
    """The evaluator's memo: every budget replays a sample's recording, whose keys a layer holds as
    its own copy (the recording is cropped after its continuation: views of a longer storage).
    Its prefill scores are computed once per layer and scorer, and the memo holds one entry each
    (they were keyed on the copy's identity: every replay missed and kept its copy alive), and the
    caches equal those of replays without the memo."""
    from kvcake.scorers.cake import CakeScorer

    ref = _reference(tiny_llama, WordTokenizer(), "question", 0)
    layers = tiny_llama.config.num_hidden_layers
    assert ref.cache.layers[0].keys.untyped_storage().nbytes() > ref.cache.layers[0].keys.nbytes  # a view
    calls = []
    real = CakeScorer.prefill_sums
    monkeypatch.setattr(CakeScorer, "prefill_sums", lambda self, inp: calls.append(1) or real(self, inp))
    ev = Evaluator(tiny_llama, [ref], BudgetSpec(budget=12, window=4))
    for tau in ((0.3, 2.5), (1.0, 1.0), (50.0, 50.0)):
        ev.sample_measures(0, *tau)
    ev.measure(0, ev._method("uniform"))
    assert len(calls) == layers and len(ev.memos[0]) == layers
    for budget in (10, 20):
        method = make_method("cake", budget=budget, window=4)
        memo = ev.memos[0]
        with_memo, alone = (
            replay_compress(
                tiny_llama, method, ref.captured, ref.cache, ref.ids, ref.logits, chunks=1, memo=m
            )
            for m in (memo, None)
        )
        for a, b in zip(with_memo.cache.layers, alone.cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
    assert len(ev.memos[0]) == layers


def test_calibration_samples_past_the_models_positions_are_refused_before_any_forward(
    tiny_llama, monkeypatch
):
    monkeypatch.setattr("kvcake.calibration.api.sample_reference", lambda *a: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=r"5000-token calibration sample.*4096.*lower length"):
        kvcake.calibrate(tiny_llama, WordTokenizer(), ratios=(0.2,), text=NoiseHaystack(), samples=1,
                         length=5000, continuation=4, grid=3, window=4)  # fmt: skip


def test_calibrate_end_to_end_on_a_tiny_model(tiny_llama, tmp_path):
    # the paper's indicator alone (the search over indicators: the tests below)
    cal = kvcake.calibrate(tiny_llama, WordTokenizer(), ratios=(0.2, 0.4), text=NoiseHaystack(), samples=2,
                           length=96, continuation=4, grid=3, window=4, indicators=("avg5",))  # fmt: skip
    assert cal.fingerprint == model_fingerprint(tiny_llama) and not cal.shared
    assert [(m["scenario"], m["setting"]) for m in cal.meta["points"]] == [
        (s, f"ratio={r}") for s in ("question", "context") for r in (0.2, 0.4)
    ]
    kept = [p for s in ("question", "context") for p in cal.set(s)]
    for point, meta in zip(kept, cal.meta["points"], strict=True):
        grid = {(a, b): x for a, b, x in meta["grid"]}
        best = min(grid.values())
        assert meta["grid_best_loss"] == pytest.approx(best, abs=1e-6)
        assert grid[tuple(meta["grid_best"])] == best
        # the kept point: within one standard error of the best, and no more uneven than it
        assert grid[(point.tau1, point.tau2)] == pytest.approx(meta["loss"], abs=1e-6)
        assert meta["loss"] <= best + meta["standard_error"] + 1e-6
        assert meta["unevenness"] <= meta["grid_best_unevenness"]
        assert set(meta["uniform"]) == {"kl", "attn"} and meta["indicator"] == "avg5"
        # the loss is the mean KL over uniform budgets', the parts pooled: a passage continued and
        # one asked about after its compression (context-only) weigh as their KL does
        uniform = meta["uniform"]["kl"]
        assert set(uniform) == (
            {"asked-inside"} if meta["scenario"] == "question" else {"text", "asked-after"}
        )
        assert meta["loss"] == pytest.approx(meta["kl"] / (sum(uniform.values()) / len(uniform)), rel=1e-6)
        assert meta["perturbation"] > 0
        assert (
            meta["evaluations"] <= 4 * meta["candidates"] + 4
        )  # shared evaluations, one per distinct allocation
    assert cal.meta["parts"] == {"question": {"asked-inside": 2}, "context": {"text": 1, "asked-after": 1}}
    saved = json.loads(temperatures.calibration_path(cal.fingerprint).read_text())
    assert saved["fingerprint"] == cal.fingerprint and set(saved["scenarios"]) == {"question", "context"}
    ctx = kvcake.compress(tiny_llama, _ids(96), "cake", ratio=0.2, window=4)
    avg = float(ctx.cache.seq.per_layer.double().mean())  # the budget the cache resolves tau at
    assert ctx.cache.tau.source == "calibrated" and ctx.cache._tau == pytest.approx(cal.at(avg, "context"))
    assert ctx.cache.tau.set_used == "context"
    _, cache = kvcake.generate(tiny_llama, _ids(96), "cake", ratio=0.2, window=4, max_new_tokens=1)
    assert cache.tau.set_used == "question" and cache._tau == pytest.approx(cal.at(avg, "question"))


def test_calibrate_can_search_the_indicator(tiny_llama):
    cal = kvcake.calibrate(tiny_llama, WordTokenizer(), ratios=(0.3,), text=NoiseHaystack(), samples=2, length=96,
                           continuation=4, grid=2, window=4, indicators=("max7", "avg5"), save=False)  # fmt: skip
    assert cal.meta["indicators"] == {"question": ["avg5", "max7"], "context": ["avg5", "max7"]}
    for meta in cal.meta["points"]:
        assert set(meta["indicators"]) == {"avg5", "max7"} and meta["indicator"] in meta["indicators"]
        if meta["indicator"] == "max7":  # kept over the paper's only when better by more than the noise
            assert meta["indicators"]["max7"] < meta["indicators"]["avg5"]
        assert meta["loss"] == pytest.approx(meta["indicators"][meta["indicator"]], abs=1e-5)
    for bad in ("med5", "max", "max6", ("avg", 0)):
        with pytest.raises(ValueError, match="indicator"):
            kvcake.calibrate(tiny_llama, WordTokenizer(), indicators=(bad,), save=False)


def test_calibrate_searches_each_scenarios_default_indicators(tiny_llama):
    from kvcake.calibration.api import DEFAULT_INDICATORS

    kw = dict(ratios=(0.3,), text=NoiseHaystack(), samples=2, length=96, continuation=4, grid=2, window=4)
    default = kvcake.calibrate(tiny_llama, WordTokenizer(), save=False, **kw)
    expected = {scenario: ["avg5", *inds] for scenario, inds in DEFAULT_INDICATORS.items()}
    assert (
        default.meta["indicators"] == expected == {"question": ["avg5", "max7"], "context": ["avg5", "max7"]}
    )
    for meta in default.meta["points"]:
        assert list(meta["indicators"]) == expected[meta["scenario"]]
    # the same indicators given explicitly: the same calibration
    given = kvcake.calibrate(tiny_llama, WordTokenizer(), save=False, indicators=("avg5", "max7"), **kw)
    assert given.points == default.points
    # a mapping per scenario: a scenario left out searches the paper's alone, the other as given
    mapped = kvcake.calibrate(tiny_llama, WordTokenizer(), save=False, indicators={"context": "max7"}, **kw)
    assert mapped.meta["indicators"] == {"question": ["avg5"], "context": ["avg5", "max7"]}
    for meta in mapped.meta["points"]:  # each scenario's points searched its own indicators
        assert list(meta["indicators"]) == mapped.meta["indicators"][meta["scenario"]]
    assert mapped.points["context"] == default.points["context"]
    with pytest.raises(ValueError, match=r"scenarios \['ctx'\]"):
        kvcake.calibrate(tiny_llama, WordTokenizer(), save=False, indicators={"ctx": ("max7",)}, **kw)
    with pytest.raises(TypeError, match="indicators is a sequence"):
        kvcake.calibrate(tiny_llama, WordTokenizer(), save=False, indicators="max7", **kw)


def test_calibrate_rejects_bad_input(tiny_llama):
    tok = WordTokenizer()
    for kwargs, match in (({"samples": 0}, "samples"), ({"ratios": (), "budgets": ()}, "at least one"),
                          ({"grid": 1}, "grid"), ({"length": 8}, "length"), ({"text": "/no/such/file"}, "haystack"),
                          ({"ratios": (1.5,)}, "ratio"), ({"ratios": (1.0,)}, "keep_ratio=1.0 keeps every token"),
                          ({"ratios": (0.01,)}, "fewer than the 32-token window")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            kvcake.calibrate(tiny_llama, tok, **kwargs)
    for kwargs, match in (({"budgets": (40.9,)}, "budget must be an int, got float"),
                          ({"ratios": (True,)}, "keep_ratio must be a number, got bool")):  # fmt: skip
        with pytest.raises(TypeError, match=match):  # (were taken as 40, and as 1.0)
            kvcake.calibrate(tiny_llama, tok, **kwargs)


def _shingles(text: str, n: int = 4) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_question_samples_end_with_the_question_for_a_number_or_a_key():
    """Every form: the question closes the prompt, the answer is a span of the form's shape stated
    in the prompt; the look-alike facts hold other spans of that shape; a chain's facts come in order."""
    tok = WordTokenizer()
    seen = set()
    for seed in range(12):
        prompt, scored, then, part = build_texts(tok, NoiseHaystack(), "question", 160, 4, seed)
        assert then == [] and part == "asked-inside"
        name = tuple(FORMS)[seed % len(FORMS)]
        seen.add(name)
        form = FORMS[name]
        text = tok.decode(prompt).replace(" - ", "-")
        value = tok.decode(scored).split(" .")[0].replace(" - ", "-").strip()
        shape = {"number": r"\d{7}", "key": r"[A-Z]{2}-\d{4}-[A-Z]{2}", "word": "|".join(WORDS)}[form.span]
        assert re.fullmatch(shape, value), value
        assert len(prompt) == 160 and value in text  # the fact is in the compressed prompt
        asked = re.search(r"(?:locker of|spare key of) the (\w+ \w+)", text)
        ask = form.ask.format(who=asked.group(1) if asked else "")
        tail = tok(ask + PLAIN_ANSWER + form.prefix, add_special_tokens=False)["input_ids"]
        assert prompt[-len(tail) :] == tail  # the question closes the prompt
        spans = re.findall(rf"\b(?:{shape})\b", text)
        assert len(set(spans)) == (4 if name in ("keys", "words") else 1) and value in spans
        if name == "chain":
            marks = [
                text.index(w)
                for w in ("ledger of the lighthouse", "harbour clerk copied", "signal boy painted")
            ]
            assert marks == sorted(marks)
    assert seen == set(FORMS)


class ChatWordTokenizer(WordTokenizer):
    """The word tokenizer with a chat template: a user turn and an opened assistant turn."""

    chat_template = "user ... assistant"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize and add_generation_prompt and [m["role"] for m in messages] == ["user"]
        return "<|system|> be brief <|user|> " + messages[0]["content"] + " <|end|> <|assistant|> "


def test_context_only_samples_alternate_a_passage_continued_and_one_asked_about_after_it():
    """Context-only samples serve both uses of a compressed document: an even seed continues a
    passage (the text's own next tokens scored), an odd one hides a form's facts in a
    ``length``-token passage that is compressed alone, the question (and answer prefix) appended
    after it uncompressed, as the results page's context-only cells ask theirs."""
    tok = WordTokenizer()
    seen = set()
    for seed in range(12):
        prompt, scored, then, part = build_texts(tok, NoiseHaystack(), "context", 160, 4, seed)
        assert len(prompt) == 160
        if seed % 2 == 0:
            assert part == "text" and then == [] and len(scored) == 4
            continue
        name = tuple(FORMS)[seed // 2 % len(FORMS)]
        seen.add(name)
        form = FORMS[name]
        value = tok.decode(scored).split(" .")[0].replace(" - ", "-").strip()
        assert part == "asked-after" and value in tok.decode(prompt).replace(" - ", "-")
        asked = re.search(r"(?:locker of|spare key of) the (\w+ \w+)", tok.decode(then))
        ask = form.ask.format(who=asked.group(1) if asked else "")
        assert then == tok(ask + PLAIN_ANSWER + form.prefix, add_special_tokens=False)["input_ids"]
        assert form.ask.split("{")[0].strip() not in tok.decode(prompt)  # the question is not compressed
    assert seen == set(FORMS)
    chat = ChatWordTokenizer()
    prompt, _, then, part = build_texts(chat, NoiseHaystack(), "context", 120, 4, 1)
    head = chat("<|system|> be brief <|user|> ", add_special_tokens=False)["input_ids"]
    tail = chat(" <|end|> <|assistant|> " + FORMS["number"].prefix, add_special_tokens=False)["input_ids"]
    assert part == "asked-after" and len(prompt) == 120 and prompt[: len(head)] == head
    assert then[-len(tail) :] == tail  # the turn change and the prefix follow the question


def test_a_question_asked_after_the_prompt_scores_the_full_caches_answer_to_it(tiny_llama):
    """``then``: the full cache reads the question after the prompt and answers greedily; the
    reference teacher-forces question and answer, keeps the answer's predictions, and crops the
    cache back to the prompt (the part a compression replays)."""
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 100, (40,), generator=gen).tolist()
    then = torch.randint(3, 100, (6,), generator=gen).tolist()
    ref = reference(tiny_llama, prompt, None, "context", greedy=5, then=then)
    with torch.no_grad():
        out = tiny_llama.generate(
            torch.tensor([prompt + then]), max_new_tokens=5, do_sample=False, min_new_tokens=5
        )
    expected = out[0, len(prompt) + len(then) :]
    assert ref.part == "asked-after" and ref.appended[0].tolist() == then + expected[:-1].tolist()
    assert torch.equal(ref.full_logprobs.argmax(-1), expected) and ref.full_logprobs.shape[0] == 5
    assert ref.cache.get_seq_length() == len(prompt) and ref.full_attn[0].shape[0] == len(then) + 4
    # the compressed cache's measure over the same tokens: zero where nothing is evicted
    whole = Evaluator(tiny_llama, [ref], BudgetSpec(budget=4096, window=4))
    assert whole.sample_measures(0, 1.0, 1.0).kl == pytest.approx(0.0, abs=1e-6)


def test_question_samples_are_laid_out_like_a_users_chat_prompt():
    """With a chat template the question sample is framed as ``kvcake.build_prompt`` frames an
    evaluation prompt (``kvcake.prompts.chat_frame``): the turn's head first, then passage and
    question, the turn change and the answer prefix last; still ``length`` tokens."""
    tok = ChatWordTokenizer()
    for seed in range(2):
        prompt, scored, _, _ = build_texts(tok, NoiseHaystack(), "question", 120, 4, seed)
        form = FORMS[tuple(FORMS)[seed % 2]]  # number, key (one role)
        text = tok.decode(prompt)
        asked = re.search(r"(?:locker of|spare key of) the (\w+ \w+)", text)
        ask = form.ask.format(who=asked.group(1) if asked else "")
        head = tok("<|system|> be brief <|user|> ", add_special_tokens=False)["input_ids"]
        tail = tok(ask + " <|end|> <|assistant|> " + form.prefix, add_special_tokens=False)["input_ids"]
        assert len(prompt) == 120 and prompt[: len(head)] == head and prompt[-len(tail) :] == tail
        assert "Answer" not in tok.decode(prompt)  # the assistant turn holds the prefix alone


def test_calibration_prompts_are_never_evaluation_prompts():
    """No wording of a calibration fact or question (4 words in a row) and no calibration span
    occurs in the evaluation suite's prompts (every task, both needle wordings, seeds 0-5)."""
    tok = WordTokenizer()
    eval_text = []
    for task in TASKS:
        styles = ("ruler", "restated") if task.startswith("niah") else (None,)
        for style in styles:
            opts = {"needle_style": style} if style else {}
            for s in make_samples(task, tok, 6, 600, seed=0, haystack="noise", **opts):
                eval_text.append(s.prompt() + " " + " ".join(s.answers))
    joined = " ".join(eval_text)
    eval_shingles = _shingles(joined)
    for form in FORMS.values():
        for role in ROLES:
            words = [f.format(value="", who=role) for f in form.facts] + [
                form.ask.format(who=role),
                form.prefix,
            ]
            overlap = _shingles(" ".join(words)) & eval_shingles
            assert not overlap, overlap
    rng_spans = [
        span(random.Random(f"kvcake-calibration-{kind}-{i}"), f)
        for kind in ("question", "context")
        for i in range(8)
        for f in ("number", "key")
    ]
    assert not [v for v in rng_spans if v in joined]
    assert not [w for w in WORDS if re.search(rf"\b{w}\b", joined, re.IGNORECASE)]
    assert not [w for w in WORDS for v in (*VALUE_WORDS, *KEY_NOUNS) if w in v.lower() or v.lower() in w]


def test_the_near_uniform_candidate_joins_every_grid():
    from kvcake.calibration.api import FLAT_TAU, with_flat
    from kvcake.calibration.search import GridResult

    grid = GridResult((0.2, 0.4), 1.1, {(0.2, 0.4): 1.1, (2.0, 3.0): 1.2})
    calls = []
    worse = with_flat(grid, lambda a, b: calls.append((a, b)) or 0.98)  # every grid point worse than flat
    assert worse.best == FLAT_TAU and worse.loss == 0.98 and calls == [FLAT_TAU]
    assert set(worse.table) == {*grid.table, FLAT_TAU}
    better = with_flat(grid, lambda a, b: 1.5)
    assert better.best == (0.2, 0.4) and better.table[FLAT_TAU] == 1.5
    assert with_flat(better, lambda a, b: pytest.fail("measured twice")).table == better.table


def test_question_samples_score_the_full_caches_greedy_continuation(tiny_llama):
    """``greedy=n``: the scored tokens are the full cache's own greedy continuation (what the
    results page's KL scores), each the argmax of the full cache's prediction before it; the cache
    is cropped back to the prompt for the replay."""
    prompt = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = reference(tiny_llama, prompt, None, "question", greedy=5)
    with torch.no_grad():
        out = tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)
    expected = out[0, len(prompt) :]
    assert torch.equal(ref.appended[0], expected[:-1])
    assert torch.equal(ref.full_logprobs.argmax(-1), expected)
    assert ref.cache.get_seq_length() == len(prompt)
    with pytest.raises(ValueError, match="greedy"):
        reference(tiny_llama, prompt, None, "question")


SHIPPED_DIR = temperatures.SHIPPED_DIR  # the package's own (the fixture above points it elsewhere)


def test_the_shipped_calibrations_are_what_kvcake_calibrate_makes_by_default():
    """A user's own ``kvcake calibrate`` (no options) measures what the shipped files measured:
    the same samples, prompt length, grid and ratios, on the command line as in the API."""
    import inspect

    from kvcake.calibration.api import DEFAULT_INDICATORS
    from kvcake.cli import build_parser
    from kvcake.defaults import CALIBRATION_RATIOS

    cli = build_parser().parse_args(["calibrate"])  # the command line users type, extensions included
    api = inspect.signature(kvcake.calibrate).parameters
    for name in ("samples", "length", "grid", "text"):
        assert getattr(cli, name) == api[name].default, name
    assert cli.ratios is None and api["ratios"].default is None and api["budgets"].default == ()
    n = api["samples"].default
    parts = {kind: dict(Counter(build_texts(WordTokenizer(), NoiseHaystack(), kind, 96, 4, i).part for i in range(n)))
             for kind in temperatures.SCENARIOS}  # fmt: skip
    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert len(files) == 2  # SmolLM2 and Gemma-3-270M
    for path in files:
        meta = json.loads(path.read_text(encoding="utf-8"))["meta"]
        assert meta["samples_per_scenario"] == api["samples"].default, path.name
        assert meta["length"] == api["length"].default, path.name
        assert meta["indicators"] == {  # the API's default search
            scenario: ["avg5", *inds] for scenario, inds in DEFAULT_INDICATORS.items()
        }, path.name
        assert meta["parts"] == parts, path.name  # the same kinds of samples
        for scenario in temperatures.SCENARIOS:
            settings = [p["setting"] for p in meta["points"] if p["scenario"] == scenario]
            assert settings == [f"ratio={r:g}" for r in CALIBRATION_RATIOS], (path.name, scenario)


def test_a_budget_keeping_the_whole_calibration_prompt_is_refused_before_any_forward(tiny_llama, monkeypatch):
    # nothing evicted: every temperature scored the full cache's KL of 0 and a meaningless point was written
    monkeypatch.setattr("kvcake.calibration.api.sample_reference", lambda *a: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=r"budget=500 keeps every token of a 96-token calibration prompt"):
        kvcake.calibrate(tiny_llama, WordTokenizer(), budgets=(40, 500), text=NoiseHaystack(), samples=1,
                         length=96, continuation=4, grid=3, window=4, save=False)  # fmt: skip
