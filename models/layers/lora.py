"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on a built model, with Flax NNX's
``nnx.LoRA`` layers.

:func:`add_lora` wraps chosen ``nnx.Linear`` projections of a module in ``nnx.LoRA(base_module=…)``
(in place): the layer computes ``x @ W (+ b) + x @ A @ B`` with ``A: float32[I, r]`` (variance
scaling) and ``B: float32[r, O]`` (zeros, so the adapted model starts equal to the base), both
``nnx.LoRAParam``. Every projection call goes through :func:`project`, which handles both kinds of
layer, so a model kind needs no LoRA code of its own. ``nnx.LoRA`` has no α/r output scale; with
Adam the scale only moves the effective learning rate of the adapters.

Flat parameter names (``training.functional``) of an adapted layer ``X``: ``X/base_module/kernel``
(and ``/bias``), ``X/lora_a``, ``X/lora_b``; :func:`merge_lora` folds the adapters back into the
base layout (``X/kernel = W + A @ B``), so a fine-tuned checkpoint loads into the plain model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.ops import linear

BASE, LORA_A, LORA_B = "base_module", "lora_a", "lora_b"


def project(layer: nnx.Module, x: jax.Array) -> jax.Array:
    """``x @ W (+ b)`` for an ``nnx.Linear``, plus ``x @ A @ B`` when it is wrapped in ``nnx.LoRA``.

    ``x: float32[..., I]`` → ``float32[..., O]``. The base product runs through
    :func:`models.layers.ops.linear` (explicit weight gradient).
    """
    base = layer.base_module if isinstance(layer, nnx.LoRA) else layer
    y = linear(x, base.kernel[...])
    if getattr(base, "bias", None) is not None:
        y = y + base.bias[...]
    if isinstance(layer, nnx.LoRA):
        y = y + (x @ layer.lora_a[...]) @ layer.lora_b[...]
    return y


def linear_layers(model: nnx.Module) -> dict[str, tuple[str, tuple[int, int]]]:
    """Every ``nnx.Linear`` attribute of ``model``: path → (attribute name, (in, out) features).
    Works on an abstract model (``nnx.eval_shape``)."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.LoRA):
            for name, child in vars(node).items():
                if isinstance(child, nnx.Linear):
                    out["/".join(map(str, (*path, name)))] = (name, tuple(child.kernel.shape))
    return out


def add_lora(model: nnx.Module, rank: int, targets: Iterable[str], rngs: nnx.Rngs) -> list[str]:
    """Wrap every ``nnx.Linear`` attribute named in ``targets`` (e.g. ``qkv``, ``down``) in an
    ``nnx.LoRA`` of rank ``rank``, in place; returns the wrapped layers' paths (``blocks/0/attn/qkv``).

    Raises ``ValueError`` when no layer matches (the names and the model do not fit), or the rank is
    not below a layer's smaller side.
    """
    targets = set(targets)
    found: list[tuple[nnx.Module, str, str]] = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.LoRA):
            for name, child in vars(node).items():
                if name in targets and isinstance(child, nnx.Linear):
                    found.append((node, name, "/".join(map(str, (*path, name)))))
    if not found:
        raise ValueError(f"finetune.lora_targets {sorted(targets)} match no projection of this model; "
                         "use e.g. qkv, out, gate, up, down")
    for parent, name, path in found:
        base = getattr(parent, name)
        i, o = base.kernel.shape
        if rank >= min(i, o):
            raise ValueError(f"finetune.lora_rank ({rank}) must be below {path}'s smaller side ({min(i, o)})")
        setattr(parent, name, nnx.LoRA(i, rank, o, base_module=base, rngs=rngs))
    return [p for _, _, p in found]


def is_adapter(name: str) -> bool:
    """Whether a flat parameter name is a LoRA adapter matrix (``…/lora_a`` or ``…/lora_b``)."""
    return name.endswith((f"/{LORA_A}", f"/{LORA_B}"))


def merge_lora(params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Flat parameters of an adapted model → the base model's layout, with ``W + A @ B`` folded in.

    Names without adapters pass unchanged. Raises ``KeyError`` for an adapter without its base.
    """
    out: dict[str, jax.Array] = {}
    for name, value in params.items():
        if is_adapter(name):
            continue
        parts = name.split("/")
        if BASE in parts:
            i = parts.index(BASE)
            prefix = "/".join(parts[:i])
            name = "/".join(parts[:i] + parts[i + 1:])
            if parts[-1] == "kernel" and f"{prefix}/{LORA_A}" in params:
                value = value + jnp.asarray(params[f"{prefix}/{LORA_A}"]) @ jnp.asarray(params[f"{prefix}/{LORA_B}"])
        out[name] = value
    return out
