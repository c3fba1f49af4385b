"""Batches with a resumable cursor: a pure function of (epoch, index), so a saved cursor resumes exactly."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

# ---------------------------------------------------------------------------------------------
# Batches with a resumable cursor
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed & 0xFFFFFFFF, epoch]).permutation(n)
    perm.setflags(write=False)
    return perm


def batch_at(
    seqs: np.ndarray | Mapping[str, np.ndarray], epoch: int, index: int, batch_size: int, seed: int
) -> tuple[np.ndarray | dict[str, np.ndarray], int, int]:
    """Next ``batch_size`` rows of ``seqs`` after the cursor ``(epoch, index)``.

    Epoch ``e`` visits the rows in a fixed permutation seeded by ``(seed, e)``; ``index`` is the
    position within it. When an epoch runs out the batch continues with the next epoch's
    permutation, so the rows of one epoch are all seen exactly once before any repeats. The
    function is pure: feeding the returned cursor back in (e.g. after a retry restored it from a
    checkpoint) continues exactly where the previous call stopped, with nothing repeated or
    skipped.

    Args:
        seqs: int ``[N, T+1]`` packed sequences (N ≥ 1), or a mapping of columns sharing N rows
            (e.g. ``{"image": uint8[N, H, W, C], "label": int32[N]}``).
        epoch: ≥ 0. index: 0 ≤ index ≤ N. batch_size: ≥ 1 (may exceed N).
        seed: permutation seed.

    Returns:
        ``(batch, next_epoch, next_index)``: batch int32 ``[batch_size, T+1]`` (for columns: a
        dict of the same columns, ``batch_size`` rows each, dtypes kept); the cursor is normalised
        so ``0 ≤ next_index < N``.

    Raises ``ValueError`` for an empty ``seqs`` or an out-of-range cursor / batch size.
    """
    n = int(next(iter(seqs.values())).shape[0]) if isinstance(seqs, Mapping) else int(seqs.shape[0])
    if n == 0:
        raise ValueError("batch_at: no sequences to draw from")
    if batch_size < 1:
        raise ValueError(f"batch_at: batch_size must be ≥ 1, got {batch_size}")
    if epoch < 0 or not 0 <= index <= n:
        raise ValueError(f"batch_at: cursor (epoch={epoch}, index={index}) out of range for N={n}")
    rows = []
    need = batch_size
    while need:
        if index == n:
            epoch, index = epoch + 1, 0
        take = min(need, n - index)
        rows.append(_epoch_permutation(n, seed, epoch)[index : index + take])
        index += take
        need -= take
    if index == n:
        epoch, index = epoch + 1, 0
    picked = np.concatenate(rows)
    if isinstance(seqs, Mapping):
        return {k: np.asarray(v[picked]) for k, v in seqs.items()}, epoch, index
    return np.asarray(seqs[picked], dtype=np.int32), epoch, index
