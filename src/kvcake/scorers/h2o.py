"""H2O: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_int
from ..devices import cpu_route
from ..flex import flex_attention_with_column_sums, uses_flex
from ..matmul import half_matmuls, matmul_f32
from .base import PrefillInputs, Scorer, _expand_kv


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """Accumulated attention: the sum over all prompt queries of each key's causal attention.

    With ``fused`` (the default) the sums come out of the prompt's own attention
    (:func:`attention_with_column_sums`, used where the prompt is evicted and the model's kernel is
    SDPA), so the ``S x S`` attention is computed once, not twice; otherwise, or where the fused
    kernel does not apply, :func:`accumulated_attention` computes them after the stock kernel
    (the reference), in chunks of ``chunk`` query rows so no ``S x S`` matrix is held. While
    decoding, each new query's attention is added to the kept entries' sums (``stateful``).
    """

    chunk: int = 512
    reduce: str = "mean"
    fused: bool = True
    name = "h2o"
    stateful = True

    def __post_init__(self) -> None:
        check_int("H2O chunk", self.chunk, 1, "score.chunk=512")
        if not isinstance(self.fused, bool):
            raise ValueError(f"H2O fused must be true or false, got {self.fused!r}")

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        if inp.column_sums is not None:
            return inp.column_sums
        return accumulated_attention(inp, self.chunk)

    @property
    def scores_in_attention(self) -> bool:
        return self.fused

    def prompt_attention(self, query, key, value, mask, key_valid, scaling):
        if not self.fused or not fusable_mask(mask, query.shape[2]) or needs_grad(query, key, value):
            return None
        return attention_with_column_sums(query, key, value, mask, key_valid, scaling)

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return probs.sum(2)  # every query row adds its attention (a multi-token append: each of them)

    def decode_step(self, probs, positions, previous):
        scores = probs.mean(2) if self.reduce == "mean" else probs.amax(2)  # (B, H_kv, N)
        return scores if previous is None else scores + previous


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an attention over ``tensors``: the fused loop's ``out=`` matmuls
    cannot, so its output then comes from the stock kernel (and the sums from the reference)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def accumulated_attention(inp: PrefillInputs, chunk: int) -> torch.Tensor:
    """(B, H, S) column sums of the causal attention matrix, ``chunk`` rows at a time.

    A chunk of query rows reads only the keys before its last row (the causal columns); padding
    keys and the chunk's own upper triangle are masked with -inf, and the rows are summed
    by one matmul with the rows' validity (a padding row adds nothing; one that sees no key at
    all is 0, not NaN)."""
    k = _expand_kv(inp.keys.float(), inp.num_groups)  # (B, H, S, d)
    b, h, s, _ = k.shape
    dev = k.device
    total = torch.zeros(b, h, s, dtype=torch.float32, device=dev)
    padding = ~inp.key_valid[:, None, None, :]  # (B, 1, 1, S)
    rows = inp.key_valid.float()[:, None, None, :]  # (B, 1, 1, S)
    upper = torch.full((chunk, chunk), float("-inf"), device=dev).triu_(1)  # (c, c): later columns
    for start in range(0, s, chunk):
        stop = min(s, start + chunk)
        q = inp.query[:, :, start:stop].float()  # (B, H, c, d)
        logits = torch.matmul(q, k[:, :, :stop].transpose(-1, -2))  # (B, H, c, stop)
        logits = inp.terms.cap(logits.mul_(inp.scaling))
        logits[..., start:stop].add_(upper[: stop - start, : stop - start])
        logits.masked_fill_(padding[..., :stop], float("-inf"))  # (whatever padding keys hold)
        probs = inp.terms.softmax(logits, inp.terms.per_head())
        probs.nan_to_num_(0.0)
        total[..., :stop] += torch.matmul(rows[..., start:stop], probs).squeeze(2)  # (B, H, stop)
    return total


# Bytes of one block of logits (B, H, rows, S) in attention_with_column_sums, and its query rows.
# On the CPU the block's passes (exponentials, row sums, the values' and the column sums' matmuls)
# should find it in the last-level cache: SmolLM2-135M's shape (9 heads) on one core of an AMD EPYC
# with 32 MiB of L3 (`python scripts/h2o_block_rows.py`, medians of interleaved rounds, 2026-12-05)
# took 0.90 / 0.96 / 1.09 / 1.10 x SDPA's causal attention at 2048 / 4096 / 8192 / 16384 tokens
# with 64 / 64 / 32 / 32 rows (4.7-18.9 MB blocks) against 1.02 / 1.01 / 1.20 / 1.21 x with the 128
# / 128 / 128 / 64 rows of the 64 MiB rule before (up to 37.7 MB, over the L3), and 16 rows, the
# smallest block, 1.04-1.17 x (the matmuls narrow). So the CPU takes 32 to 64 rows, as many as fit
# 16 MiB. Inside whole prefills of 8192 tokens (`scripts/h2o_prefill_attention.py`) the 30 layers'
# loop then took 23.7 / 24.0 s against SDPA's 24.2 / 24.4 s (1.17 x with 128 rows, 2026-11-29).
# Earlier single runs on that host and an Intel Xeon had preferred 128 rows to 64 at 8192
# (0.96 against 1.04 x, 1.10-1.21 against 1.13-1.26 x; best of 5, not interleaved). On a GPU a
# block large enough to keep the matmuls wide.
BLOCK_BYTES = 16 << 20  # the CPU (kvcake.devices.cpu_route)
CPU_ROWS = (32, 64)
DEVICE_BLOCK_BYTES = 256 << 20
MIN_ROWS = 16
# Where a block's rows may be exponentiated without subtracting each row's maximum (the CPU, whose
# check costs no device synchronisation): when every row that sees a key sums to within these
# bounds. Then no exponential overflowed (every one is at most the sum), the probabilities
# normalise to SDPA's up to float32 rounding (e^x / sum e^x is e^(x-m) / sum e^(x-m)), the
# exponentials that underflow (below float32's 1.2e-38) are below 1e-18 of their row's sum (float32
# keeps 1.2e-7 of it), and the products with the values stay below 1e30 x |v|. Otherwise the block
# is computed again with the maxima subtracted, as SDPA does.
UNSHIFTED_SUMS = (1e-20, 1e30)
# The blocks' logits are in base 2 (the scale times log2(e), folded into the query or the matmul)
# and exponentiated by exp2: the same probabilities up to float32 rounding, and on the CPU exp2
# runs about three times as fast as exp (1.3 against 3.9 ms for 4.7M floats, one core of an AMD
# EPYC, 2026-11-28), which was a fifth of the loop's time there.
LOG2E = 1.4426950408889634


def block_rows(batch: int, heads: int, length: int, device: torch.device) -> int:
    """Query rows per block of :func:`attention_with_column_sums`: the largest power of two whose
    float32 logits fit the device's block size, within ``CPU_ROWS`` on the CPU and at least
    ``MIN_ROWS`` elsewhere."""
    cpu = cpu_route(device)
    rows = max(1, (BLOCK_BYTES if cpu else DEVICE_BLOCK_BYTES) // (4 * batch * heads * max(length, 1)))
    rows = 1 << (rows.bit_length() - 1)
    return min(max(rows, CPU_ROWS[0]), CPU_ROWS[1]) if cpu else max(rows, MIN_ROWS)


def fusable_mask(mask: torch.Tensor | None, length: int) -> bool:
    """Whether :func:`attention_with_column_sums` reads ``mask`` as SDPA does: None (causal) or a
    boolean ``(B, 1, S, S)`` mask (True: the query may attend)."""
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[-2:] == (length, length)
    )


def attention_with_column_sums(query, key, value, mask, key_valid, scaling, rows: int | None = None):
    """The prompt's attention and H2O's column sums from the same probabilities.

    query (B, H, S, d); key, value (B, H_kv, S, d); mask None (causal) or boolean (B, 1, S, S)
    (:func:`fusable_mask`); key_valid (B, S) bool. Returns ``(out, sums)``: ``out`` (B, S, H, d) in
    the query's dtype, SDPA's result up to float32 rounding (a query row that may attend to
    nothing gives 0, as SDPA's does), and ``sums`` (B, H, S) float32, :func:`accumulated_attention`'s
    result up to rounding (the sum over valid query rows of each key's attention).

    ``rows`` query rows at a time (default :func:`block_rows`), each block's logits written into
    one reused buffer and exponentiated in place (base 2: ``LOG2E``): on a CPU fresh buffers of
    this size cost more in page faults than the arithmetic. On the CPU a block is exponentiated
    without subtracting its rows' maxima where that is exact (``UNSHIFTED_SUMS``; else it is
    computed again, shifted): the maxima and the subtraction were two of the block's five passes
    over memory. A GQA group's heads share one matmul with their KV head.
    Where :func:`half_matmuls` holds (CUDA, bf16/fp16) the matmuls take the inputs as they are and
    write float32; elsewhere they run on float32 copies. On CUDA the two FlexAttention passes of
    :mod:`kvcake.flex` replace the blocks (no ``S x S`` block reaches memory); this loop is their
    reference and the CPU's route."""
    if uses_flex(query):
        fused = flex_attention_with_column_sums(query, key, value, mask, key_valid, scaling)
        if fused is not None:
            return fused
    b, h, s, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    dev = query.device
    rows = min(s, rows or block_rows(b, h, s, dev))
    half = half_matmuls(query)
    if half:  # unscaled: the scale is applied to the float32 products
        q, kt, v = query.reshape(b, hkv, g, s, d), key.contiguous().transpose(-1, -2), value.contiguous()
        probs_half = torch.empty(b * h * rows * s, dtype=value.dtype, device=dev)
        pv = torch.empty(b * hkv * g * rows * d, dtype=torch.float32, device=dev)
    else:
        q = (query.float() * (scaling * LOG2E)).reshape(b, hkv, g, s, d)
        kt = key.float().transpose(-1, -2)  # (B, H_kv, d, S)
        v = value.float()
    out = torch.empty(b, hkv, g, s, d, dtype=torch.float32, device=dev)
    sums = torch.zeros(b, hkv, g, 1, s, dtype=torch.float32, device=dev)
    buffer = torch.empty(b * h * rows * s, dtype=torch.float32, device=dev)
    upper = torch.full((rows, rows), float("-inf"), device=dev).triu_(1)  # later columns of a block
    hidden = torch.finfo(torch.float32).min  # masked logits: exp(hidden - max) is 0 in a row that sees a key
    weight = key_valid.float()[:, None, None, :]  # (B, 1, 1, S): padding query rows add nothing
    unshifted = cpu_route(dev)

    def block_logits(start: int, stop: int) -> torch.Tensor:  # (B, H_kv, G*n, stop), masked
        n = stop - start
        logits = buffer[: b * h * n * stop].view(b, hkv, g * n, stop)
        rows_q = q[:, :, :, start:stop].reshape(b, hkv, g * n, d)
        if half:
            matmul_f32(rows_q.reshape(b * hkv, g * n, d), kt[..., :stop].reshape(b * hkv, d, stop),
                        logits.view(b * hkv, g * n, stop), scaling * LOG2E)  # fmt: skip
        else:
            torch.matmul(rows_q, kt[..., :stop], out=logits)
        block = logits.view(b, hkv, g, n, stop)
        if mask is None:
            block[..., start:stop].add_(upper[:n, :n])
        else:
            block.masked_fill_(~mask[:, :, None, start:stop, :stop], hidden)
        return logits

    for start in range(0, s, rows):
        stop = min(s, start + rows)
        n = stop - start
        logits = block_logits(start, stop)
        scale = None
        if unshifted:  # (B, H_kv, G*n, 1): 1/sum, or None where a row's sum is out of bounds
            sees = None if mask is None else mask[:, :, None, start:stop, :stop].any(-1)  # (B, 1, 1, n)
            scale = _unshifted_exp(logits, sees, (b, hkv, g, n))
            if scale is None:  # the exponentials are in the buffer: the logits again, shifted
                logits = block_logits(start, stop)
        if scale is None:
            top = logits.amax(-1, keepdim=True)  # (B, H_kv, G*n, 1)
            total = logits.sub_(top).exp2_().sum(-1, keepdim=True)
            scale = (top > hidden).float().div_(total)  # 1/total; 0 on a row that sees nothing
        block = logits.view(b, hkv, g, n, stop)
        if half:  # the probabilities in the inputs' dtype times the values, in float32 (as flash attention)
            p = (
                probs_half[: b * h * n * stop]
                .view(b * hkv, g * n, stop)
                .copy_(logits.view(b * hkv, g * n, stop))
            )
            pv_block = matmul_f32(
                p, v[:, :, :stop].reshape(b * hkv, stop, d), pv[: b * h * n * d].view(b * hkv, g * n, d)
            )
            pv_block = pv_block.view(b, hkv, g * n, d)
        else:
            pv_block = torch.matmul(logits, v[:, :, :stop])
        out[:, :, :, start:stop] = pv_block.mul_(scale).view(b, hkv, g, n, d)
        row_weight = scale.view(b, hkv, g, 1, n) * weight[..., start:stop].unsqueeze(2)
        sums[..., :stop] += torch.matmul(row_weight, block)  # (B, H_kv, G, 1, stop)
    return out.view(b, h, s, d).transpose(1, 2).contiguous().to(query.dtype), sums.view(b, h, s)


def _unshifted_exp(logits: torch.Tensor, sees: torch.Tensor | None, shape) -> torch.Tensor | None:
    """Exponentiate a block's logits in place as they are and return each row's ``1 / sum`` (0 on a
    row that sees no key), or None where a row that sees a key sums outside ``UNSHIFTED_SUMS``
    (the caller then subtracts the maxima). ``sees`` (B, 1, 1, n) bool, None: every row sees one."""
    total = logits.exp2_().sum(-1, keepdim=True)  # (B, H_kv, G*n, 1)
    low, high = UNSHIFTED_SUMS
    rows = total.view(shape)  # (B, H_kv, G, n)
    small = rows < low if sees is None else (rows < low) & sees
    if bool((small | (rows > high)).any()):
        return None
    return torch.where(total > 0, total.reciprocal(), 0.0)
