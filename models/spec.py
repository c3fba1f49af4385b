"""What every model kind gives the rest of the project, and the registry that builds them.

A model kind is one file that defines its Flax NNX module and registers a builder with
:func:`register`; ``build_model(config.model, shape)`` returns a :class:`ModelSpec`: the module
factory, its objective (loss and metrics from a batch), parameter count, FLOPs per example and the
batch layout. The training loops, the DiLoCo learner and the DP baseline only ever see a spec, so a
new kind touches this registry (one import line in ``models/__init__.py``), its own file and the
config's model union, and nothing in ``diloco/`` or ``training/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# objective(model, batch) -> (scalar float32 loss to minimise, {metric name: scalar}); pure, jit-able.
Objective = Callable[[nnx.Module, Any], tuple[jax.Array, Mapping[str, jax.Array]]]
# targets(batch) -> float32 scalar: how many target units (predicted tokens, labelled images) the
# objective's loss is the mean over; pure, jit-able, from the batch alone.
Targets = Callable[[Any], jax.Array]


@dataclass(frozen=True)
class InputShape:
    """What the data fixes about a model.

    Text: ``vocab_size`` (tokens in the tokenizer, V) and ``seq_len`` (tokens per training
    sequence, L; a text batch holds L + 1 tokens per row: inputs and shifted targets). Images:
    ``image_shape`` (H, W, C pixels), ``num_classes`` and ``pixel_max`` (the largest pixel value
    the data can hold: 255 for 8-bit images, 16 for scikit-learn's digits).
    """

    vocab_size: int | None = None
    seq_len: int | None = None
    image_shape: tuple[int, int, int] | None = None
    num_classes: int | None = None
    pixel_max: int | None = None


@dataclass(frozen=True)
class BatchLayout:
    """The batch a model's objective takes: one array ``dtype[B, *row_shape]`` (text), or, when
    ``columns`` is set, a dict of arrays ``{name: dtype[B, *shape]}`` (images and labels).

    ``unit``: what the training budget counts (``tokens`` for text, ``images`` for vision);
    ``units_per_row``: how many of them one row holds (L for a text row of L + 1 tokens: L
    predicted tokens; 1 for an image).
    """

    dtype: str
    row_shape: tuple[int, ...]
    unit: str
    units_per_row: int
    columns: Mapping[str, tuple[str, tuple[int, ...]]] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One buildable model and everything the loops need to train and measure it.

    ``init(seed)`` builds the module with fresh parameters (the same seed gives the same
    parameters). ``objective``: see :data:`Objective`. ``params``: trainable scalars.
    ``flops_per_unit``: training FLOPs (forward + backward) per token (text) or example (active
    FLOPs for MoE). ``heldout``: the metric held-out measurement reports as its loss (``loss``, the
    objective itself, or e.g. ``ce`` when the objective adds auxiliary terms).

    ``targets``: see :data:`Targets` (None: every row holds ``batch.units_per_row`` targets, as in
    a packed text batch or a batch of labelled images). The train step weights each microbatch's
    loss and gradient by it and the held-out loss each batch's, so a step or an evaluation is the
    mean over every target of its batches however they are split (:meth:`count_targets`).
    """

    kind: str
    config: Any
    init: Callable[[int], nnx.Module]
    objective: Objective
    batch: BatchLayout
    params: int
    flops_per_unit: float
    heldout: str = "loss"
    extras: Mapping[str, Any] = field(default_factory=dict)
    targets: Targets | None = None

    def count_targets(self, batch) -> jax.Array:
        """The number of targets in ``batch`` (float32 scalar; jit-able): :attr:`targets`, or rows ×
        ``batch.units_per_row``."""
        if self.targets is not None:
            return self.targets(batch)
        rows = jax.tree.leaves(batch)[0].shape[0]
        return jnp.asarray(rows * self.batch.units_per_row, jnp.float32)


Builder = Callable[[Any, InputShape], ModelSpec]
MODELS: dict[str, Builder] = {}


def register(kind: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(config, shape) -> ModelSpec`` the builder of ``kind``.

    Raises ``ValueError`` if ``kind`` is already registered.
    """

    def deco(builder: Builder) -> Builder:
        if kind in MODELS:
            raise ValueError(f"model kind {kind!r} is already registered")
        MODELS[kind] = builder
        return builder

    return deco


def build_model(config: Any, shape: InputShape) -> ModelSpec:
    """The spec of the model ``config.kind`` for data of ``shape``.

    Raises ``ValueError`` naming the known kinds for an unknown ``config.kind``.
    """
    kind = getattr(config, "kind", None)
    if kind not in MODELS:
        raise ValueError(f"model.kind {kind!r} is unknown; choose one of {sorted(MODELS)}")
    return MODELS[kind](config, shape)


def count_params(model: nnx.Module) -> int:
    """Number of trainable scalars (``nnx.Param`` leaves)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
