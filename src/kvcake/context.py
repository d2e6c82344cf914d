"""A compressed context: the prompt's compressed cache, answering many follow-ups unchanged.

It sits below both the API (``compress`` makes one) and storage (``load_context`` rebuilds one)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .adapters import with_cache
from .attention import enable
from .cache import KVCakeCache


@dataclass
class CompressedContext:
    """A compressed prompt that can answer many follow-ups without being changed by them.

    Attributes: ``cache`` (the compressed KVCakeCache), ``input_ids`` (B, S) the context's ids,
    ``attention_mask`` (B, S), ``logits`` (B, vocab) of the context's last token.
    """

    model: torch.nn.Module = field(repr=False)
    cache: KVCakeCache
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor

    def fork(self) -> KVCakeCache:
        """A private copy of the compressed cache, to extend without touching this context."""
        return copy.deepcopy(self.cache)

    def _extend_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.dim() == 1:
            ids = ids[None]
        if ids.shape[0] != self.input_ids.shape[0]:
            raise ValueError(f"follow-up batch {ids.shape[0]} != context batch {self.input_ids.shape[0]}")
        full = torch.cat([self.input_ids, ids.to(self.input_ids.device)], dim=1)
        mask = torch.cat([self.attention_mask, torch.ones_like(ids, dtype=self.attention_mask.dtype)], dim=1)
        return full, mask

    def generate(self, question_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """Append ``question_ids`` (B, q) to a fork of the context and generate; returns only the
        new tokens (B, n)."""
        full, mask = self._extend_inputs(question_ids)
        cache = self.fork()
        with enable(self.model), torch.no_grad():
            out = self.model.generate(
                full, attention_mask=mask, **with_cache(self.model, cache), **generate_kwargs
            )
        return out[:, full.shape[1] :]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, q, vocab) of ``ids`` appended to a fork of the context (teacher forcing)."""
        full, mask = self._extend_inputs(ids)
        cache = self.fork()
        with enable(self.model), torch.no_grad():
            out = self.model(
                ids if ids.dim() == 2 else ids[None], attention_mask=mask, **with_cache(self.model, cache)
            )
        return out.logits

    def save(self, path) -> None:
        from .storage.writer import save_context  # the writer does not import this module

        save_context(self, path)
