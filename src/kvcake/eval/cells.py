"""The records of one context group's cells: every method, budget and scenario against its reference."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import Any

import torch

import kvcake
from kvcake.eval.fidelity import Fidelity, cache_bytes, compare, replay_compress, teacher_force
from kvcake.eval.press_cells import is_press, press_cells
from kvcake.eval.questions import ContextGroup, Question
from kvcake.eval.records import FULL, fidelity_fields, round_sig
from kvcake.eval.reference import GroupRef, answer_tokens, continue_greedy, eos_ids
from kvcake.fp8 import storage_spec, store
from kvcake.method import make_method
from kvcake.replay import ScoreMemo


def run_group(model, tokenizer, group: ContextGroup, ref: GroupRef, cells: list[dict[str, Any]], window: int,
               shared: bool, fidelity: bool, fidelity_tokens: int,
               stepwise: bool = False) -> Iterable[dict[str, Any]]:  # fmt: skip
    """Yield the records of ``cells`` (all about ``group``), compressing each context once per
    method and budget in the context-only scenario; ``stepwise``: the fidelity measures feed the
    continuation a token a forward (``kvcake.replay.teacher_force``)."""
    dev = model.device
    ctx_ids = group.context.to(dev)
    c = ctx_ids.shape[1]
    qrefs = {id(r.question): r for r in ref.questions}
    memo = ScoreMemo() if shared else None  # prefill scores, shared by every budget of a method

    def decode(ids: torch.Tensor) -> str:
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def record(cell: dict[str, Any], tokens: torch.Tensor, fid: Fidelity | None, **extra) -> dict[str, Any]:
        q: Question = cell["_question"]
        pred = decode(tokens[: q.max_new_tokens])
        rec = {k: v for k, v in cell.items() if not k.startswith("_")}
        rec.update(
            context_tokens=c, question_tokens=q.ids.shape[1], prediction=pred, answers=q.answers,
            score=float(q.score(pred)), generated_tokens=int(tokens[: q.max_new_tokens].numel()), **q.info,
        )  # fmt: skip
        rec.update(fidelity_fields(fid))
        rec.update({k: (round_sig(v, 4) if isinstance(v, float) else v) for k, v in extra.items()})
        return rec

    # the full cache: one line per scenario, from the shared reference
    for cell in [x for x in cells if x["method"] == FULL]:
        qref = qrefs[id(cell["_question"])]
        sc = cell["scenario"]
        fid = None
        if fidelity:
            tf = qref.tf[sc]
            n = tf.logprobs.shape[0]
            nll = float(-tf.logprobs.gather(1, qref.tokens[:n].reshape(n, 1)).mean())
            fid = Fidelity.identical(nll, len(tf.attn), n, bool(tf.attn))
        full_bytes = cache_bytes(ref.cache if sc == "context" else qref.cache)
        yield record(cell, answer_tokens(model, qref.tokens, cell["max_new_tokens"]), fid, kv_bytes=full_bytes, full_kv_bytes=full_bytes, kv_fraction=1.0,
                     prefill_s=ref.prefill_s + qref.prefill_s, compress_s=0.0, generate_s=qref.generate_s)  # fmt: skip

    by_setting: dict[tuple, list[dict[str, Any]]] = {}
    for cell in cells:
        if cell["method"] != FULL:
            by_setting.setdefault(
                (cell["method"], cell["budget"], cell["ratio"], cell["scenario"]), []
            ).append(cell)
    for (name, budget, ratio, sc), todo in by_setting.items():
        if is_press(name):  # kvpress's press, answered as its pipeline answers (kvcake.eval.press_cells)
            yield from press_cells(
                model, ctx_ids, qrefs, todo, window, fidelity, eos_ids(model), record, ref.cache
            )
            continue
        spec, kv_dtype = storage_spec(name)  # ``cake+fp8``: CAKE, its kept entries in float8
        method = make_method(spec, budget=budget, ratio=ratio, window=window)
        if sc == "context":
            t0 = time.perf_counter()
            if shared:
                ctx = replay_compress(model, method, ref.captured, ref.cache, ctx_ids, ref.logits, chunks=1,
                                      memo=memo, scenario="context")  # fmt: skip
                if kv_dtype:
                    store(ctx.cache)  # as kv_dtype="fp8" stores it at the end of the prompt
            else:
                ctx = kvcake.compress(model, ctx_ids, method, kv_dtype=kv_dtype)
            compress_s = time.perf_counter() - t0
            kv = ctx.cache.kv_bytes()
            full_bytes = cache_bytes(ref.cache)
            before = _cache_digest(ctx.cache) if len(todo) > 1 else None
            for cell in todo:
                qref = qrefs[id(cell["_question"])]
                q_ids = cell["_question"].ids.to(dev)
                t0 = time.perf_counter()
                tokens = ctx.generate(q_ids, max_new_tokens=cell["max_new_tokens"], do_sample=False)[0]
                generate_s = time.perf_counter() - t0
                fid, fid_s = None, 0.0
                if fidelity:
                    t0 = time.perf_counter()
                    full_tf = qref.tf["context"]
                    n = full_tf.logprobs.shape[0]
                    appended = torch.cat([q_ids, qref.tokens[None, : n - 1]], dim=1)
                    tf = teacher_force(model, ctx.fork(), c, ctx.logits, appended, n, stepwise=stepwise)
                    fid = compare(full_tf, tf, qref.tokens[:n])
                    fid_s = time.perf_counter() - t0
                yield record(cell, tokens, fid, kv_bytes=kv, full_kv_bytes=full_bytes, kv_fraction=kv / full_bytes,
                             prefill_s=ref.prefill_s if shared else 0.0, compress_s=compress_s,
                             generate_s=generate_s, fidelity_s=fid_s)  # fmt: skip
            if before is not None and _cache_digest(ctx.cache) != before:
                raise RuntimeError(
                    f"{name}: answering changed the compressed context (a bug in fork/generate)"
                )
        else:
            for cell in todo:
                q: Question = cell["_question"]
                qref = qrefs[id(q)]
                full_ids = torch.cat([ctx_ids, q.ids.to(dev)], dim=1)
                t0 = time.perf_counter()
                if shared:
                    qctx = replay_compress(model, method, qref.captured, qref.cache, full_ids, qref.logits,
                                           memo=memo, scenario="question")  # fmt: skip
                    if kv_dtype:
                        store(qctx.cache)
                    compress_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    tokens = continue_greedy(model, qctx.fork(), full_ids, qctx.logits, q.max_new_tokens)
                    generate_s = time.perf_counter() - t0
                else:
                    out, _ = kvcake.generate(
                        model,
                        full_ids,
                        method,
                        max_new_tokens=q.max_new_tokens,
                        do_sample=False,
                        kv_dtype=kv_dtype,
                    )
                    tokens = out[0, full_ids.shape[1] :]
                    generate_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    # its bytes and fidelity
                    qctx = kvcake.compress(model, full_ids, method, scenario="question", kv_dtype=kv_dtype)
                    compress_s = time.perf_counter() - t0
                kv = qctx.cache.kv_bytes()
                full_bytes = cache_bytes(qref.cache)
                fid, fid_s = None, 0.0
                if fidelity:
                    t0 = time.perf_counter()
                    full_tf = qref.tf["question"]
                    n = full_tf.logprobs.shape[0]
                    tf = teacher_force(model, qctx.fork(), full_ids.shape[1], qctx.logits,
                                       qref.tokens[None, : n - 1], n, stepwise=stepwise)  # fmt: skip
                    fid = compare(full_tf, tf, qref.tokens[:n])
                    fid_s = time.perf_counter() - t0
                yield record(cell, tokens, fid, kv_bytes=kv, full_kv_bytes=full_bytes,
                             kv_fraction=kv / full_bytes,
                             prefill_s=(ref.prefill_s + qref.prefill_s) if shared else 0.0, compress_s=compress_s,
                             generate_s=generate_s, fidelity_s=fid_s)  # fmt: skip


def _cache_digest(cache) -> str:
    """A hash of every layer's keys, values and positions (to check a context is never changed)."""
    h = hashlib.sha256()
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "positions", None)):
            if t is not None:
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
