"""A Flax NNX module as a pure function of flat parameters ``{"blocks/0/attn/qkv/kernel": array}``.

Every training loop, the DiLoCo learner and the syncer hold parameters as one flat mapping of
slash-joined names to arrays: fragments, submissions, merges and checkpoints are plain
dictionaries, independent of the module tree, and the step is a pure function of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def flatten(pure: Mapping) -> dict[str, Any]:
    """Nested pure dict (``nnx.to_pure_dict``) → ``{"a/b/0/c": leaf}``, names sorted."""
    return {"/".join(_key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(pure)}


def nest(flat: Mapping[str, Any]) -> dict:
    """Inverse of :func:`flatten`: digit-only name parts become int keys (``nnx.List`` indices)."""
    out: dict = {}
    for name, leaf in flat.items():
        parts = [int(p) if p.isdigit() else p for p in name.split("/")]
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf
    return out


@dataclass(frozen=True)
class Functional:
    """The static part of a module (graph and non-parameter state); ``module(params)`` rebuilds it.

    Build with :meth:`of` from a concrete module; the parameters returned with it are the module's
    own, flat, float32 as built.
    """

    graphdef: Any
    rest: Any
    names: tuple[str, ...]

    @classmethod
    def of(cls, model: nnx.Module) -> tuple[Functional, dict[str, jax.Array]]:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        flat = flatten(nnx.to_pure_dict(params))
        return cls(graphdef, rest, tuple(flat)), flat

    def module(self, params: Mapping[str, Any]) -> nnx.Module:
        """The module with ``params`` (flat, every name of :attr:`names`); usable inside ``jit``."""
        return nnx.merge(self.graphdef, nest(params), self.rest)


def params_of(model: nnx.Module) -> dict[str, jax.Array]:
    """A module's ``nnx.Param`` leaves, flat (float32 arrays, shapes as built)."""
    return flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def load_params(model: nnx.Module, values: Mapping[str, np.ndarray | jax.Array]) -> None:
    """Overwrite the named ``nnx.Param`` leaves of ``model`` in place (others untouched).

    Raises ``KeyError`` for a name that is not a parameter, ``ValueError`` for a shape mismatch.
    """
    state = nnx.state(model, nnx.Param)
    known = flatten(nnx.to_pure_dict(state))
    for name, value in values.items():
        if name not in known:
            raise KeyError(f"{name!r} is not a parameter of this model")
        if tuple(np.shape(value)) != tuple(known[name].shape):
            raise ValueError(f"{name}: shape {np.shape(value)} != {known[name].shape}")
    merged = {k: jnp.asarray(values[k], dtype=v.dtype) if k in values else v for k, v in known.items()}
    nnx.replace_by_pure_dict(state, nest(merged))
    nnx.update(model, state)
