"""Layer allocators: how many entries each layer keeps, as exact integers.

Layout convention: budgets are ``(B, n)`` int64, one row per sequence, one column per layer
(``n`` is the number of layers seen so far during a cascade, ``L`` at the end). Every
allocator reserves the window for each layer and shares the rest, and every result sums
exactly to ``min(total, sum(caps))`` per sequence.

Device: allocation is host bookkeeping (a few numbers per layer, with ``.tolist()`` in the
exact rounding), so every tensor of a request lives on the CPU; the cache moves preferences to
the host before allocating and moves each layer's budget to that layer's device to evict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AllocationRequest:
    """What an allocator needs at one stage.

    total: (B,) int64, the whole budget ``B_total`` of each sequence (per KV head).
    cap: (B,) int64, the prompt length of each sequence; no layer keeps more.
    window: the protected window each layer keeps (already capped by the prompt length).
    num_layers: ``L``.
    preferences: (B, n) float64 or None, one per layer seen so far (CAKE).
    final: whether this is the last stage (exact rounding) or an intermediate one.
    layer_scores: the full prompt's (B, H_kv, S) scores of each layer seen so far, or None
    (the global allocator); the one exception to the host rule: they stay on the model's
    device and the allocator reduces them to host counts.
    split: the tensor-parallel head split (:class:`kvcake.tensor_parallel.HeadSplit`) when
    ``layer_scores`` hold this rank's heads only, else None.
    carry: what the allocator keeps from one cascade stage to the next, held by the cache for
    one prefill (an empty dict at its first stage), or None: nothing kept.
    winners: (B, n) float64 on the host or None: what the global allocator's ``count_winners``
    returned for this stage, counted ahead on the device (``cascade.PendingStage``); None:
    counted by ``allocate`` from ``layer_scores``.
    """

    total: torch.Tensor
    cap: torch.Tensor
    window: torch.Tensor
    num_layers: int
    preferences: torch.Tensor | None = None
    final: bool = True
    layer_scores: tuple[torch.Tensor, ...] | None = None
    split: object | None = None
    carry: dict | None = None
    winners: torch.Tensor | None = None

    def __post_init__(self) -> None:
        named = {"total": self.total, "cap": self.cap, "window": self.window, "preferences": self.preferences,
                 "winners": self.winners}  # fmt: skip
        away = {k: str(t.device) for k, t in named.items() if t is not None and t.device.type != "cpu"}
        if away:
            raise ValueError(
                f"allocation runs on the host, but {away} are not on the CPU: pass them with .cpu() "
                "(budgets are host bookkeeping; move each layer's budget to its device after allocating)"
            )


class LayerAllocator:
    """Base class. ``needs_preferences`` tells the cache to compute CAKE's preference scores;
    ``cascading`` tells it to re-allocate after every layer (Algorithm 1 of CAKE);
    ``needs_scores`` to keep every layer's full prompt scores during prefill and pass them."""

    name = "base"
    needs_preferences = False
    needs_scores = False
    cascading = False

    def allocate(self, req: AllocationRequest) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def _prepare(weights: torch.Tensor, base: torch.Tensor, cap: torch.Tensor, total: torch.Tensor):
    """The water-filling's inputs in float64: weights scaled to a maximum of 1 (all-zero rows
    become equal weights), base (B, 1), cap (B, 1), total (B,), and what the layers can reach."""
    w = weights.double().to(cap.device)  # preferences may come from the model's device
    base = base.double()[:, None]
    cap_ = cap.double()[:, None]
    total = total.double()
    # All-zero weights would starve every layer: fall back to equal weights.
    w = torch.where(w.sum(1, keepdim=True) > 0, w, torch.ones_like(w))
    w = w / w.amax(1, keepdim=True)  # scale-free (preferences span many orders of magnitude)
    # What the layers can reach: zero-weight layers never grow past their base.
    reach = torch.where(w > 0, cap_, torch.minimum(base, cap_)).sum(1)
    return w, base, cap_, total, reach


def _finish(x: torch.Tensor, w, base, cap_, total) -> torch.Tensor:
    """Layers with zero weight cannot grow; if the others are all capped, what is left goes to
    the room that remains, in proportion to it (never past a cap); a total at or below the bases
    keeps the bases."""
    room = (cap_ - x).clamp(min=0)
    residual = (total - x.sum(1)).clamp(min=0)[:, None]
    share = torch.where(
        room.sum(1, keepdim=True) > 0, room / room.sum(1, keepdim=True).clamp(min=1e-12), room
    )
    x = x + torch.minimum(room, residual * share)
    base_total = torch.minimum(base, cap_).sum(1)
    return torch.where((total <= base_total)[:, None], torch.minimum(base, cap_).expand_as(x), x)


