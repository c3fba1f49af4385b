"""Flat views of Flax NNX parameters: ``{"blocks/0/attn/qkv/kernel": array, ...}``.

The algorithm works on flat name → array mappings so that fragments, submissions and merges are
plain dictionaries, independent of the model's module tree.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx


def _name(path) -> str:
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))))
    return "/".join(parts)


def get_params(model: nnx.Module) -> dict[str, jax.Array]:
    """All ``nnx.Param`` leaves of ``model`` by slash-joined path (float32 arrays, shapes as built)."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(pure)}


def set_params(model: nnx.Module, values: Mapping[str, np.ndarray | jax.Array]) -> None:
    """Overwrite the named ``nnx.Param`` leaves in place (others untouched).

    Raises:
        KeyError: a name that is not a parameter of ``model``.
        ValueError: a shape mismatch.
    """
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    known = {_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(pure)}
    for name, value in values.items():
        if name not in known:
            raise KeyError(f"{name!r} is not a parameter of this model")
        if tuple(np.shape(value)) != tuple(known[name].shape):
            raise ValueError(f"{name}: shape {np.shape(value)} != {known[name].shape}")

    def pick(path, leaf):
        name = _name(path)
        return jax.numpy.asarray(values[name], dtype=leaf.dtype) if name in values else leaf

    new_pure = jax.tree_util.tree_map_with_path(pick, pure)
    nnx.replace_by_pure_dict(state, new_pure)
    nnx.update(model, state)


def tensor_bytes(params: Mapping[str, np.ndarray | jax.Array]) -> dict[str, int]:
    """Bytes per tensor (size × itemsize)."""
    return {k: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for k, v in params.items()}


def to_numpy(params: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Host copies as float32 numpy arrays (a submission must not alias a live buffer)."""
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}


def embedding_names(params: Mapping[str, object]) -> set[str]:
    """Tensors that are token embeddings (merged by plain weighted average under RDA)."""
    return {k for k in params if k.split("/")[0] == "embed"}
