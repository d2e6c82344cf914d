"""Save a compressed context to disk and load it back, bit for bit.

File format (one file, conventionally ``*.kvc``): an ordinary safetensors file. The tensors
are the cache's exact state; the JSON description lives in the safetensors metadata header
under the key ``"kvcake"``, and a SHA-256 digest of that JSON plus every tensor (name, dtype,
shape, bytes) under ``"kvcake.sha256"``, so a corrupted file is refused instead of answering
wrongly (safetensors itself checks the header's structure, not the data).

Tensors (``l`` is a layer index, ``B`` the batch, ``L`` the layers, ``H_kv`` the KV heads):

* ``context.input_ids`` / ``context.attention_mask`` (B, S), ``context.logits`` (B, vocab);
  ``context.rope_deltas`` (B, 1) where the model keeps multimodal RoPE's offset (Qwen2-VL);
  ``context.token_inputs.<name>`` (B, S, ...), the context's inputs with a row per token that its
  follow-ups extend (Mllama's ``cross_attention_mask``);
* ``layers.l.keys`` / ``layers.l.values`` of a cross-attention layer (Mllama): the image's states,
  (B, H_kv, image tokens, d), none where the prompt had no image (layout ``cross``);
* ``layers.l.keys`` / ``layers.l.values``: dense (B, H_kv, N, d) or ragged flattened (T, d);
  ``layers.l.positions`` (same layout, -1 = empty slot); ``layers.l.counts`` (B, H_kv);
  ``layers.l.lengths`` (B * H_kv,) for ragged layers; ``layers.l.scores`` when the cache keeps
  its eviction scores while decoding (H2O with the ``fixed`` policy); with float8 storage
  (``kv_dtype="fp8"``, ``kvcake.fp8``) the keys and values are its bits (uint8) and
  ``layers.l.key_scale`` / ``layers.l.value_scale`` (0-d, the model's dtype) decode them;
* ``cache.budgets`` (B, L), ``cache.decode_budget`` (B, L, H_kv), ``cache.stage_budgets.i``
  (B, i + 1) for the cascade's stages, ``cache.entropy`` / ``cache.variance`` /
  ``cache.preferences`` (L, B) for CAKE allocation, ``cache.seq.*`` (B,) the per-sequence
  budget facts (``tau1``/``tau2``, each prompt's CAKE temperatures, in CAKE's files only: a file
  without them reads back as before).

The JSON holds the format version, the library version, the model (fingerprint, type, shapes,
dtype), the method (``Method.describe()``, a composed ``spec`` string that ``make_method``
rebuilds exactly, and its budget, ratio and window), each layer's layout and logical length,
the final budgets, the storage of the kept entries (``cache.kv_storage``: null or ``"fp8"``,
and each layer's ``fp8`` flag), and a free ``extra`` dict for the caller (the CLI keeps its prompt layout
there).

Writing is atomic: the bytes go to a temporary file in the target's folder, which is fsynced
and renamed over the target with ``os.replace``; a crash leaves the old file (or none).

Modules: ``format`` (shared by both sides), ``writer`` (``save_context``), ``reader``
(``read_context_info``, ``load_context``). ``method_spec`` lives with the method (``kvcake.method``).
"""

from ..method import method_spec
from .format import FORMAT_VERSION, ContextFileError
from .reader import load_context, read_context_info
from .writer import save_context

__all__ = [
    "FORMAT_VERSION",
    "ContextFileError",
    "load_context",
    "method_spec",
    "read_context_info",
    "save_context",
]
