"""Fine-tuning as Prefect tasks: the task's items, one fine-tuning per method, its evaluation.

Thin wrappers: the plain code is ``data.finetune`` and ``training.finetune``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig
from run.layout import RunLayout


def finetune_task_name(parameters: dict) -> str:
    """``finetune-<method>-seed<s>`` (``-seeds<s>-<t>…`` for a recipe of several seeds): Prefect's
    ``task_run_name`` callable, given the task's parameters."""
    p = parameters or {}
    seeds = list(getattr(getattr(p.get("cfg"), "finetune", None), "seeds", None) or [])
    which = f"seed{seeds[0]}" if len(seeds) == 1 else "seeds" + "-".join(map(str, seeds))
    return f"finetune-{p.get('method', 'model')}-{which}"


@task(name="finetune-data", task_run_name="finetune-data", cache_policy=NO_CACHE)
def finetune_data_task(cfg: ExperimentConfig, run_dir: str) -> dict:
    from data.finetune import prepare_finetune_data

    task_info = prepare_finetune_data(
        cfg.finetune, cfg.finetune_task, cfg.data, run_dir, RunLayout(run_dir).finetune_data
    )
    get_run_logger().info(
        "fine-tuning task %s: %d train, %d test items%s",
        task_info["name"],
        task_info["train_items"],
        task_info["test_items"],
        "".join(f"; {k}: {v:.3f}" for k, v in task_info.get("baselines", {}).items()),
    )
    return task_info


@task(name="finetune", task_run_name=finetune_task_name, cache_policy=NO_CACHE)
def finetune_task(
    cfg: ExperimentConfig, run_dir: str, method: str, task_info: dict, checkpoint: str | None = None
) -> dict:
    """Fine-tune ``method`` once per seed of the recipe (``training.finetune.finetune_method``)."""
    from training.finetune import finetune_method

    summary = finetune_method(cfg, run_dir, method, task_info, Path(checkpoint) if checkpoint else None)
    log = get_run_logger()
    for r in summary["runs"]:
        log.info(
            "finetune %s seed %d: %d steps in %.1f s, train loss %.4f, test loss %.4f",
            method,
            r["seed"],
            r["steps"],
            r["wall_s"],
            r["final_train_loss"],
            r["final_val_loss"],
        )
    return summary


@task(name="evaluate-finetune", task_run_name="evaluate-finetune-{method}", cache_policy=NO_CACHE, log_prints=False)
def evaluate_finetune_task(
    cfg: ExperimentConfig, run_dir: str, method: str, task_info: dict, checkpoint: str | None = None
) -> dict:
    """Score ``method`` on the task before and after fine-tuning (``training.finetune.evaluate_finetune``)."""
    from training.finetune import FinetunePlan, evaluate_finetune

    result = evaluate_finetune(
        FinetunePlan.of(cfg), run_dir, method, task_info, Path(checkpoint) if checkpoint else None
    )
    primary = result["task"]["primary"]
    after = [r["metrics"][primary] for r in result["finetuned"]]
    get_run_logger().info(
        "finetune %s %s: pretrained %.3f -> fine-tuned %s",
        method,
        primary,
        result["pretrained"]["metrics"][primary],
        ", ".join(f"{a:.3f}" for a in after),
    )
    return result
