"""Kept entries stored in 8 bits (``kv_dtype="fp8"``): the bytes of each kept entry halved again.

Compression keeps fewer entries; this stores each kept entry's key and value in float8 (e4m3fn,
the format of vLLM's ``kv_cache_dtype="fp8"``): 1 byte per element, where the model's dtype takes
2 (bfloat16, float16) or 4 (float32). The attention reads them back in the model's dtype.

* **When.** At the end of the prompt (after its last stage: the cascade is unchanged and computes
  in the model's dtype, its peak included), every compressed layer's kept keys and values are
  encoded; each later token's entry is encoded as it is written.
* **Scale.** One per layer for its keys and one for its values, from the prompt's kept entries:
  a power of two that maps their largest magnitude into (112, 224], at most half of e4m3's largest
  value (448), so later entries at least twice as large fit exactly as well; larger ones saturate
  (torch's conversion clamps to 448). Within the range, e4m3 keeps 3 mantissa bits: a relative
  error of at most 1/16 per element. Dividing or multiplying by a power of two is exact (short of
  overflow and subnormals), so moving the scale onto the query and the output (``folded``) rounds
  nothing.
  On a tensor-parallel model the largest magnitude is taken over every rank's heads, so each rank
  stores its heads exactly as one process holding them all would.
* **The recent entries exact.** The entries of the last ``kv_recent`` tokens (a cache's option;
  ``RECENT`` = 32 by default, 0: none) are held a second time in the model's dtype, and the
  attention reads those instead of their float8 bits: the tokens about to be generated attend
  most to the ones just before them, where float8's error costs most (``scripts/fp8_recent.py``:
  keeping the last 32 exact cut the KL to the model's dtype to a third). They are looked up by
  token position (a ring of ``kv_recent`` slots per KV head), so no eviction, re-layout or
  reorder has to keep track of where they are stored; an evicted entry's copy is simply never
  read. With every token in the ring, float8 storage decodes exactly as the model's dtype.
  Follow-ups of different lengths in one left-padded batch: each row's ring ends up as its
  follow-up alone leaves it (:func:`settle_recent`).
* **Layout.** The bits are held as ``torch.uint8`` (the same bytes). Every op that moves entries
  (appends, evictions, beam reorders, saving) then runs on any device: some of them
  (``index_copy_``, ``scatter_``, ``gather``, ``masked_fill``) have no float8 kernel on a CPU.
  The kvcake attention converts what it reads to the model's dtype just before its kernel (a
  transient copy of one layer at a time) and applies the scales to the new token's rows instead
  (``folded``); a layer read by the model's own kernel (nothing evicted) gets its entries
  decoded whole (``readable``).
* **Which layers.** The compressed ones, latent ones (MLA, ``kvcake.latent``) included: their keys
  ``[c; k_rot]`` under the key scale, their values ``c`` (a view of the keys) read with it too.
  Sliding-window layers (Gemma 3) and cross-attention layers (Mllama) keep the model's dtype:
  never compressed, bounded by their window or by the image.
"""

from __future__ import annotations

import functools

import torch

from .budget import spell
from .defaults import KV_FORMATS

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: encode clamps to +-FP8_MAX, scales_of fits the prompt under it
HEADROOM = 2.0  # the prompt's largest magnitude maps to at most 448 / HEADROOM (a power-of-two scale)
# Tokens whose entries are also held in the model's dtype: the attention reads them exactly
# (default model, bfloat16, every entry of 2,048-token passages kept: KL 0.0113 with none, 0.0103,
# 0.0041, 0.0022 with 8, 32, 128 exact; ``scripts/fp8_recent.py``, 2026-11-29). 32 is where most of
# the gain is: 32 bfloat16 entries are the bytes of 64 in float8.
RECENT = 32
# a layer's rings: keys, values (B, H_kv, RECENT, d) and the token of each slot (B, H_kv, RECENT)
RECENT_TENSORS = ("recent_keys", "recent_values", "recent_positions")


SUFFIX = "+fp8"  # a method name ending so, in the benches and the evaluation: stored in float8


def storage_spec(name: str) -> tuple[str, str | None]:
    """(method spec, ``kv_dtype``) of a bench or evaluation method name: ``snapkv+fp8`` is SnapKV with
    its kept entries in float8, ``snapkv`` SnapKV in the model's dtype."""
    return (name.removesuffix(SUFFIX), "fp8") if name.endswith(SUFFIX) else (name, None)


