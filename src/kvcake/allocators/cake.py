"""CAKE's preference-prioritized adaptive allocation (P2A) and cascading management.

Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences",
ICLR 2025, https://arxiv.org/abs/2503.12491 (Sections 4.1-4.2, Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_real
from .base import AllocationRequest, LayerAllocator, round_exact, round_up, waterfill

# tau1/tau2 from the authors' code, per model family and budget (128L, 1024L).
TAU_DEFAULTS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "llama": ((1.6, 0.6), (1.6, 0.4)),
    "mistral": ((1.0, 0.8), (0.8, 0.5)),
    "qwen2": ((0.4, 0.6), (1.5, 0.6)),
    "llama2": ((0.9, 2.3), (1.9, 1.8)),
}
FALLBACK_TAU = (2.0, 3.0)
"""For a model with no calibration and no family entry (``kvcake.temperatures``): the flattest
corner of the paper's ranges (tau1 <= 2, tau2 <= 3), so the allocation stays close to uniform
and no layer is starved; measured on SmolLM2 in docs/results.md."""


TAU_FROM = ("auto", "family", "fallback")


# Llama 2 and Llama 3 checkpoints both say model_type "llama"; Llama 2's config has a 32000-token
# vocabulary and RoPE base 10000 (Llama 3: 128256 and 500000), as transformers' LlamaConfig defaults.
LLAMA2_SHAPE = {"vocab_size": 32000, "rope_theta": 10000.0}


def tau_family(model) -> str:
    """The model type ``TAU_DEFAULTS`` is looked up by: the text config's ``model_type``, but
    ``"llama2"`` for a Llama whose config has Llama 2's vocabulary and RoPE base (without it the
    paper's Llama-2 temperatures could never be chosen: Llama 2 says ``"llama"``)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", "") or ""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    shape = {"vocab_size": getattr(config, "vocab_size", None), "rope_theta": theta}
    return "llama2" if model_type == "llama" and shape == LLAMA2_SHAPE else model_type


def family_key(model_type: str) -> str | None:
    """The ``TAU_DEFAULTS`` entry of a model type, or ``None`` when the family has none."""
    key = "qwen2" if model_type in ("qwen2", "qwen3") else model_type
    return key if key in TAU_DEFAULTS else None


def default_tau(model_type: str, avg_budget: float) -> tuple[float, float]:
    """tau for a model family: the 128L setting below 512 entries per layer, else the 1024L one.
    Unknown families get :data:`FALLBACK_TAU`. Used only when the model has no calibration
    (``kvcake.temperatures.resolve_tau``): these values do not transfer across models."""
    key = family_key(model_type)
    if key is None:
        return FALLBACK_TAU
    small, large = TAU_DEFAULTS[key]
    return small if avg_budget < 512 else large


def preference(entropy: torch.Tensor, variance: torch.Tensor, tau1: float, tau2: float) -> torch.Tensor:
    """``P_l = H_l^(1/tau1) * V_l^(1/tau2)`` (CAKE Eq. 7), in float64 to keep tiny variances."""
    return entropy.double().clamp(min=0) ** (1.0 / tau1) * variance.double().clamp(min=0) ** (1.0 / tau2)


@dataclass(frozen=True)
class CakeAllocator(LayerAllocator):
    """Layer budgets proportional to each layer's preference ``P_l``.

    Every layer keeps its window; the pool ``B_total - n * Sw`` is shared in proportion to
    ``P_l`` (water-filling so no layer exceeds its prompt length), then rounded to integers that
    sum exactly to the total. With ``cascading=True`` the cache calls this after each layer's
    prefill with the preferences seen so far (Eq. 9) and evicts every layer seen so far to its
    new budget; intermediate stages round up so a budget never grows between stages.

    Parameters
    ----------
    tau1, tau2:
        Temperatures of the spatial dispersion and temporal shift; ``None`` lets the cache pick
        them: the model's calibration, else its family's default, else a flat fallback
        (``kvcake.temperatures.resolve_tau``).
    tau_from:
        Where ``None`` temperatures come from: ``"auto"`` (calibration, else family, else
        fallback), or ``"family"`` / ``"fallback"`` to force that step (ablations, e.g.
        ``cake,layers.tau_from=family``).
    cascading:
        Manage memory stage by stage during prefill (Algorithm 1). ``False`` keeps every full
        layer until the end and evicts once (the paper's comparison point).
    """

    tau1: float | None = None
    tau2: float | None = None
    cascading: bool = True
    tau_from: str = "auto"
    name = "cake"
    needs_preferences = True

    def __post_init__(self) -> None:
        if not isinstance(self.cascading, bool):  # a typo like cascading=flase must not read as True
            raise ValueError(f"CAKE cascading must be true or false, got {self.cascading!r}")
        if self.tau_from not in TAU_FROM:
            raise ValueError(f"CAKE tau_from must be one of {TAU_FROM}, got {self.tau_from!r}")
        for name, t in (("tau1", self.tau1), ("tau2", self.tau2)):
            if t is not None:
                check_real(f"CAKE {name}", t, f"layers.{name}=1.0", above=True)

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        if req.preferences is None:
            raise ValueError("the CAKE allocator needs layer preferences")
        x = waterfill(req.preferences, req.window, req.cap, req.total)
        return round_exact(x, req.cap, req.total) if req.final else round_up(x, req.cap)
