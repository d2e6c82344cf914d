"""The text-level API (``kvcake.answer``), the scenario defaults, ``keep_ratio``, the ``full``
method, the position check and the warning for a starved long prompt, on a tiny random Llama
with a word-level tokenizer that has a chat template."""

import logging
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast, TextStreamer

import kvcake
from kvcake.budget import DEFAULT_KEEP_RATIO, MAX_BUDGET, default_budget

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|end|>", "<|assistant|>"]
WORDS = [f"w{i}" for i in range(128 - len(SPECIALS))]
TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
    )  # fmt: skip
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def document(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def reference(model, tok, context, question, n=6):
    """Greedy answer with transformers' own cache, laid out as kvcake.answer lays it out."""
    ids = kvcake.build_prompt(tok, context.strip() + "\n\n", question.strip()).full
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_answer_full_equals_plain_generate(tiny_llama, tok, scenario):
    """method='full' keeps every entry: the answer is transformers' own, in both scenarios, and
    the chat template is applied (the prompt starts with the template's user marker)."""
    doc, q = document(120), "w3 w4 w5"
    got = kvcake.answer(tiny_llama, tok, context=doc, question=q, method="full", scenario=scenario,
                        max_new_tokens=6)  # fmt: skip
    assert isinstance(got, str) and got == reference(tiny_llama, tok, doc, q)
    assert kvcake.build_prompt(tok, doc, q).context[0, 0] == tok.convert_tokens_to_ids("<|user|>")


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_return_dict_in_generate(tiny_llama, tok, scenario):
    """``return_dict_in_generate=True`` failed ("tuple indices must be integers or slices") in a
    context's generate, which cut the answer off a tensor, and so in ``answer``. A context returns
    ``model.generate``'s output with the answer's ids as its ``sequences``; ``answer`` its text."""
    doc, q = document(120), "w3 w4 w5"
    got = kvcake.answer(tiny_llama, tok, context=doc, question=q, method="full", scenario=scenario,
                        max_new_tokens=6, return_dict_in_generate=True, output_logits=True)  # fmt: skip
    assert got == reference(tiny_llama, tok, doc, q)
    prompt = kvcake.build_prompt(tok, doc + "\n\n", q)
    ctx = kvcake.compress(tiny_llama, prompt.context, "snapkv", budget=16, window=4)
    plain = ctx.generate(prompt.question, max_new_tokens=4, do_sample=False)
    out = ctx.generate(prompt.question, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)  # fmt: skip
    assert torch.equal(out.sequences, plain) and len(out.logits) == 4


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_answer_many_questions(tiny_llama, tok, scenario, monkeypatch):
    """A list of questions (kvpress's pipeline's ``questions=``) returns their answers in order, each
    what the question alone gets; in the context scenario the document is compressed once."""
    doc, qs = document(160), ["w3 w4 w5", "w9 w1", "w3 w4 w5"]
    kwargs = {"method": "snapkv", "keep_ratio": 0.3, "window": 8, "scenario": scenario, "max_new_tokens": 6}
    alone = [kvcake.answer(tiny_llama, tok, context=doc, question=q, **kwargs) for q in qs]
    compressions = []
    compress = kvcake.api.compress
    monkeypatch.setattr(
        kvcake.answers, "compress", lambda *a, **k: compressions.append(1) or compress(*a, **k)
    )
    together = kvcake.answer(tiny_llama, tok, context=doc, question=qs, **kwargs)
    assert together == alone and together[0] == together[2]
    assert kvcake.answer(tiny_llama, tok, context=doc, question=tuple(qs[:1]), **kwargs) == alone[:1]
    assert len(compressions) == (2 if scenario == "context" else 0)  # once per call, whatever the questions


@pytest.mark.parametrize("scenario", ["context", "question"])
@pytest.mark.parametrize("kw", [{}, {"num_beams": 2, "num_return_sequences": 2}])
def test_answer_batches_questions(tiny_llama, tok, monkeypatch, scenario, kw):
    """Questions are answered together, at most ``batch_size`` at once, in order and whatever their
    lengths, left-padded: after the document compressed once (context), or each compressed with it
    as a row of one batch (question-aware). Every answer is the one its question gets alone (the
    first of its returned sequences)."""
    doc = document(160)
    qs = ["w3 w4 w5", "w9 w1", "w6 w7 w8", "w2 w2", "w5 w4 w3", "w1 w1 w1"]
    kwargs = {
        "method": "cake",
        "keep_ratio": 0.3,
        "window": 8,
        "max_new_tokens": 6,
        "scenario": scenario,
        **kw,
    }
    alone = [kvcake.answer(tiny_llama, tok, context=doc, question=q, **kwargs) for q in qs]
    batches = []
    if scenario == "context":
        run = kvcake.CompressedContext.generate
        monkeypatch.setattr(kvcake.CompressedContext, "generate",
                            lambda self, ids, **k: batches.append(ids.shape[0]) or run(self, ids, **k))  # fmt: skip
    else:
        run = kvcake.answers.generate
        monkeypatch.setattr(kvcake.answers, "generate",
                            lambda model, ids, *a, **k: batches.append(ids.shape[0]) or run(model, ids, *a, **k))  # fmt: skip
    assert kvcake.answer(tiny_llama, tok, context=doc, question=qs, batch_size=2, **kwargs) == alone
    assert batches == [2, 2, 2]
    batches.clear()
    assert kvcake.answer(tiny_llama, tok, context=doc, question=qs, batch_size=4, **kwargs) == alone
    assert batches == [4, 2]
    batches.clear()
    assert kvcake.answer(tiny_llama, tok, context=doc, question=qs, batch_size=1, **kwargs) == alone
    assert batches == [1] * 6
    if not kw:  # a streamer takes one sequence (transformers' refuse a batch, and beams)
        batches.clear()
        streamed = kvcake.answer(
            tiny_llama, tok, context=doc, question=qs, streamer=TextStreamer(tok), **kwargs
        )
        assert streamed == alone and batches == [1] * 6
    for bad in (1.5, True):
        with pytest.raises(TypeError, match=f"batch_size= is how many questions .* an int: got {bad}"):
            kvcake.answer(tiny_llama, tok, context=doc, question=qs, batch_size=bad)
    with pytest.raises(
        ValueError, match=r"batch_size= must be at least 1 \(1: one question at a time\), got 0"
    ):
        kvcake.answer(tiny_llama, tok, context=doc, question=qs, batch_size=0)


def test_a_hybrid_models_questions_of_different_lengths_share_a_batch(tiny_gemma3, tok, monkeypatch):
    """Gemma 3's sliding windows settle the padding (``kvcake.sliding_appends``): six questions of
    two and three words after the document in one batch (one length a batch until 2026-12-06: [4,
    2]), every answer its question's alone."""
    doc, qs = document(160), ["w3 w4 w5", "w9 w1", "w6 w7 w8", "w2 w2", "w5 w4 w3", "w1 w1 w1"]
    kwargs = {"method": "snapkv", "keep_ratio": 0.3, "window": 8, "max_new_tokens": 6}
    alone = [kvcake.answer(tiny_gemma3, tok, context=doc, question=q, **kwargs) for q in qs]
    batches, run = [], kvcake.CompressedContext.generate
    monkeypatch.setattr(kvcake.CompressedContext, "generate",
                        lambda self, ids, **k: batches.append(ids.shape[0]) or run(self, ids, **k))  # fmt: skip
    assert kvcake.answer(tiny_gemma3, tok, context=doc, question=qs, batch_size=6, **kwargs) == alone
    assert batches == [6]


def test_question_aware_batches_mix_lengths(tiny_llama, tok, monkeypatch):
    """Question-aware, no size given: prompts of different lengths share a left-padded batch, also
    where a shorter one is kept whole (``kvcake.budget.default_budget``: a 0.25 ratio under the
    window) and the longer one compressed; every answer is the one its question gets alone."""
    short, longer = "w3 w4", "w3 w4 w5 w6 w7 w8 w9"
    base = kvcake.build_prompt(tok, document(110) + "\n\n", short).full.shape[1]
    doc = document(110 + 125 - base)  # the short question's prompt: 125 tokens, kept whole alone
    lengths = [kvcake.build_prompt(tok, doc + "\n\n", q).full.shape[1] for q in (short, longer)]
    assert lengths == [125, 130]
    batches, run = [], kvcake.answers.generate
    monkeypatch.setattr(kvcake.answers, "generate",
                        lambda model, ids, *a, **k: batches.append(ids.shape) or run(model, ids, *a, **k))  # fmt: skip
    kw = {"method": "snapkv", "scenario": "question", "max_new_tokens": 6, "batch_size": 8}
    for qs, shapes in (((short, longer), [(2, 130)]), ((longer, longer + " w1"), [(2, 131)])):
        alone = [kvcake.answer(tiny_llama, tok, doc, q, **kw) for q in qs]
        batches.clear()
        assert kvcake.answer(tiny_llama, tok, doc, list(qs), **kw) == alone
        assert batches == [torch.Size(s) for s in shapes]
    batches.clear()  # by default, one at a time on a CPU (batching the prefills saved nothing there)
    kvcake.answer(tiny_llama, tok, doc, [longer, longer + " w1"], **{**kw, "batch_size": None})
    assert batches == [torch.Size((1, 130)), torch.Size((1, 131))]


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_answer_prefix_starts_the_answer(tiny_llama, tok, scenario):
    """``answer_prefix`` (kvpress's pipeline's) follows the question, at the start of the assistant
    turn; the answer is what the model writes after it: transformers' own greedy tokens there."""
    doc, q, prefix = document(120), "w3 w4 w5", "w7 w8"
    got = kvcake.answer(tiny_llama, tok, context=doc, question=q, method="full", scenario=scenario,
                        answer_prefix=prefix, max_new_tokens=6)  # fmt: skip
    ids = kvcake.build_prompt(tok, doc + "\n\n", q, prefix).full
    assert tok.decode(ids[0, -2:]) == prefix  # the turn's last tokens
    out = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=tok.pad_token_id)  # fmt: skip
    assert got == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert got != kvcake.answer(tiny_llama, tok, context=doc, question=q, method="full", scenario=scenario,
                                max_new_tokens=6)  # fmt: skip
    with pytest.raises(TypeError, match="answer_prefix= must be text, got int"):
        kvcake.answer(tiny_llama, tok, context=doc, question=q, answer_prefix=3)