def check_kv_dtype(kv_dtype, model: torch.nn.Module | None = None) -> str | None:
    """``kv_dtype`` as kvcake names it: None (the model's dtype) or ``"fp8"``; also taken:
    ``torch.float8_e4m3fn`` and its name. Anything else is refused naming the choices, and so is
    float8 for a ``model`` on a device whose torch backend cannot convert to it (MPS: pytorch#148420)."""
    if kv_dtype is None or kv_dtype in KV_FORMATS:
        name = kv_dtype
    elif kv_dtype is FP8 or kv_dtype in ("float8_e4m3fn", "torch.float8_e4m3fn"):
        name = "fp8"
    else:
        raise ValueError(
            f"kv_dtype must be None (keep the model's dtype) or 'fp8' (float8 e4m3, one byte per element), "
            f"got {kv_dtype!r}"
        )
    if name is not None and model is not None:
        check_devices({p.device for p in model.parameters()})
    return name


def check_kv_recent(kv_recent, kv_dtype, positions: int | None = None, names=None) -> int | None:
    """``kv_recent`` as the cache keeps it: None (``RECENT`` tokens, with float8 storage) or a count
    of tokens >= 0 (0: no ring). Refused, naming the fix in the caller's words (``budget.spell``),
    where it is not a count, without ``kv_dtype`` (in the model's dtype every entry is exact), or
    past the model's ``positions`` (its rings of ``kv_recent`` slots are allocated whole)."""
    if kv_recent is None:
        return None
    recent, fp8 = spell("kv_recent", names=names), spell("kv_dtype", "fp8", names)
    if isinstance(kv_recent, bool) or not isinstance(kv_recent, int) or kv_recent < 0:
        raise ValueError(
            f"{recent} must be a count of tokens >= 0 (0: no ring; default {RECENT}), got {kv_recent!r}"
        )
    if kv_dtype is None:
        raise ValueError(f"{recent} is how many recent tokens float8 storage also holds in the model's "
                         f"dtype: pass {fp8} with it, or drop {recent} (without float8 all is exact)")  # fmt: skip
    if positions is not None and kv_recent > positions:
        raise ValueError(
            f"kv_recent={kv_recent} is more tokens than the model has positions ({positions}); its rings "
            f"are allocated whole: kv_recent={positions} already holds every token exactly"
        )
    return kv_recent


def check_devices(devices) -> None:
    """Refuse float8 storage on a device whose torch backend cannot convert to float8 (ValueError
    naming the device, torch's reason and the fix)."""
    for device in sorted({str(d) for d in devices} - {"meta"}):
        problem = _conversion_problem(device)
        if problem is not None:
            raise ValueError(
                f"kv_dtype='fp8' stores the kept entries in float8, which torch {torch.__version__} cannot "
                f"convert to on {device} ({problem}): leave kv_dtype unset there (the model's dtype), or run "
                "the model on CUDA or the CPU"
            )


@functools.cache
def _conversion_problem(device: str) -> str | None:
    """Why a tensor on ``device`` cannot be converted to float8 and back, or None (tried once per device)."""
    try:
        torch.zeros(1, device=device).to(FP8).to(torch.float32)
    except (TypeError, RuntimeError, NotImplementedError) as exc:
        return " ".join(str(exc).split())
    return None


def scales_of(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, split=None):
    """(key scale, value scale), 0-d in ``dtype``: each the power of two that maps its tensor's
    largest magnitude into (224, 448] / HEADROOM (1 for zeros; at least ``dtype``'s smallest normal,
    which float16 would otherwise round to 0 below magnitudes of 1e-5). With a ``HeadSplit``, the largest
    over every rank's tensors (one all-gather of the two magnitudes; the same scales on every rank)."""
    amax = torch.stack([_amax(keys), _amax(values)]).float()
    if split is not None:
        amax = split.gather(amax).amax(0)
    fitted = torch.exp2(torch.ceil(torch.log2(amax * HEADROOM / FP8_MAX))).clamp(min=torch.finfo(dtype).tiny)
    scales = torch.where(amax > 0, fitted, torch.ones_like(amax)).to(dtype)
    return scales[0], scales[1]


