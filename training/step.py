"""One pure train step for every model kind and method, built from an objective and an Optax optimizer.

``step(params, opt_state, batch) -> (params, opt_state, metrics)``: flat parameters in, flat
parameters out (``training.functional``), jitted once per (model, optimizer, microbatch count), the
input parameter and optimizer buffers donated to the output. ``metrics`` holds ``loss`` plus whatever
the objective reports (an MoE auxiliary loss, an accuracy), as device scalars: reading them
(``float``) waits for the step, so loops read them only when they log.

A batch is one array ``[B, ...]`` or a pytree of them sharing the leading B (e.g. images and labels).

Shape legend: B rows per step, G microbatches (gradient accumulation), B/G rows per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from models.spec import ModelSpec
from training.functional import Functional
from training.xla import configure_host

Params = dict[str, jax.Array]
StepFn = Callable[[Params, optax.OptState, Any], tuple[Params, optax.OptState, dict[str, jax.Array]]]


def _loss_and_grad(fn: Functional, objective):
    def loss_of(params, frozen, batch):
        loss, metrics = objective(fn.module({**frozen, **params}), batch)
        return loss, dict(metrics)

    return jax.value_and_grad(loss_of, has_aux=True)


def make_train_step(fn: Functional, objective, tx: optax.GradientTransformation, microbatches: int = 1) -> StepFn:
    """The jitted inner step: forward and backward over the batch, one optimizer update.

    ``microbatches`` (G) > 1 runs forward and backward on B / G rows at a time (a ``lax.scan``) and
    averages the losses, metrics and gradients before the single update: the same update as one
    pass over the whole batch (every row holds the same number of predicted units), up to float32
    summation order, with smaller activations. B must be divisible by G (``ValueError`` at trace).
    The parameter and optimizer-state arguments are donated: do not use them after the call.
    ``frozen`` (optional, flat): parameters the module needs that are not trained (LoRA's base
    weights, ``training.finetune``): read, never differentiated, updated or donated; ``params`` and
    ``frozen`` together name every parameter.
    Building a step applies :func:`training.xla.configure_host` (process-wide malloc settings that
    keep each call's temporary buffers mapped for the next).
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be ≥ 1, got {microbatches}")
    configure_host()  # malloc keeps the step's buffers between calls (training/xla.py)
    grad_fn = _loss_and_grad(fn, objective)

    def step(params: Params, opt_state, batch, frozen: Params | None = None):
        frozen = frozen or {}
        if microbatches == 1:
            (loss, metrics), grads = grad_fn(params, frozen, batch)
        else:
            B = jax.tree.leaves(batch)[0].shape[0]
            if B % microbatches:
                raise ValueError(f"batch of {B} rows is not divisible into {microbatches} microbatches")
            slices_GB = jax.tree.map(lambda a: a.reshape(microbatches, B // microbatches, *a.shape[1:]), batch)

            def body(acc, mb):
                (loss, metrics), grads = grad_fn(params, frozen, mb)
                return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

            zeros = jax.tree.map(jnp.zeros_like, params)
            total, (losses_G, metrics_G) = jax.lax.scan(body, zeros, slices_GB)
            loss = losses_G.mean()
            metrics = jax.tree.map(lambda m: m.mean(), metrics_G)
            grads = jax.tree.map(lambda g: g / microbatches, total)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, **metrics}

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(fn: Functional, objective, heldout: str = "loss") -> Callable[[Params, Any], dict[str, jax.Array]]:
    """Jitted ``(params, batch, frozen=None) -> {"loss": …, "objective": …, **metrics}`` without an update
    (nothing donated). ``loss`` is the metric named ``heldout`` (the objective's value by default;
    an MoE model's cross entropy without its auxiliary losses); ``objective`` the value minimised.
    A ``heldout`` the objective does not report raises ``KeyError`` at trace time."""
    configure_host()

    def evaluate(params, batch, frozen=None):
        loss, metrics = objective(fn.module({**(frozen or {}), **params}), batch)
        out = {**metrics, "objective": loss}
        out["loss"] = loss if heldout == "loss" else metrics[heldout]
        return out

    return jax.jit(evaluate)


class Trainer:
    """A model spec bound to one optimizer: the compiled step, the eval step and fresh states.

    ``spec``: the model (``models.build_model``). ``tx``: the inner optimizer. ``microbatches``: G.
    ``init(seed)`` returns fresh flat parameters (the model's initialisation for that seed).
    """

    def __init__(self, spec: ModelSpec, tx: optax.GradientTransformation, microbatches: int = 1, seed: int = 0):
        self.spec, self.tx, self.microbatches = spec, tx, microbatches
        self.fn, self._params0 = Functional.of(spec.init(seed))
        self.seed = seed
        self.step = make_train_step(self.fn, spec.objective, tx, microbatches)
        self.evaluate = make_eval_step(self.fn, spec.objective, spec.heldout)

    @property
    def param_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Name → shape and dtype of every parameter (no copy)."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._params0.items()}

    def init_params(self) -> Params:
        """Fresh copies of the initial parameters (the step donates its inputs)."""
        return {k: jnp.array(v, copy=True) for k, v in self._params0.items()}

    def init_opt(self, params: Mapping[str, jax.Array]):
        return self.tx.init(dict(params))
