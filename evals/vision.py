"""Held-out evaluation of an image classifier: top-1 accuracy, loss and the confusion matrix.

Shapes: N test images, K classes; ``logits_fn(images uint8[B, H, W, C]) -> float32[B, K]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def evaluate_classifier(
    logits_fn: Callable[[np.ndarray], np.ndarray],
    rows: dict[str, np.ndarray],
    num_classes: int,
    batch_size: int = 256,
    per_item: bool = False,
) -> dict:
    """Every test image once, in order, in batches of ``batch_size``.

    Returns ``test/accuracy`` (top-1, fraction of N), ``test/accuracy_stderr`` (binomial,
    √(p(1−p)/N)), ``test/loss`` (mean softmax cross entropy, nats per image), ``test/images`` (N),
    ``test/per_class_accuracy`` ([K]) and ``confusion`` ([K][K] counts, row = true class, column =
    predicted class); with ``per_item``, also ``per_item``: ``{"accuracy": [0/1 per image],
    "loss": [nats per image]}`` in the rows' order. Raises ``ValueError`` for an empty split.
    """
    images, labels = rows["image"], rows["label"].astype(np.int64)
    n = len(labels)
    if n == 0:
        raise ValueError("the test split holds no images")
    losses, preds = [], []
    for i in range(0, n, batch_size):
        logits = np.asarray(logits_fn(images[i : i + batch_size]), dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        y = labels[i : i + batch_size]
        losses.append(-logp[np.arange(len(y)), y])
        preds.append(logits.argmax(axis=1))
    pred = np.concatenate(preds)
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(confusion, (labels, pred), 1)
    acc = float((pred == labels).mean())
    per_class = confusion.diagonal() / np.maximum(confusion.sum(axis=1), 1)
    out = {
        "test/accuracy": acc,
        "test/accuracy_stderr": float(np.sqrt(acc * (1 - acc) / n)),
        "test/loss": float(np.concatenate(losses).mean()),
        "test/images": int(n),
        "test/per_class_accuracy": [float(x) for x in per_class],
        "confusion": confusion.tolist(),
    }
    if per_item:
        out["per_item"] = {"accuracy": (pred == labels).astype(float).tolist(), "loss": np.concatenate(losses).tolist()}
    return out
