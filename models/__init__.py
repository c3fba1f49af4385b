"""Model registry: ``build_model(cfg.model, vocab_size, max_len, rngs)`` picks a model by ``kind``."""

from __future__ import annotations

from typing import Callable

from flax import nnx

from configs.schema import ModelConfig
from models.dense import DecoderLM, count_params, flops_per_token, loss_fn

MODELS: dict[str, Callable[..., nnx.Module]] = {"dense": DecoderLM}


def build_model(cfg: ModelConfig, vocab_size: int, max_len: int, rngs: nnx.Rngs) -> nnx.Module:
    """Instantiate the model named by ``cfg.kind``. Raises ``ValueError`` for an unknown kind."""
    if cfg.kind not in MODELS:
        raise ValueError(f"model.kind {cfg.kind!r} is unknown; choose one of {sorted(MODELS)}")
    return MODELS[cfg.kind](cfg, vocab_size, max_len, rngs)


__all__ = ["MODELS", "build_model", "count_params", "flops_per_token", "loss_fn", "DecoderLM"]
