"""Token weights and merge rules for outer gradients.

Sources (Douillard et al., "Decoupled DiLoCo", arXiv 2604.21428, the syncer merge): token-weighted merging
w_m = c_tokens · (c_tokens / c_steps) ("quantity × quality"), and Radial-Directional Averaging
RDA = (Σ w‖v‖ / Σ w) · φ(Σ w φ(v) / Σ w), φ(x) = x/‖x‖, φ(0) = 0, per tensor, with embedding
tensors merged by the plain weighted average.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

Tensors = Mapping[str, np.ndarray]


def token_weights(tokens: Sequence[float], steps: Sequence[float]) -> np.ndarray:
    """Normalised token weights w_m = tokens_m² / steps_m, divided by Σ w.

    Args:
        tokens: tokens each learner processed since it last received the fragment (≥ 0).
        steps: inner steps for the same span (> 0 where tokens > 0).

    Returns:
        float64 array of shape [M] summing to 1. If every raw weight is 0, equal weights.

    Raises:
        ValueError: on mismatched lengths, negative tokens, or tokens > 0 with steps ≤ 0.
    """
    t = np.asarray(tokens, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    if t.shape != s.shape or t.ndim != 1 or t.size == 0:
        raise ValueError("tokens and steps must be non-empty 1-D sequences of the same length")
    if np.any(t < 0) or np.any((t > 0) & (s <= 0)):
        raise ValueError("tokens must be ≥ 0 and steps > 0 wherever tokens > 0")
    raw = np.where(t > 0, t * t / np.where(s > 0, s, 1.0), 0.0)
    total = raw.sum()
    if total <= 0:
        return np.full(t.shape, 1.0 / t.size)
    return raw / total


def _weighted_mean(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    out = np.zeros_like(deltas[0], dtype=np.float32)
    for w, d in zip(weights, deltas):
        out += np.float32(w) * d
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(x))
    return x / norm if norm > 0 else np.zeros_like(x)


def rda(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Radial-Directional Average of one tensor's outer gradients.

    (Σ w‖v‖ / Σ w) · φ(Σ w φ(v) / Σ w): the mean norm times the unit mean direction, so the merged
    update keeps the learners' typical step size instead of shrinking when they disagree.
    ``weights`` must already be normalised (Σ w = 1).
    """
    radius = sum(float(w) * float(np.linalg.norm(d)) for w, d in zip(weights, deltas))
    direction = _unit(_weighted_mean([_unit(d) for d in deltas], weights))
    return (np.float32(radius) * direction).astype(np.float32)


def merge_mean(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Plain average (the original DiLoCo outer gradient)."""
    w = np.full(len(deltas), 1.0 / len(deltas))
    return {k: _weighted_mean([d[k] for d in deltas], w) for k in deltas[0]}


def merge_token_weighted(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Token-weighted average Σ w_m v_m with w from :func:`token_weights`."""
    w = token_weights(tokens, steps)
    return {k: _weighted_mean([d[k] for d in deltas], w) for k in deltas[0]}


def merge_rda(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Token-weighted RDA per tensor; tensors named in ``embedding_names`` use the weighted mean."""
    w = token_weights(tokens, steps)
    out = {}
    for k in deltas[0]:
        vs = [d[k] for d in deltas]
        out[k] = _weighted_mean(vs, w) if k in embedding_names else rda(vs, w)
    return out


MergeRule = Callable[..., dict[str, np.ndarray]]
MERGE_RULES: dict[str, MergeRule] = {
    "mean": merge_mean,
    "token_weighted": merge_token_weighted,
    "rda": merge_rda,
}


def weights_for(rule: str, tokens, steps) -> np.ndarray:
    """The per-learner weights a rule applies (for the merge log)."""
    if rule == "mean":
        return np.full(len(tokens), 1.0 / len(tokens))
    return token_weights(tokens, steps)
