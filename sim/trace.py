"""Failure traces: when chips are interrupted, on which slice, and for how long (seconds).

A trace is drawn once per (seed, N) at the full rate N / MTBI and replayed by every system, which
thins it by its own state (common random numbers; see :mod:`sim`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.config import SECONDS_PER_YEAR, GoodputConfig


@dataclass(frozen=True)
class Trace:
    """Interruptions of a cluster over [0, horizon_s): times (s, sorted), slice ids, recovery (s)."""

    times: np.ndarray
    slices: np.ndarray
    recovery: np.ndarray
    n_slices: int
    chips: int
    horizon_s: float

    @property
    def chips_per_slice(self) -> float:
        return self.chips / self.n_slices

    def subset(self, slice_ids: np.ndarray) -> Trace:
        """The interruptions of ``slice_ids`` only, renumbered 0 … len(slice_ids)−1."""
        local = np.full(self.n_slices, -1, dtype=np.int64)
        local[slice_ids] = np.arange(len(slice_ids))
        keep = local[self.slices] >= 0
        return Trace(
            self.times[keep],
            local[self.slices[keep]],
            self.recovery[keep],
            len(slice_ids),
            self.chips * len(slice_ids) / self.n_slices,
            self.horizon_s,
        )


def n_slices(cfg: GoodputConfig, chips: int) -> int:
    return max(1, round(chips / cfg.slice_chips))


def failure_trace(cfg: GoodputConfig, chips: int, rng: np.random.Generator, horizon_s: float | None = None) -> Trace:
    """Poisson interruptions of ``chips`` chips at the full rate N / MTBI, each on a uniformly drawn
    slice (slices have equal size), with a recovery delay drawn from ``cfg.recovery``."""
    horizon = cfg.horizon_s(chips) if horizon_s is None else horizon_s
    rate = chips / (cfg.chip_mtbi_years * SECONDS_PER_YEAR)
    count = rng.poisson(rate * horizon)
    times = np.sort(rng.uniform(0.0, horizon, count))
    n = n_slices(cfg, chips)
    slices = rng.integers(0, n, count)
    recovery = cfg.recovery.rvs(size=count, random_state=rng) if count else np.zeros(0)
    return Trace(times, slices, np.asarray(recovery, dtype=float), n, chips, horizon)