def test_compress_refuses_inputs_it_sets_itself(tiny_llama):
    ids = torch.randint(10, 100, (1, 40))
    for name in ("use_cache", "logits_to_keep", "inputs_embeds"):
        with pytest.raises(TypeError, match=f"got {name}: it prefills its own cache"):
            kvcake.compress(tiny_llama, ids, "snapkv", budget=16, window=4, **{name: None})


def test_a_context_refuses_a_cache_of_the_callers(tiny_llama):
    """``ctx.generate`` answers from a fork of the context's cache: a ``cache=`` or
    ``past_key_values=`` of the caller's would be dropped, so it is refused, the cache untouched."""
    ctx = kvcake.compress(tiny_llama, torch.randint(10, 100, (1, 40)), "snapkv", budget=16, window=4)
    for name in ("cache", "past_key_values"):
        mine = DynamicCache()
        with pytest.raises(ValueError, match=f"its own cache, so {name}= is not taken: drop it"):
            ctx.generate(torch.randint(10, 100, (1, 5)), max_new_tokens=2, **{name: mine})
        assert mine.get_seq_length() == 0


def test_answer_compressed_is_text_and_no_op_budget_matches(tiny_llama, tok):
    doc, q = document(120), "w3 w4 w5"
    small = kvcake.answer(tiny_llama, tok, context=doc, question=q, method="snapkv", keep_ratio=0.3,
                          window=8, max_new_tokens=6)  # fmt: skip
    assert isinstance(small, str) and small
    whole = kvcake.answer(tiny_llama, tok, context=doc, question=q, method="snapkv", budget=4096,
                          max_new_tokens=6)  # fmt: skip
    assert whole == reference(tiny_llama, tok, doc, q)


