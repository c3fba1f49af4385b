"""Pretraining as Prefect tasks: M retryable learner tasks, one syncer task, the DP trainer.

Thin wrappers: the plain code is ``training.decoupled`` and ``training.dp``. A learner task takes only
plain, serialisable inputs (the config, the run directory, the learner index); its attempt number
comes from Prefect. Retries are set from the config (``diloco.learner_retries``, ``retry_delay_s``;
the syncer's ``diloco.syncer_retries`` with the fsspec exchange) by the flow with ``with_options``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig
from run.atomic import write_json
from run.layout import RunLayout
from training.decoupled.setup import learner_attempt, open_syncer
from training.decoupled.syncer import run_syncer_to_end, syncer_retryable
from training.dp import train_dp
from training.dp_job import run_agent
from training.learner_process import learner_in_datacenter


@task(name="learner", task_run_name="learner-{learner}", cache_policy=NO_CACHE, log_prints=False)
def learner_task(config: ExperimentConfig, run_dir: str, learner: int) -> dict:
    """Learner ``learner``: a retry resumes from its saved resume point and the current global
    fragments (``diloco.learner``). Under ``network.emulate`` it runs as a process in its datacenter,
    which this task starts and waits for."""
    from prefect.runtime import task_run

    attempt = int(task_run.run_count or 1)
    logger = get_run_logger()
    if attempt > 1:
        logger.warning(
            "learner %d: attempt %d, rejoining from its resume point and the syncer's global fragments",
            learner,
            attempt,
        )
    if config.network.emulate:  # a process in its datacenter (training.learner_process)
        out = learner_in_datacenter(run_dir, learner, attempt)
    else:
        out = learner_attempt(config, run_dir, learner, attempt)
    logger.info("learner %d done: %d steps, %d tokens", learner, out["steps"], out["tokens"])
    return out


def retry_syncer(task, task_run, state) -> bool:
    """Prefect's retry condition for the syncer: retry anything but a lost office (another syncer
    took over: retrying would fight it) and a journal that does not replay (a retry replays it the
    same way)."""
    try:
        state.result()
    except BaseException as exc:
        return syncer_retryable(exc)
    return False


@task(name="syncer", task_run_name="syncer", cache_policy=NO_CACHE)
def syncer_task(config: ExperimentConfig, run_dir: str) -> dict:
    """The syncer: opens the run's exchange (``training.decoupled.setup.open_syncer``; with the in-process
    exchange it must run in the flow's process), runs until the flow marks every learner done,
    then saves Θ and the outer state and returns the summary. With the fsspec exchange the flow
    gives it retries (``diloco.syncer_retries``): a retry takes office and resumes from the syncer's
    checkpoint and journal. After each held-out evaluation of Θ it refreshes the live chart
    (``reports.artifacts.publish_live_chart``)."""
    from prefect.runtime import task_run

    attempt = int(task_run.run_count or 1)
    if attempt > 1:
        get_run_logger().warning("syncer: attempt %d, resuming from its checkpoint and journal", attempt)
    run = open_syncer(config, run_dir, attempt)
    from reports.artifacts import publish_live_chart

    try:
        # the live chart after each evaluation of Θ (in this task run: the UI opens task-run artifacts)
        return run_syncer_to_end(run, on_evaluated=lambda: publish_live_chart(run_dir, config.name, config.unit))
    finally:
        run.close_logs()


def dp_progress(run_dir: str, name: str, unit: str):
    """The DP job's reporter, ``progress(tokens, total, train_loss, heldout_loss)``: a progress line,
    the ``dp-progress`` progress artifact (%) and the live chart (``reports.artifacts.publish_live_chart``)
    of the run ``name`` whose budget counts ``unit`` (tokens, or images)."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from reports.artifacts import artifact_key, publish_live_chart, run_slug
    from run.progress import Progress, report as report_progress

    logger = get_run_logger()
    progress_id = create_progress_artifact(
        0.0, key=artifact_key("dp-progress", run_slug(run_dir)), description=f"DP {unit} (%)"
    )

    def progress(tokens, total, loss, val):
        logger.info(
            f"dp: {unit} %s/%s (%.0f%%)  train loss %.3f  held-out loss %.3f",
            f"{tokens:,}",
            f"{total:,}",
            100 * tokens / total,
            loss,
            val,
        )
        update_progress_artifact(progress_id, 100.0 * tokens / total)
        report_progress(Progress("dp", int(tokens), int(total), unit, train_loss=loss, heldout_loss=val))
        publish_live_chart(run_dir, name, unit)  # DP beside DiLoCo, as its progress lines do

    return progress


@task(name="dp-trainer", task_run_name="dp-trainer", cache_policy=NO_CACHE)
def dp_task(config: ExperimentConfig, run_dir: str) -> dict:
    """The DP baseline in this process (``training.dp.train_dp``, ``dp.hosts`` 1); writes its summary.
    At each evaluation, :func:`dp_progress`."""
    summary = train_dp(config, Path(run_dir), dp_progress(run_dir, config.name, config.unit))
    write_json(RunLayout(run_dir).summary("pretrain", "dp"), summary)
    return summary


@task(name="dp-host", task_run_name="dp-host-{rank}-gen-{generation}", cache_policy=NO_CACHE)
def dp_host_task(run_dir: str, rank: int, generation: int) -> dict:
    """Host ``rank`` of generation ``generation`` of a DP job of several hosts: its process, started and
    watched where this task runs (``training.dp_job.run_agent``); reports how it ended, never raises
    for it (the job's launcher decides: ``flows.dp_hosts``)."""
    return run_agent(run_dir, rank, generation)
