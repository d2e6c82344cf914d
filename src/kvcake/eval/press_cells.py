"""kvpress's presses as methods of ``kvcake eval`` (``--methods full,snapkv,kvpress:snapkv``).

A method ``kvpress:<preset>`` is the press of NVIDIA's kvpress that implements ``<preset>``
(:data:`kvcake.bench.kvpress_rows.PRESSES`), told the same budget as kvcake's preset in the same
run (``--budgets``, or ``--ratios`` resolved on the compressed prompt's length as kvcake resolves
them) and the same observation window. Its cells are answered the way kvpress's pipeline answers:
the compressed part (the context, or context + question in the question-aware scenario) is
prefilled inside the press into a ``DynamicCache``; what follows is fed with explicit positions
(the cache holds fewer entries than tokens) and decoded greedily, kvpress's attention patch
masking what its Ada-KV presses dropped. The fidelity measures teacher-force the full cache's
continuation the same way. Nothing of kvcake's runs in these cells (no ``kvcake.enable``, whose
attention kvpress's patch does not wrap), so a row is kvpress's own output.

kvpress 0.5 requires transformers < 5.3: run the eval from an environment with kvpress, with this
repository on ``PYTHONPATH`` (README, "kvcake beside kvpress"). The eval imports kvpress before
it loads the model (its import patches the attention functions registered then).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import DynamicCache

from kvcake.adapters import with_cache
from kvcake.bench.kvpress_rows import PREFIX, check_presets, press_context, release
from kvcake.eval.fidelity import Fidelity, cache_bytes, compare
from kvcake.eval.questions import Question
from kvcake.replay import forced

__all__ = ["check_press_methods", "is_press", "press_budget", "press_cells"]


def is_press(spec: str) -> bool:
    return spec.startswith(PREFIX)


def check_press_methods(specs) -> None:
    """Refuse, before any model is loaded, a ``kvpress:`` method no press implements, or kvpress
    missing (and import it: its patch must wrap the attention functions before kvcake's exist)."""
    check_presets([s[len(PREFIX) :] for s in specs if is_press(s)])


def press_budget(budget: int | None, ratio: float | None, length: int, window: int) -> int:
    """Entries per head the press keeps of a ``length``-token prompt: ``budget``, or ``ratio`` of it
    rounded as ``kvcake.budget.Budget`` rounds it, refused as kvcake refuses it (below the window)."""
    if budget is None:
        budget = max(1, round(length * ratio))
    if budget < window:
        raise ValueError(
            f"a budget of {budget} entries is smaller than the window ({window}) kvpress's SnapKV presses "
            f"observe: raise the budget or ratio, or lower --window"
        )
    if budget >= length:
        raise ValueError(
            f"a budget of {budget} entries keeps the whole {length}-token prompt, which kvpress cannot be "
            "told (its compression_ratio must be above 0 to compress): use a smaller budget or ratio"
        )
    return budget


def _forward(model, ids: torch.Tensor, cache, start: int, **kwargs):
    """``ids`` (1, a) fed after ``start`` tokens, at their own positions (as kvpress's pipeline feeds
    them: the cache holds fewer entries than tokens)."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, position_ids=positions, **with_cache(model, cache), **kwargs)


def _greedy(
    model, cache, start: int, logits: torch.Tensor, max_new_tokens: int, eos: set[int]
) -> torch.Tensor:
    """Greedy tokens (n,) after ``start`` tokens whose last logits are ``logits`` (1, vocab),
    stopping at EOS (kept) or ``max_new_tokens``."""
    tokens = [logits.argmax(-1)]  # (1,)
    while len(tokens) < max_new_tokens and int(tokens[-1]) not in eos:
        out = _forward(model, tokens[-1][:, None], cache, start + len(tokens) - 1, logits_to_keep=1)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat(tokens)


def _back_to(cache, held: int) -> None:
    """Drop what was appended after the first ``held`` entries (``crop(-n)``: the spelling every
    supported transformers reads as "remove n"; 5.25 refuses a positive length)."""
    extra = cache.get_seq_length() - held
    if extra > 0:
        cache.crop(-extra)


def _prefill(model, ids: torch.Tensor):
    """A ``DynamicCache`` holding ``ids`` (1, S) as the press in force leaves it, and the last logits."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, logits_to_keep=1, **with_cache(model, cache))
    return cache, out.logits[:, -1]


def press_cells(model, group_ids: torch.Tensor, qrefs: dict, todo: list[dict[str, Any]], window: int,
                fidelity: bool, eos: set[int], record: Callable[..., dict[str, Any]],
                ref_cache) -> Iterable[dict[str, Any]]:  # fmt: skip
    """The records of one ``kvpress:`` method's cells at one budget and scenario (``todo``, all about
    the context ``group_ids`` (1, c)); ``record`` as ``kvcake.eval.cells.run_group`` builds them."""
    c = group_ids.shape[1]
    first = todo[0]
    name, budget, ratio, sc = first["method"], first["budget"], first["ratio"], first["scenario"]
    if sc == "context":
        kept = press_budget(budget, ratio, c, window)
        t0 = time.perf_counter()
        with torch.no_grad(), press_context(model, name, budget=kept, length=c, window=window):
            cache, logits = _prefill(model, group_ids)
            compress_s = time.perf_counter() - t0
            kv, full_bytes = cache_bytes(cache), cache_bytes(ref_cache)
            held = cache.get_seq_length()
            for cell in todo:
                q: Question = cell["_question"]
                qref = qrefs[id(q)]
                q_ids = q.ids.to(group_ids.device)
                t0 = time.perf_counter()
                out = _forward(model, q_ids, cache, c, logits_to_keep=1)
                tokens = _greedy(
                    model, cache, c + q_ids.shape[1], out.logits[:, -1], cell["max_new_tokens"], eos
                )
                generate_s = time.perf_counter() - t0
                _back_to(cache, held)  # the question and answer out: the next question sees the document
                fid, fid_s = None, 0.0
                if fidelity:
                    fid, fid_s = _fidelity(
                        model, cache, held, c, logits, q_ids, qref.tf["context"], qref.tokens
                    )
                yield record(
                    cell, tokens, fid, **_measures(kv, full_bytes, compress_s, generate_s, fid_s, kept)
                )
        return
    for cell in todo:
        q = cell["_question"]
        qref = qrefs[id(q)]
        full_ids = torch.cat([group_ids, q.ids.to(group_ids.device)], dim=1)
        s = full_ids.shape[1]
        kept = press_budget(budget, ratio, s, window)
        with torch.no_grad(), press_context(model, name, budget=kept, length=s, window=window):
            t0 = time.perf_counter()
            cache, logits = _prefill(model, full_ids)
            compress_s = time.perf_counter() - t0
            kv, full_bytes = cache_bytes(cache), cache_bytes(qref.cache)
            held = cache.get_seq_length()
            t0 = time.perf_counter()
            tokens = _greedy(model, cache, s, logits, q.max_new_tokens, eos)
            generate_s = time.perf_counter() - t0
            _back_to(cache, held)
            fid, fid_s = None, 0.0
            if fidelity:  # nothing before the continuation: the question is inside the compressed prompt
                head = full_ids[:, :0]
                fid, fid_s = _fidelity(model, cache, held, s, logits, head, qref.tf["question"], qref.tokens)
        yield record(cell, tokens, fid, **_measures(kv, full_bytes, compress_s, generate_s, fid_s, kept))


def _fidelity(model, cache, held: int, start: int, logits, head, full_tf, tokens) -> tuple[Fidelity, float]:
    """The press's cache against the full cache's continuation ``full_tf`` (its greedy ``tokens``),
    teacher-forced after ``head`` (1, h): the question, when it follows the compressed document. The
    cache is cropped back to its ``held`` entries; the seconds it took come second."""
    t0 = time.perf_counter()
    n = full_tf.logprobs.shape[0]
    appended = torch.cat([head, tokens[None, : n - 1]], dim=1)
    # kvcake.replay.teacher_force's measures, ``appended`` fed at their own positions after the press's cache
    tf = forced(
        model, lambda ids: _forward(model, ids, cache, start, output_hidden_states=True), logits, appended, n
    )
    fid = compare(full_tf, tf, tokens[:n])
    _back_to(cache, held)
    return fid, time.perf_counter() - t0


def _measures(
    kv: int, full_bytes: int, compress_s: float, generate_s: float, fid_s: float, kept: int
) -> dict:
    """A press cell's record fields beside its answer and fidelity (no shared prefill: ``prefill_s`` 0)."""
    return dict(kv_bytes=kv, full_kv_bytes=full_bytes, kv_fraction=kv / full_bytes, prefill_s=0.0,
                compress_s=compress_s, generate_s=generate_s, fidelity_s=fid_s, kept_per_head=kept,
                kvpress=release())  # fmt: skip
