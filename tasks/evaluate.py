"""Evaluation task: load a method's Orbax checkpoint and run lm-eval on the held-out test plays."""

from __future__ import annotations

from pathlib import Path

from flax import nnx
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig
from models import build_model
from models.checkpoint import load_into_model
from tasks.data import load_heldout, load_manifest, load_tokenizer
from tasks.metrics import write_json


def evaluate_method(cfg: ExperimentConfig, run_dir: Path, method: str) -> dict:
    """Restore ``checkpoints/<method>`` and run the held-out lm-eval tasks on it.

    Writes ``eval/<method>.json`` (flat metrics) and ``eval/lm_eval_<method>.json`` (lm-eval's
    full results). Raises ``models.checkpoint.CheckpointError`` for a missing or incomplete
    checkpoint.
    """
    from evals.run_eval import evaluate_lm  # lm-eval import is slow; only pay it when evaluating

    run_dir = Path(run_dir)
    manifest = load_manifest(run_dir)
    model = build_model(cfg.model, int(manifest["vocab_size"]), cfg.data.seq_len, nnx.Rngs(cfg.seed))
    meta = load_into_model(run_dir / "checkpoints" / method, model)
    metrics = evaluate_lm(model, load_tokenizer(run_dir), load_heldout(run_dir, "test"), run_dir / "eval",
                          cfg.eval, seed=cfg.seed, name=f"lm_eval_{method}")
    metrics = {"method": method, "checkpoint_tokens": meta.get("tokens"), **metrics}
    write_json(run_dir / "eval" / f"{method}.json", metrics)
    return metrics


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(cfg: ExperimentConfig, run_dir: Path, method: str) -> dict:
    metrics = evaluate_method(cfg, run_dir, method)
    logger = get_run_logger()
    logger.info("eval %s: %s", method, {k: v for k, v in metrics.items() if isinstance(v, float)})
    if metrics.get("truncated_requests"):
        logger.warning("eval %s: %d requests had their context cut to fit the model's window",
                       method, metrics["truncated_requests"])
    return metrics


@task(name="report", cache_policy=NO_CACHE)
def report_task(run_dir: Path) -> dict:
    from evals.report import build_report
    from evals.report_artifacts import publish_report_artifacts

    report = build_report(Path(run_dir))
    publish_report_artifacts(report, Path(run_dir))
    return report
