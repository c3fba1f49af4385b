"""Token weights and merge rules for outer gradients.

Sources (Douillard et al., "Decoupled DiLoCo", arXiv 2604.21428, the syncer merge): token-weighted merging
w_m = c_tokens · (c_tokens / c_steps) ("quantity × quality"), and Radial-Directional Averaging
RDA = (Σ w‖v‖ / Σ w) · φ(Σ w φ(v) / Σ w), φ(x) = x/‖x‖, φ(0) = 0, per tensor, with embedding
tensors merged by the plain weighted average.

Numerics: every rule works in float64 and computes norms with :func:`l2_norm` (scaled by max|x|), so
finite float32 inputs never overflow on the way; the float32 result is inf wherever the true merged
value lies beyond float32's range (±3.4e38), and the syncer refuses such a merge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

Tensors = Mapping[str, np.ndarray]


def token_weights(tokens: Sequence[float], steps: Sequence[float]) -> np.ndarray:
    """Normalised token weights w_m = tokens_m² / steps_m, divided by Σ w.

    Args:
        tokens: tokens each learner processed since it last received the fragment (≥ 0), length M.
        steps: inner steps for the same span (> 0 where tokens > 0), length M.

    Returns:
        float64 array of shape [M] summing to 1; 0 where tokens == 0.

    Raises:
        ValueError: on empty or mismatched lengths, negative tokens, tokens > 0 with steps ≤ 0, or
            when every token count is 0 (no learner made progress: 0/0 has no weighting; the syncer
            never queues a zero-token submission, so a merge never gets here).
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
        raise ValueError(f"every token count is 0 ({len(t)} submissions): nothing to weight")
    return raw / total


def l2_norm(x: np.ndarray) -> float:
    """Euclidean norm of an array of any shape, as a Python float, without overflow.

    Squares are taken in float64 after dividing by max|x|, so any finite float32 or float64 input
    gives its exact-to-rounding norm (e.g. ‖[3e38, 3e38]‖ = 4.24e38, beyond float32 but a finite
    float). Returns 0.0 for an empty or all-zero array, inf or nan if ``x`` holds them.
    """
    a = np.abs(np.asarray(x, dtype=np.float64))
    if a.size == 0:
        return 0.0
    scale = float(a.max())
    if not 0.0 < scale < np.inf:  # 0, inf or nan: the norm is the same
        return scale
    return scale * float(np.sqrt(np.sum(np.square(a / scale))))


def _to_float32(x: np.ndarray) -> np.ndarray:
    """float32 copy; values beyond float32's range become ±inf (silently: the syncer checks)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32)


def _weighted_sum(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Σ w_m d_m in float64."""
    out = np.zeros(np.shape(deltas[0]), dtype=np.float64)
    term = np.empty_like(out)
    for w, d in zip(weights, deltas):
        out += np.multiply(d, float(w), out=term, dtype=np.float64)
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    """φ(x) = x/‖x‖ in float64, φ(0) = 0."""
    norm = l2_norm(x)
    x = np.asarray(x, dtype=np.float64)
    return x / norm if norm > 0 else np.zeros_like(x)


def rda(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Radial-Directional Average of one tensor's outer gradients.

    (Σ w‖v‖ / Σ w) · φ(Σ w φ(v) / Σ w): the mean norm times the unit mean direction, so the merged
    update keeps the learners' typical step size instead of shrinking when they disagree.

    Args:
        deltas: M arrays of one shape (any float dtype), the learners' outer gradients v_m.
        weights: shape [M], already normalised (Σ w = 1).

    Returns:
        float32 array of the deltas' shape; radius and direction are computed in float64, so an
        entry is ±inf only if the merged value itself exceeds float32's range.
    """
    radius = sum(float(w) * l2_norm(d) for w, d in zip(weights, deltas))
    direction = _unit(_weighted_sum([_unit(d) for d in deltas], weights))
    return _to_float32(radius * direction)


def merge_mean(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Plain average (the original DiLoCo outer gradient); float32 tensors, as for every rule."""
    w = np.full(len(deltas), 1.0 / len(deltas))
    return {k: _to_float32(_weighted_sum([d[k] for d in deltas], w)) for k in deltas[0]}


def merge_token_weighted(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Token-weighted average Σ w_m v_m with w from :func:`token_weights` (raises as it does)."""
    w = token_weights(tokens, steps)
    return {k: _to_float32(_weighted_sum([d[k] for d in deltas], w)) for k in deltas[0]}


def merge_rda(deltas: Sequence[Tensors], tokens, steps, embedding_names=()) -> dict[str, np.ndarray]:
    """Token-weighted RDA per tensor; tensors named in ``embedding_names`` use the weighted mean."""
    w = token_weights(tokens, steps)
    out = {}
    for k in deltas[0]:
        vs = [d[k] for d in deltas]
        out[k] = _to_float32(_weighted_sum(vs, w)) if k in embedding_names else rda(vs, w)
    return out


# Every rule: (deltas: M mappings name → array, tokens [M], steps [M], embedding_names) → name → float32.
MergeRule = Callable[..., dict[str, np.ndarray]]
MERGE_RULES: dict[str, MergeRule] = {
    "mean": merge_mean,
    "token_weighted": merge_token_weighted,
    "rda": merge_rda,
}


def weights_for(rule: str, tokens, steps) -> np.ndarray:
    """The per-learner weights a rule applies (for the merge log): float64 [M], summing to 1."""
    if rule == "mean":
        return np.full(len(tokens), 1.0 / len(tokens))
    return token_weights(tokens, steps)
