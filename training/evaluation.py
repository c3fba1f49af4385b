"""Held-out measurement, the same for every method: fixed validation batches and one cadence."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


def val_batches(val_rows, num_batches: int, batch_size: int) -> list:
    """The first ``num_batches × batch_size`` validation rows, in order (the same for every method).

    ``val_rows``: an array ``[N, ...]`` or a mapping of columns sharing N rows (batches then are
    dicts of the same columns). Raises ``ValueError`` if the split holds fewer rows than one batch.
    """
    if isinstance(val_rows, Mapping):
        n_rows = len(next(iter(val_rows.values())))
        whole = val_batches(np.arange(n_rows), num_batches, batch_size)
        return [{k: v[idx] for k, v in val_rows.items()} for idx in whole]
    n = min(num_batches, len(val_rows) // batch_size)
    if n < 1:
        raise ValueError(
            f"validation split has {len(val_rows)} rows (sequences or images), fewer than "
            f"train.eval_batch_size ({batch_size}); hold out more (data.val_docs for text, "
            "data.val_fraction for images) or lower train.eval_batch_size"
        )
    return [val_rows[i * batch_size : (i + 1) * batch_size] for i in range(n)]


def heldout_metrics(evaluate: Callable, params: Mapping, batches: list[np.ndarray]) -> dict[str, float]:
    """Every metric of the eval step, each a mean over fixed batches weighted by their targets.

    ``evaluate``: ``training.step.make_eval_step``'s function; ``params``: flat parameters. Holds
    ``loss`` (the held-out loss: nats per token for text), ``objective`` and the model's own metrics
    (e.g. an MoE model's expert loads on the held-out tokens). When the eval step reports each
    batch's number of targets (``training.step.TARGETS``: response tokens of a fine-tuning batch),
    batch b weighs n_b / Σ n, so the loss is the mean over every target token of the batches; else
    (or when no batch holds a target) every batch weighs the same. The count itself is not returned.
    """
    from training.step import TARGETS

    outs = [evaluate(params, jax.tree.map(jnp.asarray, b)) for b in batches]
    n = np.asarray([float(o[TARGETS]) if TARGETS in o else 1.0 for o in outs])
    w = n / n.sum() if n.sum() > 0 else np.full(len(outs), 1.0 / len(outs))
    return {k: float(np.sum(w * np.asarray([float(o[k]) for o in outs]))) for k in outs[0] if k != TARGETS}


def final_heldout(
    evaluate: Callable, params: Mapping, run_dir, batch_size: int, splits: tuple[str, ...] = ("val", "test")
) -> dict[str, dict]:
    """A finished model on every full batch of whole held-out splits, not the fixed sample of the
    curves: ``{split: {"loss": float, "rows": int, "units": int}}`` (loss: nats per token, or per
    image; rows: sequences or images measured, every row but fewer than ``batch_size`` left over;
    units: predicted tokens, or images). ``val`` is what selection and tuning read, ``test`` the
    headline figures' split that nothing tunes on. A split the run directory lacks (a text run
    prepared before the test split was packed) or holding less than one batch is left out."""
    from data.prepare import load_rows

    out = {}
    for split in splits:
        try:
            rows = load_rows(run_dir, split)
        except FileNotFoundError:
            continue
        first = next(iter(rows.values())) if isinstance(rows, Mapping) else rows
        n = (len(first) // batch_size) * batch_size
        if n == 0:
            continue
        metrics = heldout_metrics(evaluate, params, val_batches(rows, n // batch_size, batch_size))
        per_row = 1 if isinstance(rows, Mapping) else first.shape[1] - 1  # images, or next-token targets
        out[split] = {"loss": float(metrics["loss"]), "rows": int(n), "units": int(n * per_row)}
    return out


def heldout_loss(evaluate: Callable, params: Mapping, batches: list[np.ndarray]) -> float:
    """The held-out loss alone (``heldout_metrics(...)["loss"]``)."""
    return heldout_metrics(evaluate, params, batches)["loss"]


def eval_record(metrics: Mapping[str, float]) -> dict[str, float]:
    """The eval-log fields of :func:`heldout_metrics`: ``val/loss`` and ``val/<metric>`` for the
    model's own metrics (``objective`` included only when it differs from the loss)."""
    out = {"val/loss": metrics["loss"]}
    for k, v in metrics.items():
        if k != "loss" and not (k == "objective" and v == metrics["loss"]):
            out[f"val/{k}"] = v
    return out


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
