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

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

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


@dataclass(frozen=True)
class Precision:
    """A run's dtypes by name (``"float32"`` or ``"bfloat16"``): ``params`` (the trained
    parameters), ``compute`` (forward and backward passes), ``opt_state`` (the optimizer state's
    floating leaves). Build it from the config with :meth:`of`."""

    params: str = "float32"
    compute: str = "float32"
    opt_state: str = "float32"

    @classmethod
    def of(cls, cfg) -> "Precision":
        """From a ``configs.schema.PrecisionConfig`` (None: all float32)."""
        return cls() if cfg is None else cls(cfg.params, cfg.compute, cfg.opt_state)

    @property
    def params_dtype(self):
        return DTYPES[self.params]

    @property
    def compute_dtype(self):
        return DTYPES[self.compute]

    @property
    def opt_state_dtype(self):
        return DTYPES[self.opt_state]

    @property
    def is_float32(self) -> bool:
        return self.params == self.compute == self.opt_state == "float32"

    def wrap(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` keeping its state in ``opt_state`` (:func:`with_state_dtype`). Under the all-float32
        policy ``tx`` itself: the step is the one it always was (the golden losses)."""
        return tx if self.is_float32 else with_state_dtype(tx, self.opt_state_dtype)

    def describe(self) -> str:
        """One line for logs and reports: ``params float32 · compute bfloat16 · optimizer state float32``."""
        return f"params {self.params} · compute {self.compute} · optimizer state {self.opt_state}"
