"""Evaluation and report tasks: lm-eval on a trained model's checkpoint; the run's report.

Thin wrappers: the plain code is ``training.evaluate_checkpoint`` and ``reports``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig
from training.evaluate_checkpoint import evaluate_method


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(cfg: ExperimentConfig, run_dir: Path, method: str, stage: str = "pretrain") -> dict:
    metrics = evaluate_method(cfg, run_dir, method, stage)
    logger = get_run_logger()
    logger.info("eval %s %s: %s", stage, method, {k: v for k, v in metrics.items() if isinstance(v, float)})
    if metrics.get("truncated_requests"):
        logger.warning(
            "eval %s: %d requests had their context cut to fit the model's window",
            method,
            metrics["truncated_requests"],
        )
    return metrics


@task(name="report", cache_policy=NO_CACHE)
def report_task(run_dir: Path, final_stage: bool = True) -> dict:
    """Build the report (``final_stage``: as the pipeline's last stage, before its status is final)."""
    from reports import build_report
    from reports.artifacts import publish_report_artifacts
    from sim.study import simulate_goodput

    report = build_report(Path(run_dir), final_stage=final_stage, predict=simulate_goodput)
    publish_report_artifacts(report, Path(run_dir))
    return report
