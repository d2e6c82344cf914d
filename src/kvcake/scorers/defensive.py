"""DefensiveKV's defensive aggregation: Feng et al., "DefensiveKV: Taming the Fragility of KV
Cache Eviction in LLM Inference", ICLR 2026; the authors' code is
https://github.com/FFY0/DefensiveKV (``kvpress/presses/efficient_defensivekv_press.py``).

SnapKV scores a token by the *mean* attention of the window's queries; a future question may
need exactly the token the window's average neglected. DefensiveKV scores by the worst case:
the *maximum* over the window's queries and the GQA group, with every score raised to at
least the head's mean over keys, so no head's tail falls to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import check_int, check_real
from ..devices import cpu_route
from .base import PrefillInputs, Scorer, avg_pool_padded, pool1d, protect

MARK = 2.0
"""Offset added to the entries of CriticalKV's first stage (``critical_mass``). Defensive
scores are attention probabilities, so at most 1: a marked entry (>= ``MARK``) ranks above
every unmarked one in each head, across heads (Ada-KV) and across layers (global allocation).
The authors' code sets them to the layer's maximum value-weighted score instead: above every
unmarked entry of their layer, but not across layers (``kvcake.allocators.global_scores``)."""

# Bytes of window attention rows per block on the CPU (:func:`_aggregate_cpu`): their passes and
# buffers stay in a core's cache (512 KB and 1 MB the fastest of 256 KB-2 MB on SmolLM2's heads).
_BLOCK = 1 << 19


@dataclass(frozen=True)
class DefensiveScorer(Scorer):
    """Worst-case window attention, average-pooled and floored at each head's mean.

    For the window's queries ``A`` (B, H, w, S) (SnapKV's window attention), on the prefix
    columns (the ``P = S - w`` tokens before the window):

    1. each query row is average-pooled over positions (``kernel``, default 5) and rescaled to
       its unpooled mass, so pooling moves attention between neighbours without adding any;
    2. ``aggregate="max"`` (DefensiveKV) takes the maximum over the window's rows and the GQA
       group; ``"mean"`` the mean over both (SnapKV's aggregation, kept for comparison);
    3. every score is raised to at least the mean over the head's prefix keys.

    With ``critical_mass`` (default 0.9, the authors' code) the scorer also marks CriticalKV's
    first stage for ``select=critical,select.first=marked``: per KV head, the fewest
    highest-attention prefix entries whose share of the head's mean (unpooled) window
    attention reaches ``critical_mass`` minus the window's own share (the attention the
    window's queries pay to the window, averaged over heads and rows). Marked entries get
    ``+MARK``. ``critical_mass=0`` marks nothing. Differences from the authors' code: the
    share is per sequence (theirs one scalar for the batch, read off the last ``w`` prefix
    columns), and the set includes the entry that crosses the threshold (theirs stops before
    it). Theirs is capped per head at the average prefix budget (``S * (1 - ratio) - w``
    entries), the highest by unpooled mean attention, before the heads share the layer's
    budget; here every entry up to the mass is marked, Ada-KV splits the layer among heads on
    these scores (marks included) and the selector caps the marks at each head's own count,
    keeping the highest by this scorer's (pooled, worst-case) score. The selector then weighs
    the rest by value norms within each head, where the authors rank the value-weighted scores
    across heads at once; the selector's ``eps`` (1e-4) is added before weighting; and the
    presets keep Ada-KV's safeguard (``heads.alpha``, 0.2), which the authors' presses do not
    pin (``heads.alpha=0`` drops it).

    Output (B, H_kv, S) float32, window at +inf, padding at -inf.
    """

    kernel: int = 5
    aggregate: str = "max"
    critical_mass: float = 0.9
    name = "defensive"
    reduce = "max"

    def __post_init__(self) -> None:
        check_int("defensive pooling kernel", self.kernel, 1, "score.kernel=5")
        if self.kernel % 2 == 0:
            raise ValueError(f"defensive pooling kernel must be odd, got {self.kernel}")
        if self.aggregate not in ("max", "mean"):
            raise ValueError(f"defensive aggregate must be 'max' or 'mean', got {self.aggregate!r}")
        check_real("defensive critical_mass", self.critical_mass, "score.critical_mass=0.9", high=1.0)

    @property
    def marks_critical(self) -> bool:
        return self.critical_mass > 0

    def prefill(self, inp: PrefillInputs) -> torch.Tensor:
        probs, row_valid = inp.window_attention()  # (B, H, w, S)
        b, h, w, s = probs.shape
        hkv, g = inp.keys.shape[1], inp.num_groups
        p = s - w
        if p <= 0:  # everything is window
            return protect(torch.zeros(b, hkv, s, device=probs.device), inp.key_valid, inp.window)
        key_ok = inp.key_valid[:, :p]  # (B, P)
        n_rows = (row_valid.sum(-1).clamp(min=1) * g).float()[:, None, None]  # (B, 1, 1)
        fn = _aggregate_cpu if cpu_route(probs.device) else aggregate_reference
        agg, row_sums = fn(probs, key_ok, hkv, self.kernel, self.aggregate, self.marks_critical)
        if self.aggregate == "mean":
            agg = agg / n_rows  # (B, H_kv, P)
        if inp.group_split is not None:  # a latent layer's query group, split over ranks
            agg = inp.group_split.pool(agg, self.aggregate)
            if row_sums is not None:  # the mean over ranks: every sum / world, the same shares
                row_sums = inp.group_split.pool(row_sums, "mean")
        n_keys = key_ok.sum(-1).clamp(min=1).float()[:, None, None]
        floor = (agg * key_ok[:, None, :]).sum(-1, keepdim=True) / n_keys  # (B, H_kv, 1)
        scores = torch.maximum(agg, floor)
        if self.marks_critical:
            over = inp.split or inp.group_split  # the window's share: over every rank's heads
            scores = scores + MARK * self._critical(row_sums, probs, row_valid, key_ok, n_rows, over)
        full = torch.cat([scores, torch.zeros(b, hkv, w, device=scores.device)], dim=-1)  # (B, H_kv, S)
        return protect(full, inp.key_valid, inp.window)

    def _critical(self, row_sums, probs, row_valid, key_ok, n_rows, split=None) -> torch.Tensor:
        """(B, H_kv, P) bool: CriticalKV's first stage (see the class docstring). row_sums: (B, H_kv,
        P) the unpooled prefix attention summed over each KV head's group and rows. The window's
        share is the layer's, over every head: under tensor parallelism (``split``, or a latent
        layer's ``group_split``) every rank's rows gathered in head order and summed as one process
        sums them (one all-gather)."""
        p = row_sums.shape[-1]
        mean = row_sums / n_rows * key_ok[:, None, :]  # (B, H_kv, P) unpooled
        share = mean / mean.sum(-1, keepdim=True).clamp(min=1e-30)
        window_mass = probs[..., p:].sum(-1)  # (B, H, w) attention of the window on itself
        if split is not None:  # (world, B, h, w) -> (B, H, w), rank order = head order
            window_mass = split.gather(window_mass).permute(1, 0, 2, 3).flatten(1, 2)
        heads = window_mass.shape[1]
        window_share = window_mass.sum((1, 2)) / (row_valid.sum(-1).clamp(min=1) * heads)  # (B,)
        threshold = (self.critical_mass - window_share).clamp(min=0.0)[:, None, None]  # (B, 1, 1)
        ordered, order = torch.sort(share, dim=-1, descending=True, stable=True)
        before = ordered.cumsum(-1) - ordered  # mass of the entries ranked above each one
        take = (before < threshold) & (ordered > 0)
        return torch.zeros_like(take).scatter(-1, order, take)

    def describe(self) -> str:
        return f"{self.name}({self.aggregate})"


def aggregate_reference(
    probs: torch.Tensor, key_ok: torch.Tensor, hkv: int, kernel: int, aggregate: str, row_sums: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prefix rows of the window attention probs (B, H, w, S) pooled (``kernel``), masked by
    key_ok (B, P) and rescaled to their mass, then their max (``aggregate="max"``) or sum
    (``"mean"``) over each KV head's group and rows: (B, H_kv, P) float32; and with ``row_sums``
    the unpooled rows' sum the same way (CriticalKV's first stage), else None. A pass over the
    whole (B, H, w, P) tensor per step (the CUDA route; :func:`_aggregate_cpu`'s oracle)."""
    b, h, w, s = probs.shape
    p, g = key_ok.shape[-1], h // hkv
    prefix = probs[..., :p]  # (B, H, w, P)
    mass = prefix.sum(-1, keepdim=True)  # (B, H, w, 1)
    pooled = pool1d(prefix.reshape(b, h * w, p), kernel, "avg").reshape(b, h, w, p)
    pooled = pooled * key_ok[:, None, None, :]  # what leaks into left padding is dropped, as past the edge
    pooled = pooled * (mass / pooled.sum(-1, keepdim=True).clamp(min=1e-30))
    pooled = pooled.reshape(b, hkv, g * w, p)  # (B, H_kv, G*w, P): group and rows together
    agg = pooled.amax(2) if aggregate == "max" else pooled.sum(2)  # (B, H_kv, P)
    return agg, prefix.reshape(b, hkv, g * w, p).sum(2) if row_sums else None


def _aggregate_cpu(
    probs: torch.Tensor, key_ok: torch.Tensor, hkv: int, kernel: int, aggregate: str, row_sums: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`aggregate_reference` a block of a KV head's rows at a time (``_BLOCK``), each row's
    float operations unchanged (equal bits): every pass then reads a block in cache instead of the
    whole (B, H, w, P) tensor (4.7 MB for SmolLM2's 9 heads at 4096 tokens), into reused buffers.
    The pooling adds the rows' own shifted slices, and their first and last ``kernel // 2``
    outputs (those reading the zero padding) come from short padded pieces, pooled for every row
    at once. ``"mean"`` sums a KV head's rows at once, as the reference does (the order of a sum
    depends on its length). A loop over heads and blocks for that reason. 4.4 against 2.4 ms for
    SmolLM2's heads at 4096 tokens, one core (the whole prefill after the window attention: 5.7
    against 3.7 ms)."""
    b, h, w, s = probs.shape
    p, g, r = key_ok.shape[-1], h // hkv, kernel // 2
    if kernel == 1 or p < 2 * kernel:  # nothing to pool, or too short to matter
        return aggregate_reference(probs, key_ok, hkv, kernel, aggregate, row_sums)
    n, inner = g * w, p - 2 * r  # a KV head's rows; outputs reading no padding
    prefix = probs[..., :p].reshape(b, hkv, n, p)  # (B, H_kv, G*w, P), the rows S apart
    left = avg_pool_padded(F.pad(prefix[..., : 2 * r], (r, 0)), kernel)  # (B, H_kv, G*w, r)
    right = avg_pool_padded(F.pad(prefix[..., inner:], (0, r)), kernel)  # (B, H_kv, G*w, r)
    keep = key_ok.float()  # (B, P)
    agg = probs.new_empty(b, hkv, p)
    sums = probs.new_empty(b, hkv, p) if row_sums else None
    step = math.ceil(n / math.ceil(n * p * probs.element_size() / _BLOCK))  # rows a block, near _BLOCK bytes
    pooled = probs.new_empty(n if aggregate == "mean" else step, p)
    for i in range(b):
        masked = not bool(key_ok[i].all())  # x * 1.0 is x: an unpadded row skips the product
        for k in range(hkv):
            group = prefix[i, k]  # (G*w, P)
            if sums is not None:
                sums[i, k] = group.sum(0)
            for j in range(0, n, step):
                x = group[j : j + step]  # (rows, P)
                rows = pooled[j : j + x.shape[0]] if aggregate == "mean" else pooled[: x.shape[0]]
                avg_pool_padded(x, kernel, out=rows[:, r : r + inner])  # the outputs reading no padding
                rows[:, :r] = left[i, k, j : j + step]
                rows[:, r + inner :] = right[i, k, j : j + step]
                if masked:
                    rows.mul_(keep[i])
                rows.mul_(x.sum(-1, keepdim=True) / rows.sum(-1, keepdim=True).clamp(min=1e-30))
                if aggregate == "max":
                    top = rows.amax(0)
                    agg[i, k] = top if j == 0 else torch.maximum(agg[i, k], top, out=agg[i, k])
            if aggregate == "mean":
                agg[i, k] = pooled.sum(0)
    return agg, sums
