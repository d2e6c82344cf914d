"""Which entries a kvpress press and a kvcake method keep of the same document, layer by layer: the
kept sets compared, where ``docs/kvpress.md`` compares only what the two caches answer.

As that page's cells compress it: the document of ``--task`` (default ``niah_single``) sample
``--seed`` (default 0) at ``--length`` tokens (default 2048) in the ``--haystack`` (default
paul_graham; the restated needle for the NIAH tasks), with its question for ``--scenario question``
(the question inside the compressed prompt), alone for ``context`` (the default); ``--ratio`` of it
kept, a ``--window``-token observation window (default 32, both sides'). The press's kept set
is what its attention patch leaves unmasked (the Ada-KV presses, the ones compared here). Run it
where kvpress is installed (kvpress 0.5 needs transformers < 5.3: docs/kvpress.md says how), with
this repository on ``PYTHONPATH``:

    PYTHONPATH=src /tmp/kvp/bin/python scripts/kvpress_kept_sets.py --press adakv \\
        --method adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress

Prints, for each layer whose sets differ, the entries kept by one side only, then the totals.
"""

from __future__ import annotations

import argparse

import torch


def press_masks(model, ids: torch.Tensor, press: str, kept: int, window: int) -> list[torch.Tensor]:
    """(1, H_kv, S) bool per layer: the entries ``kvpress:<press>`` keeps of ``ids`` (1, S)."""
    from kvcake.bench.kvpress_rows import press_context
    from kvcake.eval.press_cells import _prefill

    s, hkv = ids.shape[1], model.config.num_key_value_heads
    with torch.no_grad(), press_context(model, f"kvpress:{press}", budget=kept, length=s, window=window):
        _prefill(model, ids)
        masks = []
        for layer in model.model.layers:
            masked = getattr(layer.self_attn, "masked_key_indices", None)
            if masked is None:
                raise ValueError(f"press {press!r} does not mask: this script compares the Ada-KV presses")
            m = torch.ones(1, hkv, s, dtype=torch.bool)  # the whole prompt held, the dropped entries masked
            b, h, pos = masked
            m[b, h, pos] = False
            masks.append(m)
    return masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--press", default="adakv", help="adakv or critical-adakv (the presses that mask)")
    parser.add_argument("--method", default="adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--task", default="niah_single", help="a synthetic task of docs/kvpress.md")
    parser.add_argument("--seed", type=int, default=0, help="the sample (its seed)")
    parser.add_argument("--scenario", choices=("context", "question"), default="context")
    parser.add_argument(
        "--length", type=int, default=2048, help="the document's tokens (as the task builds it)"
    )
    parser.add_argument(
        "--haystack", default="paul_graham", help="paul_graham, noise, or a text file or folder"
    )
    parser.add_argument("--window", type=int, default=32, help="the observation window, both sides'")
    args = parser.parse_args()
    import kvpress  # noqa: F401  (its patch wraps the attention functions before kvcake's exist)

    import kvcake
    from kvcake.eval.press_cells import press_budget
    from kvcake.eval.questions import task_options_for
    from kvcake.eval.tasks import make_samples
    from kvcake.inspect import kept_mask
    from kvcake.prompts import build_prompt

    model, tok = kvcake.load_model()
    options = task_options_for(args.task, "restated", None)
    (sample,) = make_samples(
        args.task, tok, 1, args.length, seed=args.seed, haystack=args.haystack, **options
    )
    prompt = build_prompt(
        tok, sample.context_prompt(), sample.question_prompt(answer_prefix=False), sample.answer_prefix
    )
    ids = (
        prompt.context if args.scenario == "context" else torch.cat([prompt.context, prompt.question], dim=1)
    )
    kept = press_budget(None, args.ratio, ids.shape[1], args.window)
    theirs = press_masks(model, ids, args.press, kept, args.window)
    context = kvcake.compress(model, ids, args.method, budget=kept, window=args.window)
    ours = [torch.from_numpy(m)[None] for m in kept_mask(context)]
    differing = 0
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        only_press, only_kvcake = int((a & ~b).sum()), int((b & ~a).sum())
        if only_press or only_kvcake:
            differing += 1
            print(f"layer {i}: {only_press} entries kept by kvpress only, {only_kvcake} by kvcake only")
    print(
        f"kvpress:{args.press} against {args.method}: {args.task} sample {args.seed}, "
        f"{'context-only' if args.scenario == 'context' else 'question-aware'}"
        f" ({ids.shape[1]} tokens compressed), {kept} entries a head "
        f"on average; {differing} of {len(ours)} layers keep different entries"
    )


if __name__ == "__main__":
    main()