def test_answer_refuses_bad_input_before_work(tiny_llama, tok):
    with pytest.raises(ValueError, match="scenario must be 'context' or 'question'"):
        kvcake.answer(tiny_llama, tok, context="w1", question="w2", scenario="both")
    with pytest.raises(ValueError, match="question= must be non-empty text"):
        kvcake.answer(tiny_llama, tok, context="w1 w2", question="  ")
    with pytest.raises(ValueError, match="question= must be non-empty text or a non-empty list of it"):
        kvcake.answer(tiny_llama, tok, context="w1 w2", question=[])
    with pytest.raises(ValueError, match=r"question= must be non-empty text \(or a list of it\), got 3"):
        kvcake.answer(tiny_llama, tok, context="w1 w2", question=["w2", 3])
    with pytest.raises(ValueError, match="context= must be non-empty text"):
        kvcake.answer(tiny_llama, tok, context=" ", question="w2")
    with pytest.raises(ValueError, match="give keep_ratio= or its older name ratio=, not both"):
        kvcake.answer(tiny_llama, tok, context="w1", question="w2", keep_ratio=0.5, ratio=0.5)
    with pytest.raises(ValueError, match="method 'full' keeps every entry: drop budget="):
        kvcake.answer(tiny_llama, tok, context="w1", question="w2", method="full", budget=64)
    for own in ("attention_mask", "input_ids"):  # (were "got multiple values", after the compression)
        with pytest.raises(TypeError, match=f"builds the prompt and its cache itself and takes no {own}"):
            kvcake.answer(
                tiny_llama, tok, context="w1", question="w2", **{own: torch.ones(1, 5, dtype=torch.long)}
            )
    # no tokenizer, or the model and the tokenizer the wrong way round (were 'NoneType' object is
    # not callable, and an error from inside the model)
    with pytest.raises(
        TypeError, match=r"a tokenizer turns the text into ids, got NoneType: .*kvcake.load_model"
    ):
        kvcake.answer(tiny_llama, None, context="w1", question="w2")
    with pytest.raises(
        TypeError, match=r"the tokenizer is a model \(LlamaForCausalLM\): give the model first"
    ):
        kvcake.answer(tok, tiny_llama, context="w1", question="w2")
    with pytest.raises(
        TypeError,
        match=r"chat must be None \(the tokenizer's template when it has one\), True or False, got 'no'",
    ):
        kvcake.answer(tiny_llama, tok, context="w1", question="w2", chat="no")  # bool("no") is True
    # the same mix-ups one level down (were "TokenizersBackend has no attribute config" and
    # "'LlamaModel' object has no attribute 'generate'", from inside the call)
    ids = torch.randint(7, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    for entry in (kvcake.generate, kvcake.compress):
        name = entry.__name__
        with pytest.raises(
            TypeError, match=rf"kvcake.{name} takes the model first, got {type(tok).__name__}: "
        ):
            entry(tok, ids, "snapkv", keep_ratio=0.5)
        with pytest.raises(
            TypeError, match=r"LlamaModel has no generate \(a base model without its language"
        ):
            entry(tiny_llama.model, ids, "snapkv", keep_ratio=0.5)


def test_keep_ratio_is_ratio(tiny_llama):
    assert kvcake.make_method("cake", keep_ratio=0.2) == kvcake.make_method("cake", ratio=0.2)
    ids = torch.randint(7, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    a = kvcake.compress(tiny_llama, ids, "snapkv", keep_ratio=0.3)
    b = kvcake.compress(tiny_llama, ids, "snapkv", ratio=0.3)
    assert torch.equal(a.cache.budgets, b.cache.budgets) and int(a.cache.budgets[0, 0]) == 60
    cache = kvcake.KVCakeCache(tiny_llama, "snapkv", keep_ratio=0.3)
    assert cache.method.budget.ratio == 0.3


def test_scenario_defaults(tiny_llama):
    """Neither budget nor keep_ratio: a document keeps DEFAULT_KEEP_RATIO['context'], a
    question-aware prompt DEFAULT_KEEP_RATIO['question']; a prompt too short for the ratio is
    kept whole instead of refused."""
    ids = torch.randint(7, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    ctx = kvcake.compress(tiny_llama, ids, "snapkv")
    assert ctx.cache.method.budget.ratio == DEFAULT_KEEP_RATIO["context"] == 0.5
    assert int(ctx.cache.budgets[0, 0]) == 200
    _, cache = kvcake.generate(tiny_llama, ids, "snapkv", max_new_tokens=2, do_sample=False)
    assert cache.method.budget.ratio == DEFAULT_KEEP_RATIO["question"] == 0.25
    assert default_budget("question", 100) == {"budget": MAX_BUDGET}  # 25 < the 32-token window: all kept
    assert default_budget("context", 100) == {"ratio": 0.5, "keep_short": True}
    with pytest.raises(ValueError, match="scenario must be one of"):
        default_budget("document", 100)


@pytest.mark.parametrize("spec", ["cake", "streamingllm", "h2o", "tova", "cake-adakv", "snapkv"])
def test_a_prompt_too_short_for_the_default_is_not_compressed(tiny_llama, spec):
    """No budget given and a prompt too short for the scenario's keep ratio: every entry is kept,
    while decoding too. The default was the prompt's own length, so a decode=fixed preset evicted
    one of the oldest entries at every step (under CAKE's avg pooling the attention sink first,
    in every layer) and garbled the answers of short prompts."""
    ids = torch.randint(7, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    ref = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    out, cache = kvcake.generate(tiny_llama, ids, spec, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref) and cache.method.budget.describe() == "budget=all"
    parts = cache.kv_bytes_parts()
    assert parts.entries == parts.full_entries
    ctx = kvcake.compress(tiny_llama, ids[:, :40], spec)  # 20 < the 32-token window
    assert torch.equal(ctx.generate(ids[:, 40:], max_new_tokens=12, do_sample=False), ref[:, 60:])


def test_full_method_keeps_everything_while_decoding(tiny_llama):
    ids = torch.randint(7, 128, (1, 80), generator=torch.Generator().manual_seed(2))
    out, cache = kvcake.generate(tiny_llama, ids, "full", max_new_tokens=5, do_sample=False)
    ref = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.method.name == "full" and cache.method.describe() == "full (every entry kept)"
    parts = cache.kv_bytes_parts()
    assert parts.entries == parts.full_entries


def test_positions_checked_before_any_work(tiny_llama, tok):
    ids = torch.randint(7, 128, (1, 4000))
    with pytest.raises(ValueError, match=r"4000 prompt tokens \+ 200 new tokens = 4200 positions, .* 4096"):
        kvcake.generate(tiny_llama, ids, "snapkv", budget=64, max_new_tokens=200)
    ctx = kvcake.compress(tiny_llama, ids[:, :3990], "snapkv", budget=64)
    with pytest.raises(ValueError, match="positions, but the model has 4096"):
        ctx.generate(ids[:, :5], max_new_tokens=200)
    with pytest.raises(ValueError, match="positions, but the model has 4096"):
        kvcake.answer(tiny_llama, tok, context=document(4090), question="w1 w2", max_new_tokens=64)


def test_starved_long_prompt_warns(tiny_llama, caplog):
    ids = torch.randint(7, 128, (1, 2048), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="kvcake"):
        kvcake.compress(tiny_llama, ids, "snapkv", budget=40)  # 2.0% kept
    assert any("keeps 2.0% of a 2048-token prompt" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcake"):
        kvcake.compress(tiny_llama, ids, "snapkv", budget=128)  # 6.2% kept: no warning
    assert not any("keeps" in r.getMessage() for r in caplog.records)


def test_keep_ratio_one_says_what_decoding_does(tiny_llama, caplog):
    """keep_ratio=1 evicts nothing during prefill; with decode=fixed the cache then stays at the
    prompt's size while decoding, and the warning says so (method 'full' keeps everything)."""
    ids = torch.randint(7, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    with caplog.at_level(logging.WARNING, logger="kvcake"):
        _, cache = kvcake.generate(tiny_llama, ids, "cake", keep_ratio=1.0, max_new_tokens=4, do_sample=False)
    assert "nothing is evicted during prefill; decode=fixed then holds each layer" in caplog.text
    assert cache.kv_bytes_parts().entries < cache.kv_bytes_parts().full_entries  # held at 60 of 63
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcake"):
        _, cache = kvcake.generate(tiny_llama, ids, "full", max_new_tokens=4, do_sample=False)
    assert "nothing is evicted" not in caplog.text
    assert cache.kv_bytes_parts().entries == cache.kv_bytes_parts().full_entries


def test_transformers_pipeline_with_a_kvcake_cache(tiny_llama, tok):
    """transformers' text-generation pipeline with a KVCakeCache per call inside kvcake.enable (the
    README's recipe): a budget covering the prompt gives the stock reply, a small one compresses (its
    budgets) and replies."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=tiny_llama, tokenizer=tok)
    chat = [{"role": "user", "content": document(120)}]
    kw = {"max_new_tokens": 6, "do_sample": False}
    stock = pipe(chat, **kw)[0]["generated_text"][-1]["content"]
    with kvcake.enable(tiny_llama):
        covered = kvcake.KVCakeCache(tiny_llama, "snapkv", budget=4096)
        reply = pipe(chat, **kw, **kvcake.with_cache(tiny_llama, covered))[0]["generated_text"][-1]["content"]
        small = kvcake.KVCakeCache(tiny_llama, "snapkv", budget=24, window=8)
        compressed = pipe(chat, **kw, **kvcake.with_cache(tiny_llama, small))[0]["generated_text"][-1][
            "content"
        ]
    assert reply == stock and compressed.split()
    assert small.budgets.tolist() == [[24] * 4] and small.kv_bytes() < covered.kv_bytes()


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_answer_takes_compile(tiny_llama, tok, scenario):
    """``compile=`` reaches a compressed context's ``generate`` (context) or ``kvcake.generate``
    (question) instead of transformers' ``model.generate``, which refused it as an unknown kwarg:
    a recording backend captures the decoding forward, the answers are eager's."""
    from transformers import CompileConfig

    from shared_checks import KWARGS_HANDOFF, graph_recorder

    backend, graphs = graph_recorder()

    doc, questions = document(120), ["w3 w4 w5", "w6 w7 w8"]
    kw = {"scenario": scenario, "budget": 24, "window": 4, "max_new_tokens": 6}
    eager = kvcake.answer(tiny_llama, tok, doc, questions, compile=False, **kw)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    if not KWARGS_HANDOFF:
        with pytest.raises(ValueError, match="upgrade transformers or use compile=False"):
            kvcake.answer(tiny_llama, tok, doc, questions, compile=config, **kw)
        return
    assert kvcake.answer(tiny_llama, tok, doc, questions, compile=config, **kw) == eager and graphs