def _amax(t: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``t`` (0 where it is empty: a latent layer's zero-width values)."""
    return t.detach().abs().amax() if t.numel() else t.new_zeros(())


def encode(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float8 bits (``torch.uint8``, same shape) of ``t / scale``, clamped to +-448 (torch 2.7.1's
    cast made an overflow NaN, bits 0x7F, which 2.13's saturates): a later entry past the range saturates."""
    return (t.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def decode(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``bits`` (uint8 from :func:`encode`) back in ``scale``'s dtype: float8 value times scale."""
    return bits.view(FP8).to(scale.dtype) * scale


def store(cache) -> None:
    """Store a prefilled cache's kept entries in float8 from now on: what ``kv_dtype="fp8"`` does at
    the end of the prompt (the prompt compresses alike either way), for a cache compressed without
    it (the evaluation replays one recorded prefill into every method's cache, then stores)."""
    if not cache.prefilled:
        raise ValueError("store() takes a cache whose prompt was compressed (kv_dtype='fp8' does it then)")
    check_devices(
        cache.layers[lid].keys.device for lid in cache.compressed if cache.layers[lid].keys is not None
    )
    cache.compact()  # the dynamic layout, which encode_layer takes; static layers return at their next step
    cache.kv_dtype = "fp8"
    for lid in cache.compressed:
        encode_layer(cache.layers[lid], cache.split, cache.kv_recent)
        cache._track_bytes(lid)


def encode_layer(layer, split=None, recent: int | None = None) -> None:
    """Store a compressed layer's kept keys and values in float8 from now on (``layer.kv_scales``
    (key scale, value scale) set; its appends are encoded by ``writable``), the last ``recent``
    tokens' entries also exactly (``remember``; None: ``RECENT``; 0: none). ``split``: the cache's
    ``HeadSplit`` on a tensor-parallel model (the scales are taken over every rank), else None."""
    if layer.kv_scales is not None or layer.keys is None:
        return
    if layer.static is not None:
        raise RuntimeError(
            "encode_layer expects the dynamic layout (the end of the prompt, before static storage)"
        )
    scales = scales_of(layer.keys, layer.values, layer.dtype, split)
    layer.kv_scales = scales
    recent = RECENT if recent is None else recent
    if recent > 0:  # (0: no ring, every entry read in float8)
        _start_rings(layer, recent)
    layer.keys, layer.values = encode(layer.keys, scales[0]), encode(layer.values, scales[1])


def _start_rings(layer, recent: int) -> None:
    """Rings of ``recent`` slots for a layer about to be encoded, holding its last tokens' entries."""
    ring, dev = (layer.batch, layer.kv_heads, recent), layer.keys.device  # position -1: an empty slot
    hold_recent(layer, torch.zeros(*ring, layer.keys.shape[-1], dtype=layer.dtype, device=dev),
                torch.zeros(*ring, layer.values.shape[-1], dtype=layer.dtype, device=dev),
                torch.full(ring, -1, device=dev))  # fmt: skip
    remember(layer, layer.keys, layer.values, layer.positions, ring_base(layer))


def hold_recent(layer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
    """Give ``layer`` its rings of recent entries: ``keys``, ``values`` (B, H_kv, RECENT, d) unscaled in
    the model's dtype, ``positions`` (B, H_kv, RECENT) the token of each slot (-1: none)."""
    layer.recent_keys, layer.recent_values, layer.recent_positions = keys, values, positions
    b, h = positions.shape[:2]
    ring = positions.shape[-1]  # RECENT when the ring was made
    layer.recent_base = torch.arange(b * h, device=positions.device).reshape(b, h, 1) * ring  # (B, H_kv, 1)


def ring_base(layer, segments: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where the ring of each entry's KV head starts in the flat rings (B * H_kv * RECENT), to add to
    the entries' slots (:func:`_ring`): for entries of the KV heads ``segments`` (``b * H_kv + h``,
    any shape); without them, the layer's own entries: a dense layout's (B, H_kv, N) by
    ``layer.recent_base`` (B, H_kv, 1), a dynamic ragged layout's (T,) by its ``meta.seg``. None
    without float8 storage."""
    if layer.recent_base is None:
        return None
    if segments is None and layer.layout == "ragged" and layer.static is None:
        segments = layer.meta.seg
    return layer.recent_base if segments is None else segments * layer.recent_positions.shape[-1]


def _ring(layer, positions: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """Flat indices into the rings of entries at ``positions`` whose rings start at ``base``
    (:func:`ring_base`; broadcast to ``positions``; None: ``layer.recent_base``). An empty slot
    (position -1) reads its ring's last slot: a match there is masked by the attention anyway."""
    base = layer.recent_base if base is None else base
    return base + positions.remainder(layer.recent_positions.shape[-1])


def remember(layer, keys, values, positions, base=None, *, appended: bool = False) -> None:
    """Hold the entries of the last tokens the rings have room for among ``keys``, ``values`` (the
    model's dtype, (..., d)) at ``positions`` (...,) exactly. Where the layout's shape changes (the
    prompt, multi-token appends); a decode step writes its token with :func:`remember_step`.
    ``appended``: several tokens appended to a prefilled layer, whose rings as they were are kept until the
    append's attention (:func:`take_before`): where some rows are padded, the pads' entries overwrote
    earlier tokens that each row alone still holds (:func:`settle_recent`)."""
    if layer.recent_keys is None:
        return
    if appended and not torch.compiler.is_compiling():
        layer.recent_before = tuple(getattr(layer, name).clone() for name in RECENT_TENSORS)
    _put_latest(layer, keys, values, positions, base, _put)


def remember_step(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A static decode step's token (keys, values (B, H_kv, 1, d), the model's dtype, at
    ``layer.newest``) into its ring slot, in place: no host read."""
    if layer.recent_keys is not None:
        _put(layer, _ring(layer, layer.newest, None), keys, values, layer.newest)


def _put(layer, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
    """Write entries (the model's dtype, (..., d)) and their ``positions`` into the flat ring slots
    ``at`` (...,), unscaled as ``folded`` reads them (the scale is a power of two: exact)."""
    key_scale, value_scale = layer.kv_scales
    _put_held(layer, at, keys / key_scale, values / value_scale, positions)


def _put_held(
    layer, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> None:
    """:func:`_put` of entries already unscaled, as the rings hold them."""
    layer.recent_keys.view(_slots(layer), -1).index_put_((at,), keys)
    layer.recent_values.view(_slots(layer), -1).index_put_((at,), values)
    layer.recent_positions.view(-1).index_put_((at,), positions)


def _put_latest(layer, keys, values, positions, base, put) -> None:
    """``put`` (:func:`_put`, or :func:`_put_held` for entries unscaled already) the entries among
    ``keys``, ``values`` (..., d) at ``positions`` (...,; -1: none) of the last tokens the rings have
    room for, so that no two share a slot. A host sync (boolean indexing): never in a decode step."""
    latest = (positions >= 0) & (positions >= layer.length - layer.recent_positions.shape[-1])
    at = _ring(layer, positions, base)[latest]  # (M,)
    put(layer, at, keys[latest], values[latest], positions[latest])


def _slots(layer) -> int:
    """Slots of every ring of ``layer`` together (the rows of its flat rings; by count, since a latent
    layer's values are zero wide)."""
    return layer.recent_positions.numel()


def take_before(layer) -> tuple[torch.Tensor, ...] | None:
    """The rings as they were before the append now attended (:func:`remember`), let go by the layer."""
    before, layer.recent_before = layer.recent_before, None
    return before


def settle_recent(layer, before, valid: torch.Tensor, pads: torch.Tensor) -> None:
    """The rings of a layer whose padded append ``kvcake.sequences.settle_padding`` just settled, as
    each row alone holds them: its earlier tokens (from ``before``, the rings before the append,
    :func:`take_before`) ``pads`` (B,) positions later as its entries moved, its appended tokens at
    their own positions, its pads (``valid`` (B, q) False) nowhere; of these, the ring's last tokens.
    Written in place (a compiled step may hold the rings' addresses)."""
    if layer.recent_keys is None or before is None:
        return
    b, q = valid.shape
    rings = [getattr(layer, name) for name in RECENT_TENSORS]
    held_at = rings[2]  # (B, H_kv, RECENT) positions
    start = layer.length - q  # the append's first position
    column = (held_at - start).clamp(0, q - 1).view(b, -1)  # (B, H_kv * RECENT): an appended token's
    real = valid.to(held_at.device).gather(1, column).view_as(held_at)
    earlier = torch.where(before[2] >= 0, before[2] + pads.to(held_at.device).view(b, 1, 1), -1)
    appended = torch.where((held_at >= start) & real, held_at, -1)
    parts = [(*before[:2], earlier), (*(t.clone() for t in rings[:2]), appended)]  # (rewritten below)
    rings[2].fill_(-1)
    for keys, values, positions in parts:
        _put_latest(layer, keys, values, positions, None, _put_held)


def exact_recent(layer, keys, values, positions, base=None):
    """``keys``, ``values`` (..., d), float8 read back unscaled, with the entries of the tokens
    held exactly (``remember``) in their place: matched by position (an evicted or overwritten
    token's copy is not matched). ``positions``, ``base``: as :func:`_ring`."""
    if layer.recent_keys is None:
        return keys, values
    at = _ring(layer, positions, base)
    held = (layer.recent_positions.view(-1)[at] == positions).unsqueeze(-1)  # (..., 1)
    exact_keys = layer.recent_keys.view(_slots(layer), -1)[at]
    exact_values = layer.recent_values.view(_slots(layer), -1)[at]
    return torch.where(held, exact_keys, keys), torch.where(held, exact_values, values)


def select_recent(layer, rows: torch.Tensor) -> None:
    """Beam search and batch changes: the recent entries follow their sequences ``rows`` (B',),
    in place where the batch keeps its size (a compiled step holds their addresses)."""
    if layer.recent_keys is None:
        return
    rings = [getattr(layer, name) for name in RECENT_TENSORS]
    picked = [t.index_select(0, rows.to(t.device)) for t in rings]
    if picked[0].shape == rings[0].shape:
        for t, p in zip(rings, picked, strict=True):
            t.copy_(p)
    else:
        hold_recent(layer, *picked)


def ring_length(cache) -> int:
    """Tokens whose entries a cache's compressed layers also hold in the model's dtype (0: none)."""
    rings = [cache.layers[lid].recent_positions for lid in cache.compressed]
    return max((r.shape[-1] for r in rings if r is not None), default=0)


def recent_bytes(layer) -> int:
    """Bytes of the recent entries held exactly (0 without float8 storage)."""
    if layer.recent_keys is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (layer.recent_keys, layer.recent_values))


def readable(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s stored keys and values in the model's dtype (decoded whole where in float8;
    a dense layout's, as a layer read by the model's own kernel holds them)."""
    if layer.kv_scales is None:
        return layer.keys, layer.values
    keys, values = _unscaled(layer, layer.keys, layer.values, layer.positions, None)
    return keys * layer.kv_scales[0], values * layer.kv_scales[1]


def folded(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions, base=None):
    """The attention's inputs over stored (or gathered) entries, float8 read back without its
    scales: ``(query, keys, values, value_scale)``. The key scale moves to the query (``q . (s k) =
    (s q) . k``) and the value scale to the output (returned; None: nothing to apply), so a step
    converts each buffer once and multiplies only the new token's rows. ``positions`` (and
    ``base``, see :func:`_ring`) of the entries: the recent ones are read exactly."""
    if layer.kv_scales is None:
        return query, keys, values, None
    if layer.latent:  # the values are c, the keys' first columns: read (and scaled) as the keys are
        keys, _ = _unscaled(layer, keys, keys[..., :0], positions, base)
        return query * layer.kv_scales[0], keys, keys[..., : values.shape[-1]], layer.kv_scales[0]
    keys, values = _unscaled(layer, keys, values, positions, base)
    return query * layer.kv_scales[0], keys, values, layer.kv_scales[1]


def _unscaled(layer, keys: torch.Tensor, values: torch.Tensor, positions, base):
    """Stored (or gathered) float8 bits in the model's dtype without their scales, the recent
    entries exact in their place (:func:`exact_recent`)."""
    return exact_recent(
        layer, keys.view(FP8).to(layer.dtype), values.view(FP8).to(layer.dtype), positions, base
    )


def scaled(out: torch.Tensor, value_scale: torch.Tensor | None) -> torch.Tensor:
    """An attention output over ``folded`` values, their scale applied (None: as it is)."""
    return out if value_scale is None else out * value_scale


def writable(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New entries (the model's dtype) as ``layer`` stores them."""
    if layer.kv_scales is None:
        return keys, values
    return encode(keys, layer.kv_scales[0]), encode(values, layer.kv_scales[1])
