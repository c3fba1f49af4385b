"""Evaluation and report tasks: lm-eval on a trained model's checkpoint; the run's report.

Thin wrappers: the plain code is ``training.evaluate_checkpoint`` and ``reports``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig
from training.evaluate_checkpoint import evaluate_method


@task(name="evaluate", task_run_name="evaluate-{stage}-{method}", cache_policy=NO_CACHE, log_prints=False)
def evaluate_task(cfg: ExperimentConfig, run_dir: Path, method: str, stage: str = "pretrain") -> dict:
    metrics = evaluate_method(cfg, run_dir, method, stage)
    # one line (the window warning, if any, came from evals.run_eval already)
    get_run_logger().info("eval %s %s: %s", stage, method, metrics_line(metrics))
    return metrics


SKIPPED = ("word_perplexity", "chance", "eval_s", "checkpoint_tokens", "truncated_requests", "passages", "questions")


def metrics_line(metrics: dict) -> str:
    """An evaluation's figures in one line: each float metric (``word_perplexity``, which spans
    orders of magnitude on tiny models, counts and timings left out) with ``± stderr`` when lm-eval
    gives one, 4 significant digits, then the seconds it took; e.g. ``heldout_ppl/bits_per_byte 3.962
    ± 0.06192, heldout_nextline/acc 0.25 ± 0.1637 (chance 0.25); 3.5 s``."""
    parts = []
    for k, v in metrics.items():
        if not isinstance(v, float) or k.endswith("_stderr") or any(k.endswith(x) for x in SKIPPED):
            continue
        text = f"{k} {v:.4g}"
        if isinstance(metrics.get(f"{k}_stderr"), float):
            text += f" ± {metrics[f'{k}_stderr']:.4g}"
        chance = metrics.get(k.rsplit("/", 1)[0] + "/chance") if k.endswith("/acc") else None
        if isinstance(chance, float):
            text += f" (chance {chance:.4g})"
        parts.append(text)
    took = metrics.get("eval_s")
    return ", ".join(parts) + (f"; {took:.1f} s" if isinstance(took, float) else "")


@task(name="report", task_run_name="report", cache_policy=NO_CACHE)
def report_task(run_dir: Path, final_stage: bool = True) -> dict:
    """Build the report (``final_stage``: as the pipeline's last stage, before its status is final)."""
    from reports import build_report
    from reports.artifacts import publish_report_artifacts
    from sim.study import simulate_goodput

    report = build_report(Path(run_dir), final_stage=final_stage, predict=simulate_goodput)
    publish_report_artifacts(report, Path(run_dir))
    _track_hparams(Path(run_dir), report)
    return report


def _track_hparams(run_dir: Path, report: dict) -> None:
    """The run's settings and headline figures to TensorBoard's HParams tab (``RUN/tensorboard/``),
    when ``tracking.tensorboard``; a failure is a warning, never the report's."""
    import json

    from configs.load import stored_config
    from run.layout import RunLayout
    from training.tracking import report_figures, run_hparams

    try:
        cfg = stored_config(json.loads(RunLayout(run_dir).config.read_text()))
        run_hparams(cfg.tracking, cfg.model_dump(mode="json"), run_dir, report_figures(report))
    except Exception as exc:  # noqa: BLE001 - tracking never fails a stage
        get_run_logger().warning("TensorBoard HParams not written for %s: %s: %s", run_dir, type(exc).__name__, exc)
