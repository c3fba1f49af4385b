"""Flat parameter mappings ``{"blocks/0/attn/qkv/kernel": array}``: sizes, host copies, embeddings.

The algorithm works on flat name → array mappings so that fragments, submissions and merges are
plain dictionaries, independent of any model's module tree (``training.functional`` makes them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def tensor_bytes(params: Mapping[str, object]) -> dict[str, int]:
    """Bytes per tensor (size × itemsize) for arrays of any library with ``shape`` and ``dtype``."""
    return {k: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for k, v in params.items()}


def to_numpy(params: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Host copies as float32 numpy arrays (a submission must not alias a live buffer)."""
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}


def embedding_names(params: Mapping[str, object]) -> set[str]:
    """Tensors that are token embeddings (merged by plain weighted average under RDA)."""
    return {k for k in params if k.split("/")[0] == "embed"}
