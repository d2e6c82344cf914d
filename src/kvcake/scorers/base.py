"""Token scorers: how important each cached entry is, per (sequence, KV head, position).

Layout: queries ``(B, H, S, d)`` and keys/values ``(B, H_kv, S, d)``, post-RoPE, as the
attention function receives them. A scorer first scores per query head ``(B, H, S)``; the
group reduction (mean by default, max as an option) brings that to KV-head granularity
``(B, H_kv, S)``. The caller then sets the window to ``+inf`` and padding to ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..devices import may_mask
from ..logit_terms import PLAIN, LogitTerms

if TYPE_CHECKING:
    from ..tensor_parallel import HeadSplit


@dataclass
class PrefillInputs:
    """Everything a scorer may read at the end of one layer's prefill.

    query: (B, H, S, d); keys, values: (B, H_kv, S, d); key_valid: (B, S) bool (False on left
    padding); window: the observation window ``Sw``; scaling: the model's softmax scale;
    column_sums: (B, H, S) float32 column sums of the prompt's causal attention where the
    attention itself produced them (:meth:`Scorer.prompt_attention`), else None; terms: the
    model's soft cap on the logits and sinks in every row's softmax (``kvcake.logit_terms``);
    split: under tensor parallelism the heads' split (``kvcake.tensor_parallel.HeadSplit``: query
    and keys are this rank's heads), for what a scorer takes over every head of the layer; None
    in one process. group_split: a latent layer's query group split over ranks instead (keys
    whole, query this rank's heads of the group): scores pooled over the group are pooled over
    the ranks too (``HeadSplit.pool``); None elsewhere.
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_valid: torch.Tensor
    window: int
    scaling: float
    column_sums: torch.Tensor | None = None
    terms: LogitTerms = PLAIN
    split: HeadSplit | None = None
    group_split: HeadSplit | None = None
    _window_attention: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _mean_var: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_groups(self) -> int:
        return self.query.shape[1] // self.keys.shape[1]

    def window_attention(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``A = softmax(Q[-w:] K^T * scale)`` in float32 with the causal mask inside the window.

        Returns ``(A, row_valid)``: A (B, H, w, S) with rows of padding queries zeroed, and
        row_valid (B, w) bool. ``w = min(Sw, S)``. It costs ``w / S`` of the layer's attention.
        A GQA group's query rows share one matmul with their KV head, and the masks are filled in
        place: a third of :func:`window_attention_reference`'s time on the CPU (10.4 against 4.6
        ms for SmolLM2's heads at 4096 tokens), with its bits in the tests.
        """
        if self._window_attention is None:
            b, h, _, d = self.query.shape
            hkv, s_len = self.keys.shape[1], self.keys.shape[2]
            q = self.query[:, :, -self.window :].float()  # (B, H, w, d)
            w = q.shape[2]
            q = q.reshape(b, hkv, self.num_groups * w, d)
            logits = torch.matmul(q, self.keys.float().transpose(-1, -2)).view(b, h, w, s_len)
            logits = self.terms.cap(logits.mul_(self.scaling))
            later = torch.ones(w, w, dtype=torch.bool, device=q.device).triu_(1)  # causal, in the window
            logits[..., s_len - w :].masked_fill_(later, float("-inf"))
            row_valid = self.key_valid[:, -w:]  # (B, w): a padding query sees no key (left padding)
            # the padding masks are two passes over the logits: skipped without padding where
            # checking costs no device synchronisation (the CPU)
            padded = may_mask(self.key_valid)
            if padded:
                logits.masked_fill_(~self.key_valid[:, None, None, :], float("-inf"))
                logits.masked_fill_(~row_valid[:, None, :, None], 0.0)
            probs = self.terms.softmax(logits, self.terms.per_head())
            if padded:
                probs.mul_(row_valid[:, None, :, None])
            self._window_attention = (probs, row_valid)
        return self._window_attention

    def window_mean_var(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`window_rows_mean_var` of :meth:`window_attention`, (B, H, S) twice, computed once
        for the layer (CAKE's score and its preference's shift read both)."""
        if self._mean_var is None:
            self._mean_var = window_rows_mean_var(*self.window_attention())
        return self._mean_var


def window_attention_reference(inp: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`PrefillInputs.window_attention` with every query head's keys expanded and the masks
    built whole (the tests' oracle)."""
    q = inp.query[:, :, -inp.window :].float()  # (B, H, w, d)
    k = _expand_kv(inp.keys.float(), inp.num_groups)  # (B, H, S, d)
    s_len, w = k.shape[2], q.shape[2]
    logits = inp.terms.cap(torch.matmul(q, k.transpose(-1, -2)) * inp.scaling)  # (B, H, w, S)
    cols = torch.arange(s_len, device=k.device)
    causal = cols[None, :] <= torch.arange(s_len - w, s_len, device=k.device)[:, None]  # (w, S)
    allowed = causal[None, None] & inp.key_valid[:, None, None, :]
    row_valid = inp.key_valid[:, -w:]  # (B, w)
    logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    probs = inp.terms.softmax(logits, inp.terms.per_head())
    return probs * row_valid[:, None, :, None], row_valid


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, S, d) -> (B, H_kv * groups, S, d), query head ``h`` reading KV head ``h // groups``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def window_rows_mean(probs: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """Mean over the valid window rows (padding rows are zero). probs (B, H, w, S) -> (B, H, S)."""
    n = row_valid.sum(-1).clamp(min=1).to(probs.dtype)[:, None, None]  # (B, 1, 1)
    return probs.sum(2) / n


def window_rows_mean_var(probs: torch.Tensor, row_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance over the valid window rows. probs (B, H, w, S) -> two (B, H, S).
    Without padding rows the mask's multiply (by 1) is left out where checking is free (the CPU)."""
    n = row_valid.sum(-1).clamp(min=1).to(probs.dtype)[:, None, None]  # (B, 1, 1)
    mean = window_rows_mean(probs, row_valid)
    dev = probs - mean[:, :, None, :]
    if may_mask(row_valid):
        dev = dev * row_valid[:, None, :, None]
    var = (dev**2).sum(2) / (n - 1).clamp(min=1)
    return mean, var


def pool1d(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """1-D pooling over positions, stride 1, 'same' length. x (B, H, S).

    ``avg`` adds the ``kernel`` shifted copies in window order and divides by ``kernel``, the very
    float operations of torch's average-pooling kernel (``count_include_pad=True``; a missing
    neighbour adds 0), at a third of its time on the CPU; :func:`pool1d_reference` is torch's own,
    and the tests require equal bits."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    if kind == "avg" and x.dtype in (torch.float32, torch.float64):  # torch's accumulator type
        r = kernel // 2
        return avg_pool_padded(F.pad(x, (r, r)), kernel)  # padded (B, H, S + 2r)
    return pool1d_reference(x, kernel, kind)


def avg_pool_padded(padded: torch.Tensor, kernel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pool1d``'s average from rows already padded with ``r = kernel // 2`` zeros a side: padded
    (..., S + 2r) -> (..., S), written into ``out`` (a reused buffer) if given."""
    s = padded.shape[-1] - 2 * (kernel // 2)
    out = torch.add(padded[..., 0:s], padded[..., 1 : s + 1], out=out)
    for j in range(2, kernel):  # the window, left to right
        out += padded[..., j : j + s]
    return out.div_(kernel)


def pool1d_reference(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """``pool1d`` through torch's pooling functions. x (B, H, S)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    b, h, s = x.shape
    flat = x.reshape(b * h, 1, s)
    if kind == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif kind == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {kind!r}")
    return out[..., :s].reshape(b, h, s)


def pool_rows(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """``pool1d`` over the last dim of a 4-D (B, H_kv, G, N) tensor in one ATen op: a 2-D pool
    with a (1, kernel) window leaves dims 0-2 alone (the static decode step's form)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    if kind == "max":
        return F.max_pool2d(x, (1, kernel), stride=1, padding=(0, kernel // 2))
    if kind == "avg":
        return F.avg_pool2d(x, (1, kernel), stride=1, padding=(0, kernel // 2))
    raise ValueError(f"pooling must be 'max' or 'avg', got {kind!r}")


def group_reduce(x: torch.Tensor, groups: int, how: str) -> torch.Tensor:
    """(B, H, N) -> (B, H_kv, N) over each GQA group (``mean`` or ``max``)."""
    if groups == 1:
        return x
    b, h, n = x.shape
    x = x.reshape(b, h // groups, groups, n)
    return x.mean(2) if how == "mean" else x.amax(2)


class Scorer:
    """Base class: subclasses write ``score_heads`` (prefill) and ``decode_heads`` (decoding).

    Parameters shared by all scorers: ``reduce`` is the GQA group reduction (``mean``/``max``).
    ``stateful`` scorers (H2O) keep their prefill scores and add each decoding step's attention.
    ``order_sensitive`` scorers read neighbouring entries while decoding (pooling), so a cache
    whose slots are not in position order must sort them first (``kvcake.step.common.rank``).
    ``layer_wide`` scorers (TOVA) give every head the same score, a mean over all the layer's
    heads, so a tensor-parallel cache averages them over ranks (``kvcake.tensor_parallel``).
    """

    name = "base"
    stateful = False
    order_sensitive = False
    layer_wide = False
    reduce = "mean"
    marks_critical = False  # adds MARK to CriticalKV's first stage (DefensiveScorer)
    needs_probs = True  # whether decoding scores read the attention (StreamingLLM's do not)

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:  # pragma: no cover - interface
        """Per query head scores (B, H, S); only prefix columns (before the window) matter."""
        raise NotImplementedError

    @property
    def scores_in_attention(self) -> bool:
        """Whether :meth:`prompt_attention` computes the prompt's attention (and so the scores)."""
        return False

    def prompt_attention(self, query, key, value, mask, key_valid, scaling):
        """The prompt's attention computed together with this scorer's inputs, or None.

        A scorer that reads the whole prompt's attention matrix (H2O) can take it from the
        layer's own attention instead of computing it a second time: it returns ``(out, sums)``,
        ``out`` (B, S, H, d) as the stock kernel's output and ``sums`` what
        :attr:`PrefillInputs.column_sums` holds. None: the stock kernel runs, then
        ``score_heads``. query (B, H, S, d); key, value (B, H_kv, S, d); mask: the stock
        kernel's (None or 4-D); key_valid (B, S) bool."""
        return None

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per query head scores (B, H, N) over the cached entries during decoding.

        probs: (B, H, q, N) attention of the current query rows over the cache (0 on empty
        slots); positions: (B, H_kv, N) logical positions (-1 on empty slots). Default: the
        current attention averaged over the query rows (TOVA's and CAKE's decoding rule).
        """
        return probs.mean(2)

    def prefill(self, inp: PrefillInputs) -> torch.Tensor:
        """KV-head scores (B, H_kv, S) with the window at +inf and padding at -inf."""
        return protect(self._kv_scores(inp), inp.key_valid, inp.window)

    def prefill_sums(self, inp: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``prefill``'s scores and, for a ``stateful`` scorer, the prompt's last ``window`` columns
        as scored (B, H_kv, w), which the window's +inf hides: H2O's sums go on accumulating
        while decoding, the window's from what the prompt gave them (None for other scorers)."""
        if not self.stateful:
            return self.prefill(inp), None
        scores = self._kv_scores(inp)
        return protect(scores, inp.key_valid, inp.window), scores[..., -inp.window :].clone()

    def _kv_scores(self, inp: PrefillInputs) -> torch.Tensor:
        scores = group_reduce(self.score_heads(inp).float(), inp.num_groups, self.reduce)
        if inp.group_split is not None:  # the rest of the query group is on the other ranks
            scores = inp.group_split.pool(scores, self.reduce)
        return scores  # (B, H_kv, S)

    def decode(
        self, probs: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None
    ) -> torch.Tensor:
        """KV-head decoding scores (B, H_kv, N); the caller protects the window."""
        groups = probs.shape[1] // positions.shape[1]
        scores = group_reduce(self.decode_heads(probs, positions).float(), groups, self.reduce)
        if self.stateful and previous is not None:
            scores = scores + torch.where(torch.isfinite(previous), previous, torch.zeros_like(previous))
        return scores

    def oldest_victim(self, window: int) -> tuple[int, int] | None:
        """``(k, least)`` where a decode step's victim is always a head's ``k``-th oldest held entry
        once every head holds at least ``least`` entries besides the new token, with its newest
        ``window`` protected (scores that rank by position alone); None where the scores decide.
        A full static layer then takes its victim by ``kthvalue`` (``kvcake.step.dense.evict``)."""
        return None

    def decode_step(
        self, probs: torch.Tensor | None, positions: torch.Tensor, previous: torch.Tensor | None
    ) -> torch.Tensor:
        """``decode`` for the single new query row of a static decode step (``kvcake.step.common.rank``).

        probs: (B, H_kv, G, N) float attention of the new token, the GQA group on dim 2 (None
        where ``needs_probs`` is False); positions: (B, H_kv, N), -1 on empty slots; previous:
        (B, H_kv, N) finite kept sums (stateful scorers) or None. An ``order_sensitive`` scorer
        gets its entries sorted by position, newest first (pooling is symmetric, so that is the
        reference's order reversed). Returns (B, H_kv, N) scores, or (B, 1, N) where every head
        shares them; empty slots' scores are unspecified (the caller protects them).

        This default is the reference ``decode`` itself; subclasses return the same scores in
        fewer ATen ops (``tests/test_scorers.py`` compares each with ``decode``)."""
        b, hkv, g, n = probs.shape
        return self.decode(probs.reshape(b, hkv * g, 1, n), positions, previous)

    def describe(self) -> str:
        return self.name


def protect(scores: torch.Tensor, key_valid: torch.Tensor, window: int) -> torch.Tensor:
    """Window (the last ``window`` valid positions) to +inf, padding to -inf. scores (B, H_kv, S)."""
    from_right = key_valid.flip(-1).long().cumsum(-1).flip(-1)  # valid tokens at or after each position
    in_window = key_valid & (from_right <= window)  # (B, S)
    scores = scores.masked_fill(in_window[:, None, :], float("inf"))
    return scores.masked_fill(~key_valid[:, None, :], float("-inf"))
