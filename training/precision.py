"""The precision policy of a run (config ``precision``): the dtypes parameters are kept in, the
forward and backward passes compute in, and the optimizer state is kept in.

Mixed precision as large-scale JAX trainers do it (the "params float32, compute bfloat16" policy of
jmp/Levanter and MaxText's ``weight_dtype``/``dtype``): the trained parameters (the master copy)
stay in ``params``; each step casts them to ``compute`` inside the differentiated function, so the
matmuls, attention and activations run in ``compute`` and the gradients come back through the cast
in ``params``. What stays float32 whatever the policy:

* the loss and the softmaxes: the fused head and loss, attention scores and probabilities, the MoE
  router and its statistics are computed in float32 (``models.layers.ops``, ``models.layers.moe``);
  the loss the step returns is float32;
* gradient accumulation over microbatches (float32 sums, then one update);
* everything of the syncer: learners send their fragments as float32 (``diloco.tensors.to_numpy``),
  the outer gradients, the merged fragments Θ_p and the outer momentum are float32
  (``diloco.syncer``, ``diloco.outer``); a learner receiving Θ_p casts it to ``params``;
* final checkpoints (``pretrain/<method>/checkpoints``): float32 parameters, so evaluation and
  fine-tuning read the same layout whatever the policy.

The optimizer state's floating leaves (AdamW's moments) are stored in ``opt_state`` between steps
(:func:`with_state_dtype`); its integer leaves (step counts) are left alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from configs.runtime import PrecisionConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def cast_floating(tree: Any, dtype) -> Any:
    """``tree`` with every floating-point leaf cast to ``dtype`` (integer and boolean leaves, and
    leaves already in ``dtype``, as they are). ``dtype`` None: ``tree`` unchanged."""
    if dtype is None:
        return tree

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def with_state_dtype(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``tx`` with its state's floating leaves kept in ``dtype`` between updates (None: ``tx``).

    ``init`` casts the fresh state; ``update`` runs ``tx.update`` on the stored state (its
    arithmetic promotes with the gradients' dtype, so a bfloat16 moment meets a float32 gradient in
    float32) and casts the new state back. The updates are returned as ``tx`` makes them;
    ``optax.apply_updates`` casts them to each parameter's dtype.
    """
    if dtype is None:
        return tx

    def init(params):
        return cast_floating(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return updates, cast_floating(state, dtype)

    return optax.GradientTransformation(init, update)


def set_compute_dtype(model, dtype) -> None:
    """Make every Flax layer of ``model`` that computes in a fixed ``dtype`` (``nnx.Embed``,
    ``nnx.RMSNorm``, ``nnx.LayerNorm``, ``nnx.Linear``, …: those with a ``dtype`` attribute) compute
    in ``dtype``, in place (None: leave them). Flax fixes a layer's computation dtype when it is built
    (unset, the parameters' dtype: float32); the step's cast of the parameters then reaches it.
    RMSNorm keeps computing its statistics in float32 (Flax promotes them)."""
    if dtype is None:
        return
    from flax import nnx

    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and "dtype" in vars(node):
            node.dtype = dtype


class Dtypes(NamedTuple):
    """The JAX dtypes of a policy: ``params``, ``compute``, ``opt_state``."""

    params: Any
    compute: Any
    opt_state: Any


def dtypes(policy: PrecisionConfig | None) -> Dtypes | None:
    """The dtypes of ``policy`` (a ``configs.runtime.PrecisionConfig``, the config's ``precision``);
    None for the all-float32 policy (and for None): nothing is cast, the step is the one it always
    was (the golden losses)."""
    if policy is None or policy.params == policy.compute == policy.opt_state == "float32":
        return None
    return Dtypes(DTYPES[policy.params], DTYPES[policy.compute], DTYPES[policy.opt_state])


def wrap_optimizer(tx: optax.GradientTransformation, policy: PrecisionConfig | None) -> optax.GradientTransformation:
    """``tx`` keeping its state in the policy's ``opt_state`` (:func:`with_state_dtype`); ``tx`` itself
    under the all-float32 policy."""
    d = dtypes(policy)
    return tx if d is None else with_state_dtype(tx, d.opt_state)
