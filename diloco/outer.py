"""The outer optimizer: SGD with Nesterov momentum on the merged outer gradient, per fragment.

Source: DiLoCo (Douillard et al., arXiv 2311.08105, Alg. 1), outer Nesterov step:
buf ← μ·buf + Δ;  Θ ← Θ − lr·(Δ + μ·buf)  (optax.sgd(..., nesterov=True) computes exactly this).
The outer learning rate is not decayed.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
import optax


def make_outer_tx(lr: float, momentum: float, nesterov: bool = True) -> optax.GradientTransformation:
    """optax SGD; ``momentum == 0`` gives plain SGD (Θ ← Θ − lr·Δ)."""
    if lr <= 0:
        raise ValueError(f"outer lr must be > 0, got {lr}")
    return optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum) and nesterov)


def outer_step(
    tx: optax.GradientTransformation,
    params: Mapping[str, np.ndarray],
    opt_state: optax.OptState,
    outer_grad: Mapping[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], optax.OptState]:
    """One outer step on one fragment. Pure: returns new float32 params and optimizer state.

    ``params`` and ``outer_grad`` map tensor name → float32 array of the same shape; the outer
    gradient is Δ = Σ_m w_m (Θ − θ_m) (a gradient: the step goes against it). The step runs in
    float32: a result beyond float32's range comes back as ±inf or nan, not as an error (the syncer
    checks every result and refuses such a merge). Inputs are not modified.
    """
    grads = {k: np.asarray(outer_grad[k], dtype=np.float32) for k in params}
    updates, new_state = tx.update(grads, opt_state, dict(params))
    new_params = optax.apply_updates(dict(params), updates)
    return {k: np.asarray(jax.device_get(v), dtype=np.float32) for k, v in new_params.items()}, new_state
