"""Evaluate a trained model: restore its Orbax checkpoint and run the held-out lm-eval tasks on it."""

from __future__ import annotations

from pathlib import Path

from configs.schema import ExperimentConfig
from data.store import load_heldout, load_tokenizer
from run.atomic import write_json
from run.layout import RunLayout
from training.checkpoint import load_into_model
from training.common import model_spec


def evaluate_method(cfg: ExperimentConfig, run_dir: str | Path, method: str, stage: str = "pretrain") -> dict:
    """Restore ``<stage>/<method>/checkpoints`` and evaluate it on the held-out test split: a text
    model with the held-out lm-eval tasks, an image classifier by accuracy, loss and confusion matrix
    (``evals.vision.evaluate_classifier``).

    Writes ``eval/<stage>/<method>.json`` (flat metrics) and, for text, lm-eval's full results and
    task files under ``eval/<stage>/<method>/``. Raises ``training.checkpoint.CheckpointError`` for
    a missing or incomplete checkpoint.
    """
    layout = RunLayout(run_dir)
    model = model_spec(cfg.model, cfg.data, cfg.runtime, run_dir).init(cfg.seed)
    meta = load_into_model(layout.checkpoints(stage, method), model)
    if cfg.data.modality == "image":
        metrics = _evaluate_images(model, run_dir)
    else:
        from evals.run_eval import evaluate_lm  # lm-eval import is slow; only pay it when evaluating

        metrics = evaluate_lm(
            model,
            load_tokenizer(run_dir),
            load_heldout(run_dir, "test"),
            layout.eval_outputs(stage, method),
            cfg.eval,
            seed=cfg.seed,
            name="lm_eval",
        )
    metrics = {"method": method, "stage": stage, "checkpoint_tokens": meta.get("tokens"), **metrics}
    write_json(layout.eval_result(stage, method), metrics)
    return metrics


def _evaluate_images(model, run_dir: str | Path) -> dict:
    """Top-1 accuracy, loss and confusion matrix of ``model`` on the test images."""
    import jax
    import numpy as np

    from data.images import load_image_rows
    from data.store import load_manifest
    from evals.vision import evaluate_classifier
    from training.functional import Functional

    fn, params = Functional.of(model)
    logits = jax.jit(lambda p, x: fn.module(p)(x))
    manifest = load_manifest(run_dir)
    out = evaluate_classifier(
        lambda x: np.asarray(logits(params, x)), load_image_rows(run_dir, "test"), int(manifest["num_classes"])
    )
    return {**out, "class_names": manifest["class_names"]}
