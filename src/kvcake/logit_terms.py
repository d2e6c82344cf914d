"""What a model's attention adds around its softmax beyond the scaled ``q . k`` products.

Two terms, as the model's attention call hands them to the attention function:

- a soft cap on the logits, ``c * tanh(x / c)`` before the mask (``softcap``: Gemma 2's
  ``attn_logit_softcapping``);
- a sink: a learned logit per query head in every row's softmax, whose probability is dropped,
  so that a row's weights sum to less than 1 and the sink has no value (``s_aux``: GPT-OSS's
  ``sinks``).

kvcake's own attention over the kept entries applies them as the model's eager kernel does. The
fused kernels (SDPA, the variable-length ones on CUDA) have neither, so where a model has one the
rows take the explicit softmax; the scorers read the probabilities the model gives its tokens.

Any other term a model hands its attention call (``UNKNOWN_TERMS``: an additive position bias,
sinks under another name, ALiBi slopes) is refused where kvcake would attend or score without it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Keyword arguments of an attention call that change its logits, which kvcake's attention over the
# kept entries and its scorers do not apply (transformers 5.24: T5's and Inkling's ``position_bias``,
# Inkling's ``sinks``; Bloom's ``alibi``, were its attention on the interface)
UNKNOWN_TERMS = {
    "position_bias": "an additive position bias",
    "sinks": "attention sinks (kvcake applies GPT-OSS's, handed over as s_aux)",
    "alibi": "ALiBi position biases",
}


class LogitTerms(NamedTuple):
    """softcap: the cap ``c`` or None; sinks: (H,) each query head's sink logit, or None."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, kwargs: dict) -> LogitTerms:
        """The terms of one attention call, from the keyword arguments the model passed it; a
        ``ValueError`` for a term kvcake does not apply (``UNKNOWN_TERMS``)."""
        for name, what in UNKNOWN_TERMS.items():
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"this model hands its attention {what} ({name}=...), which kvcake's attention over "
                    "the kept entries and its scorers do not apply, so a compressed cache would change "
                    "its outputs: run it with transformers' own cache (DynamicCache) instead"
                )
        return cls(kwargs.get("softcap"), kwargs.get("s_aux"))

    @property
    def fused(self) -> bool:
        """Whether the fused kernels compute this attention (neither term)."""
        return self.softcap is None and self.sinks is None

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The capped logits (before any mask), as the models' eager kernels compute them."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def softmax(self, logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax over the last dim of ``logits`` and each row's sink logit (``sinks``, this
        object's sinks shaped to broadcast to ``logits``' rows with a last dim of 1, e.g. by
        :meth:`grouped`), the sink's column dropped; the plain softmax where ``sinks`` is None. A
        row whose logits are all -inf gives zeros (the sink takes it whole), not NaN."""
        if sinks is None:
            return torch.softmax(logits, dim=-1)
        sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]

    def grouped(self, batch: int, kv_heads: int, q: int) -> torch.Tensor | None:
        """The sinks for a GQA group folded into the query rows: (B, H_kv, G*q, 1), rows ordered
        (g, i) as ``dense_attention`` folds them; None without sinks."""
        if self.sinks is None:
            return None
        g = self.sinks.shape[0] // kv_heads
        return (
            self.sinks.reshape(1, kv_heads, g, 1)
            .expand(batch, kv_heads, g, q)
            .reshape(batch, kv_heads, g * q, 1)
        )

    def per_head(self) -> torch.Tensor | None:
        """(1, H, 1, 1) float32: the sinks for rows of (B, H, rows, N); None without sinks."""
        return None if self.sinks is None else self.sinks.float().reshape(1, -1, 1, 1)


PLAIN = LogitTerms()


def model_terms(model: torch.nn.Module) -> str | None:
    """What ``model``'s attention adds to its softmax, in words (a soft cap: its text config's
    ``attn_logit_softcapping``; sinks: a module's ``sinks`` tensor), or None: SDPA computes
    neither, so such a model runs eager inside ``kvcake.enable`` (``kvcake.attention``)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        return f"caps its logits (attn_logit_softcapping={cap})"
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return "has attention sinks (a learned logit per head in the softmax)"
    return None
