"""Held-out measurement, the same for every method: fixed validation batches and one cadence."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np


def val_batches(val_rows: np.ndarray, num_batches: int, batch_size: int) -> list[np.ndarray]:
    """The first ``num_batches × batch_size`` validation rows, in order (the same for every method).

    Raises ``ValueError`` if the validation split holds fewer rows than one batch.
    """
    n = min(num_batches, len(val_rows) // batch_size)
    if n < 1:
        raise ValueError(
            f"validation split has {len(val_rows)} sequences, fewer than train.eval_batch_size "
            f"({batch_size}); hold out more documents (data.val_docs) or lower train.eval_batch_size"
        )
    return [val_rows[i * batch_size : (i + 1) * batch_size] for i in range(n)]


def heldout_loss(evaluate: Callable, params: Mapping, batches: list[np.ndarray]) -> float:
    """Mean objective loss (nats for text) over fixed equal-size batches: a plain mean.

    ``evaluate``: ``training.step.make_eval_step``'s function; ``params``: flat parameters.
    """
    losses = [evaluate(params, jnp.asarray(b))["loss"] for b in batches]
    return float(np.mean([float(x) for x in losses]))


class EvalCadence:
    """When to measure: every ``every`` units (tokens) of training, and once at the end.

    ``due(done)`` is True the first time ``done`` reaches each multiple of ``every`` (several
    multiples crossed at once count as one measurement). Units are the budget's (tokens for text).
    """

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"evaluation cadence must be ≥ 1 unit, got {every}")
        self.every = int(every)
        self.next = self.every

    def due(self, done: int) -> bool:
        if done < self.next:
            return False
        while self.next <= done:
            self.next += self.every
        return True
