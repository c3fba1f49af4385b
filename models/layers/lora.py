"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on a built model, with Flax NNX's
``nnx.LoRA`` layers.

:func:`add_lora` wraps chosen ``nnx.Linear`` projections of a module in :class:`ScaledLoRA` (an
``nnx.LoRA(base_module=…)`` with the paper's output scale, in place): the layer computes
``x @ W (+ b) + (α/r)·x @ A @ B`` (Hu et al. 2021, §4.1: ΔW x scaled by α/r) with
``A: float32[I, r]`` (variance scaling) and ``B: float32[r, O]`` (zeros, so the adapted model
starts equal to the base), both ``nnx.LoRAParam``; α defaults to r (scale 1). Every projection
call goes through :func:`project`, which handles both kinds of layer, so a model kind needs no
LoRA code of its own.

Flat parameter names (``training.functional``) of an adapted layer ``X``: ``X/base_module/kernel``
(and ``/bias``), ``X/lora_a``, ``X/lora_b``; :func:`merge_lora` folds the adapters back into the
base layout (``X/kernel = W + (α/r)·A @ B``), so a fine-tuned checkpoint loads into the plain model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.ops import linear

BASE, LORA_A, LORA_B = "base_module", "lora_a", "lora_b"


class ScaledLoRA(nnx.LoRA):
    """``nnx.LoRA`` with the output scale α/r: ``y = base(x) + (α/r)·x @ A @ B``.

    ``lora_rank`` (r) and ``alpha`` (α; None: r) are kept as static attributes (``rank``,
    ``alpha``, ``scale`` = α/r), so a saved adapter can be checked against the model it is loaded
    into (``training.finetune.load_adapters``). The parameters are ``nnx.LoRA``'s.
    """

    def __init__(self, in_features: int, lora_rank: int, out_features: int, *, alpha: float | None = None, **kwargs):
        super().__init__(in_features, lora_rank, out_features, **kwargs)
        self.rank = int(lora_rank)
        self.alpha = float(lora_rank if alpha is None else alpha)
        self.scale = self.alpha / self.rank

    def __call__(self, x: jax.Array, **kwargs) -> jax.Array:
        out = self.scale * ((x @ self.lora_a[...]) @ self.lora_b[...])
        return out + self.base_module(x, **kwargs) if self.base_module is not None else out


def lora_scale(layer: nnx.Module) -> float:
    """α/r of an adapted layer (1 for a plain ``nnx.LoRA``, which has no scale)."""
    return float(getattr(layer, "scale", 1.0))


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
        y = y + lora_scale(layer) * ((x @ layer.lora_a[...]) @ layer.lora_b[...])
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


def add_lora(
    model: nnx.Module, rank: int, targets: Iterable[str], rngs: nnx.Rngs, alpha: float | None = None
) -> list[str]:
    """Wrap every ``nnx.Linear`` attribute named in ``targets`` (e.g. ``qkv``, ``down``) in a
    :class:`ScaledLoRA` of rank ``rank`` and scale ``alpha / rank`` (``alpha`` None: the rank, scale
    1), in place; returns the wrapped layers' paths (``blocks/0/attn/qkv``).

    Raises ``ValueError`` when no layer matches (the names and the model do not fit), the rank is
    not below a layer's smaller side, or ``alpha`` is not positive.
    """
    if alpha is not None and not alpha > 0:
        raise ValueError(f"finetune.lora_alpha ({alpha}) must be > 0; unset it to use the rank")
    targets = set(targets)
    found: list[tuple[nnx.Module, str, str]] = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.LoRA):
            for name, child in vars(node).items():
                if name in targets and isinstance(child, nnx.Linear):
                    found.append((node, name, "/".join(map(str, (*path, name)))))
    if not found:
        raise ValueError(
            f"finetune.lora_targets {sorted(targets)} match no projection of this model; "
            "use e.g. qkv, out, gate, up, down"
        )
    for parent, name, path in found:
        base = getattr(parent, name)
        i, o = base.kernel.shape
        if rank >= min(i, o):
            raise ValueError(f"finetune.lora_rank ({rank}) must be below {path}'s smaller side ({min(i, o)})")
        setattr(parent, name, ScaledLoRA(i, rank, o, alpha=alpha, base_module=base, rngs=rngs))
    return [p for _, _, p in found]


def is_adapter(name: str) -> bool:
    """Whether a flat parameter name is a LoRA adapter matrix (``…/lora_a`` or ``…/lora_b``)."""
    return name.endswith((f"/{LORA_A}", f"/{LORA_B}"))


def adapted_layers(model: nnx.Module) -> dict[str, ScaledLoRA | nnx.LoRA]:
    """Every LoRA layer of ``model``: path (``blocks/0/attn/qkv``) → layer."""
    return {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.LoRA)}


def merge_lora(params: Mapping[str, jax.Array], scale: float = 1.0) -> dict[str, jax.Array]:
    """Flat parameters of an adapted model → the base model's layout, with ``W + scale·A @ B``
    folded in (``scale`` = α/r, as the adapted layers were built with; 1 for α = r).

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
            name = "/".join(parts[:i] + parts[i + 1 :])
            if parts[-1] == "kernel" and f"{prefix}/{LORA_A}" in params:
                delta = jnp.asarray(params[f"{prefix}/{LORA_A}"]) @ jnp.asarray(params[f"{prefix}/{LORA_B}"])
                value = value + (delta if scale == 1.0 else scale * delta)
        out[name] = value
    return out