def waterfill(
    weights: torch.Tensor, base: torch.Tensor, cap: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """Real-valued allocation ``x_l = min(cap, base + lam * w_l)`` with ``sum_l x_l = total``.

    weights: (B, n) >= 0; base, cap, total: (B,). A layer that hits its cap gives its excess to
    the others; if ``total >= n * cap`` everything is capped. Closed form (float64): ``sum_l x_l``
    is piecewise linear in ``lam``, with a knee where each layer reaches its cap, at
    ``(cap - base) / w_l``; the knees sorted, the fill at each is a cumulative sum, and ``lam``
    solves the segment where the fill crosses ``total``. About 100 ATen ops a call, against ~1,100 for
    the bisection (:func:`waterfill_reference`, which it equals to float64 rounding: tested); the
    cascade calls it at every stage."""
    w, base, cap_, total, reach = _prepare(weights, base, cap, total)
    n = w.shape[1]
    start = torch.minimum(base, cap_)  # (B, 1): every layer's fill at lam = 0
    knee = torch.where(w > 0, (cap_ - start) / w.clamp(min=1e-300), torch.full_like(w, float("inf")))
    knees, order = knee.sort(1)  # (B, n): zero-weight layers (never capped) last
    ws = w.gather(1, order)
    # (B, n): weight of the layers past each knee, summed from the end (no subtraction: a weight
    # of 1e-16 beside 1 must survive)
    later = torch.cat([ws[:, 1:].flip(1).cumsum(1).flip(1), torch.zeros_like(ws[:, :1])], 1)
    k = torch.arange(1, n + 1, device=w.device, dtype=torch.float64)
    finite = torch.isfinite(knees)
    reached = torch.where(finite, knees, 0.0)  # the knees of layers that can reach their cap
    # the fill at each knee: the first k layers capped, the others at start + knee * w
    fill = torch.where(finite, k * cap_ + (n - k) * start + reached * later, float("inf"))
    seg = (fill < total[:, None]).sum(1, keepdim=True)  # (B, 1): knees passed before the fill crosses
    capped = seg.double()  # layers capped on the crossing segment
    slope = torch.cat([ws.sum(1, keepdim=True), later], 1).gather(1, seg)  # weight still growing there
    lam = (total[:, None] - capped * cap_ - (n - capped) * start) / slope.clamp(min=1e-300)
    last = reached.amax(1, keepdim=True)
    lam = torch.where(total[:, None] >= reach[:, None], last, lam)  # all it can reach is filled
    x = torch.minimum(cap_, start + lam.clamp(min=0) * w)
    return _finish(x, w, base, cap_, total)


def waterfill_reference(
    weights: torch.Tensor, base: torch.Tensor, cap: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """:func:`waterfill` by bisection on ``lam`` (float64, 100 halvings after doubling an upper
    bound): the reference the closed form is tested against (about 1,100 ATen ops a call)."""
    w, base, cap_, total, reach = _prepare(weights, base, cap, total)
    hi = torch.full_like(total, 1.0)
    for _ in range(200):  # grow each sequence's hi until it over-fills (or all it can reach is filled)
        filled = torch.minimum(cap_, base + hi[:, None] * w).sum(1)
        done = (filled >= total) | (filled >= reach)
        if bool(done.all()):
            break
        hi = torch.where(done, hi, hi * 2)  # per sequence: a shared hi would coarsen the others' bisection
    lo = torch.zeros_like(total)
    for _ in range(100):
        mid = (lo + hi) / 2
        filled = torch.minimum(cap_, base + mid[:, None] * w).sum(1)
        over = filled > total
        hi = torch.where(over, mid, hi)
        lo = torch.where(over, lo, mid)
    return _finish(torch.minimum(cap_, base + lo[:, None] * w), w, base, cap_, total)


def round_exact(x: torch.Tensor, cap: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Largest-remainder rounding of ``x`` (B, n) to integers summing to ``min(total, n*cap)``.

    Never exceeds ``cap``; every entry is ``floor(x)`` or ``floor(x) + 1``.
    """
    cap_ = cap[:, None]
    target = torch.minimum(total, cap * x.shape[1])
    fl = torch.clamp(torch.floor(x + 1e-9).long(), max=cap_)
    need = target - fl.sum(1)  # (B,) usually in [0, n)
    frac = torch.where(fl < cap_, x - fl.double(), torch.full_like(x, -1.0))
    order = torch.argsort(frac, dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(x.shape[1], device=x.device).expand_as(order).contiguous())
    add = (ranks < need[:, None]) & (fl < cap_)
    out = fl + add.long()
    # Rare float slack: shave or pad one entry at a time so the sum is exact.
    diff = target - out.sum(1)
    if bool((diff != 0).any()):
        for b in torch.nonzero(diff).flatten().tolist():
            d = int(diff[b])
            step = 1 if d > 0 else -1
            for i in (torch.argsort(x[b] - out[b].double(), descending=(d > 0)).tolist() * 2)[: abs(d) * 4]:
                if d == 0:
                    break
                if 0 <= out[b, i] + step <= int(cap[b]):
                    out[b, i] += step
                    d -= step
    return out


def round_up(x: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Ceil rounding for the intermediate stages of a cascade: never below the real share, so
    budgets only shrink from one stage to the next (CAKE Proposition 1 survives rounding)."""
    return torch.minimum(torch.ceil(x - 1e-6).long(), cap[:, None])
