"""Evaluate a trained model: restore its Orbax checkpoint and run the held-out lm-eval tasks on it."""

from __future__ import annotations

from pathlib import Path

from configs.schema import ExperimentConfig
from data.store import load_heldout, load_tokenizer
from run.layout import RunLayout
from run.metrics import write_json
from training.checkpoint import load_into_model
from training.common import model_spec


def evaluate_method(cfg: ExperimentConfig, run_dir: str | Path, method: str, stage: str = "pretrain") -> dict:
    """Restore ``<stage>/<method>/checkpoints`` and run the held-out lm-eval tasks on it.

    Writes ``eval/<stage>/<method>.json`` (flat metrics) and lm-eval's full results and task files
    under ``eval/<stage>/<method>/``. Raises ``training.checkpoint.CheckpointError`` for a missing
    or incomplete checkpoint.
    """
    from evals.run_eval import evaluate_lm  # lm-eval import is slow; only pay it when evaluating

    layout = RunLayout(run_dir)
    model = model_spec(cfg, run_dir).init(cfg.seed)
    meta = load_into_model(layout.checkpoints(stage, method), model)
    metrics = evaluate_lm(model, load_tokenizer(run_dir), load_heldout(run_dir, "test"),
                          layout.eval_outputs(stage, method), cfg.eval, seed=cfg.seed, name="lm_eval")
    metrics = {"method": method, "stage": stage, "checkpoint_tokens": meta.get("tokens"), **metrics}
    write_json(layout.eval_result(stage, method), metrics)
    return metrics
