"""The pipeline flow: shard → pretrain (Decoupled DiLoCo, DP) → evaluate → fine-tune → report.

The run's state is recorded in ``RUN/status.json`` after every stage (``run.directory``):
``running`` with the stages completed so far, then ``completed``, ``interrupted`` (SIGTERM or
SIGINT: the current stage stops at its next step boundary and saves, the report is built from what
was done, later stages are skipped) or ``failed`` (with the reason).
"""

# No `from __future__ import annotations` here: Prefect validates flow parameters from the annotations,
# and `flow.serve()` cloudpickles the flow by value, keeping only the globals its body uses: string
# annotations then cannot be resolved there and every run is refused (tests/test_deployments.py).

import contextlib
import fcntl
import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.exceptions import FailedRun
from prefect.states import Cancelled, Failed, State

from configs.schema import ExperimentConfig
from configs.specs import load_spec
from configs.sweep import dp_digest, dp_eval_digest
from flows.finetune import run_finetune_stage
from flows.naming import pipeline_run_name, rename_flow_run
from flows.preflight import finetune_preflight, preflight
from flows.pretrain import dropped_reasons, pretrain_diloco, pretrain_dp
from run import atomic
from run.control import graceful_stop, stop_requested, stop_signal
from run.directory import claim_run_dir, link_or_copy, write_status
from run.layout import DPCacheLayout, RunLayout
from tasks.evaluate import evaluate_task, report_task
from tasks.shard import shard_data_task

__all__ = ["pipeline", "preflight", "make_run_dir"]


def make_run_dir(cfg: ExperimentConfig, path: Path) -> Path:
    """Claim the (checked) run directory and write the resolved config and a ``running`` status.
    Raises ``FileExistsError`` when another run claimed it since the check."""
    claim_run_dir(path)
    atomic.write_text(RunLayout(path).config, json.dumps(cfg.model_dump(mode="json"), indent=2))
    write_status(path, "running", [])
    return path


def _short_stage(rd: Path, name: str) -> dict | None:
    """The summary of pretraining stage ``name`` when it failed short of its budget, else None."""
    if not name.startswith("pretrain-"):
        return None
    path = RunLayout(rd).summary("pretrain", name.removeprefix("pretrain-"))
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if (summary.get("budget") or {}).get("status") == "short" else None


@contextlib.contextmanager
def _locked(lock: Path):
    """Hold an exclusive ``flock`` on ``lock`` (created with its folder) for the block."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _pretrain_dp_once(cfg: ExperimentConfig, rd: Path, cache: str | None) -> dict:
    """DP's stage: trained (and stored in ``cache``), or copied from ``cache``'s result of the same DP settings."""
    if cache is None:
        return pretrain_dp(cfg, str(rd))
    key, layout, dp_cache = dp_digest(cfg), RunLayout(rd), DPCacheLayout(Path(cache).expanduser().absolute())
    path, entry, mine = (
        layout.summary("pretrain", "dp"),
        dp_cache.trained(key),
        Path(layout.method_dir("pretrain", "dp")),
    )
    with _locked(dp_cache.lock(key)):
        if dp_cache.trained_summary(key).is_file():
            shutil.copytree(entry, mine, copy_function=link_or_copy)
            summary = {**json.loads(path.read_text()), "reused_from": str(entry)}
            atomic.write_json(path, summary)  # a new file
            msg = "dp: reused the result of the same DP settings from %s (final held-out loss %.4f)"
            get_run_logger().info(msg, entry, summary.get("final_val_loss"))
            return summary
        summary = pretrain_dp(cfg, str(rd))
        if (summary.get("budget") or {}).get("status") == "complete" and not summary.get("interrupted"):
            with atomic.folder(entry) as tmp:  # (replaces an entry without its summary: a copy cut short)
                shutil.copytree(mine, tmp, copy_function=link_or_copy, dirs_exist_ok=True)
        return summary


def _evaluate_dp_once(cfg: ExperimentConfig, rd: Path, cache: str | None) -> dict:
    """DP's evaluation, or, when this run's DP result is ``cache``'s, its evaluation of the same ``eval`` copied in."""
    if cache is None:
        return evaluate_task(cfg, rd, "dp")
    dp_cache, layout, dp_key = DPCacheLayout(Path(cache).expanduser().absolute()), RunLayout(rd), dp_digest(cfg)
    key = dp_eval_digest(dp_key, cfg.eval)
    entry, mine = dp_cache.evaluation(key), layout.summary("pretrain", "dp")
    flat, outputs = layout.eval_result("pretrain", "dp"), layout.eval_outputs("pretrain", "dp")
    cached_flat, cached_outputs = dp_cache.evaluation_result(key), dp_cache.evaluation_outputs(key)
    try:  # this run's DP is the cache's: copied from it, or the training stored there (hard links)
        same_dp = json.loads(mine.read_text()).get("reused_from") == str(dp_cache.trained(dp_key))
        stored = same_dp or os.path.samefile(mine, dp_cache.trained_summary(dp_key))
    except (OSError, ValueError):
        same_dp = stored = False
    with _locked(dp_cache.evaluation_lock(key)):
        if same_dp and cached_flat.is_file():
            if cached_outputs.is_dir():
                shutil.copytree(cached_outputs, outputs, copy_function=link_or_copy, dirs_exist_ok=True)
            metrics = {**json.loads(cached_flat.read_text()), "reused_from": str(entry)}
            atomic.write_json(flat, metrics)
            get_run_logger().info("eval dp: reused the evaluation of the same DP result from %s", entry)
            return metrics
        metrics = evaluate_task(cfg, rd, "dp")
        if stored:
            with atomic.folder(entry) as tmp:  # the entry's files, under their names in the cache
                if outputs.is_dir():
                    shutil.copytree(outputs, tmp / cached_outputs.name, copy_function=link_or_copy)
                link_or_copy(str(flat), str(tmp / cached_flat.name))
        return metrics


def _run_problem(results: dict[str, Any]) -> str | None:
    """The reason to fail a run (short budget, divergence, too much work lost), else None."""
    for stage in ("pretrain-diloco", "pretrain-dp"):
        budget = (results.get(stage) or {}).get("budget") or {}
        if budget.get("status") == "short":
            return f"{stage} {budget['line']}"
    for stage in ("pretrain-diloco", "pretrain-dp"):
        loss = (results.get(stage) or {}).get("final_val_loss")
        if loss is not None and not math.isfinite(loss):
            return f"{stage}: the final held-out loss is {loss} (training diverged); the report is written"
    lost = (results.get("pretrain-diloco") or {}).get("work_lost") or {}
    if lost.get("status") != "failed":
        return None
    return (
        f"the syncer dropped {100 * lost['dropped_fraction']:.1f} % of the learners' processed tokens "
        f"({lost['dropped_tokens']:,} of {lost['processed_tokens']:,}; reasons: {dropped_reasons(lost)}), "
        f"above diloco.max_dropped_fraction = {lost['fail_above']}; the report is written, see its top"
    )


def _train_and_report(cfg: ExperimentConfig, rd: Path, dp_cache: str | None, stages: list[str]) -> str | None:
    """One seed's stages after the data, then the report; returns the reason to fail the run, or None."""
    steps = [("pretrain-diloco", lambda: pretrain_diloco(cfg, str(rd)))] if cfg.diloco.enabled else []
    if cfg.dp.enabled:
        steps.append(("pretrain-dp", lambda: _pretrain_dp_once(cfg, rd, dp_cache)))
    if cfg.eval.enabled and cfg.diloco.enabled:
        steps.append(("eval-diloco", lambda: evaluate_task(cfg, rd, "diloco")))
    if cfg.eval.enabled and cfg.dp.enabled:
        steps.append(("eval-dp", lambda: _evaluate_dp_once(cfg, rd, dp_cache)))
    if cfg.finetune.enabled:  # the finetune flow's stage, on every pretrained model
        steps.append(("finetune", lambda: run_finetune_stage(finetune_preflight(str(rd)))))
    results: dict[str, Any] = {}
    for name, step in steps:
        if stop_requested():
            break
        write_status(rd, "running", stages)
        try:
            results[name] = step()
        except FailedRun:
            short = _short_stage(rd, name)
            if short is None:
                raise
            results[name] = short  # trained short of its budget: the run fails after the report
            break
        if (results[name] or {}).get("interrupted"):  # stopped part-way: not complete
            break
        stages.append(name)
    return _report(rd, stages, None if stop_requested() else _run_problem(results))


def _report(rd: Path, stages: list[str], problem: str | None) -> str | None:
    """Record the run's state so far, build the report of what was done and return ``problem``."""
    if stop_requested():
        write_status(rd, "interrupted", stages, _signal_reason())
    else:
        write_status(rd, "failed" if problem else "running", stages, problem)
    report_task(rd)
    stages.append("report")
    return problem


@flow(name="pipeline-seed", flow_run_name="seed-{seed}", log_prints=True)
def seed_run(config: ExperimentConfig, seed: int, run_dir: str, data_dir: str, dp_cache: str | None = None) -> dict:
    """One seed of a run of several seeds, a child flow run of the pipeline: ``run_dir``
    (``RUN/seeds/seed-<seed>``) becomes a whole run directory of ``config`` with ``seed`` set, its data
    hard links to ``data_dir``. Returns ``{"seed", "status", "problem"}``; raises what a stage raises."""
    cfg, rd = config.for_seed(seed), Path(run_dir)
    make_run_dir(cfg, rd)
    shutil.copytree(data_dir, RunLayout(rd).data, copy_function=link_or_copy)
    stages = ["data"]
    try:
        problem = _train_and_report(cfg, rd, dp_cache, stages)
    except BaseException as exc:
        if not stop_requested():
            write_status(rd, "failed", stages, f"{type(exc).__name__}: {exc}")
        raise
    status = "interrupted" if stop_requested() else ("failed" if problem else "completed")
    write_status(rd, status, stages, _signal_reason() if status == "interrupted" else problem)
    return {"seed": seed, "status": status, "problem": problem}


def _train_seeds(cfg: ExperimentConfig, rd: Path, dp_cache: str | None, stages: list[str]) -> str | None:
    """Every seed in turn (:func:`seed_run`), then the report over seeds; returns the reasons to fail, or None."""
    layout, problems = RunLayout(rd), []
    for seed in cfg.run_seeds:
        if stop_requested():
            break
        write_status(rd, "running", stages)
        seed_dir, data = str(layout.seed_run(seed)), str(layout.data)
        out = seed_run(config=cfg, seed=seed, run_dir=seed_dir, data_dir=data, dp_cache=dp_cache)
        if out["status"] == "completed":
            stages.append(f"seed-{seed}")
        elif out["problem"]:
            problems.append(f"seed {seed}: {out['problem']}")
    return _report(rd, stages, None if stop_requested() or not problems else "; ".join(problems))


@flow(name="pipeline", flow_run_name=pipeline_run_name, log_prints=True)
def pipeline(
    config: ExperimentConfig = ExperimentConfig(),
    config_file: str | None = None,
    # a plain dict, never mutated: the UI form gives it a JSON editor (an Optional dict has none)
    overrides: dict[str, Any] = {},  # noqa: B006
    run_dir: str | None = None,
    dp_cache: str | None = None,
) -> str | State:
    """Run the whole experiment and return the run directory (the report is in ``report/``): shard,
    pretrain DiLoCo and DP, evaluate both, fine-tune both (``flows.finetune``), report. With two or more
    ``seeds`` the data is sharded once and each seed runs as a child flow run (``pipeline-seed``) into
    ``RUN/seeds/seed-<s>/``, a whole run directory each; the top report is the verdict over seeds
    (``reports.seeds``: means, 95 % intervals, the paired gap DiLoCo − DP).

    Args:
        config: the experiment, field by field (the UI form).
        config_file: instead of ``config``: a shipped config's name (``default``, ``tiny``, …) or a YAML path.
        overrides: dotted keys applied last, e.g. ``{"diloco.learners": 8}``.
        run_dir: where to write (default ``<run_root>/<name>-<UTC time>``); it must not hold a run.
        dp_cache: a folder of DP results shared by runs (a sweep's ``dp/``): a result of the same DP
            settings there is copied instead of trained, and one trained here is stored there.

    Raises ``ValueError``/``FileNotFoundError``/``ConnectionError`` from the checks (before anything
    is written). Ends ``Cancelled`` after a stop signal and ``Failed`` when the run lost more work than
    ``diloco.max_dropped_fraction``, diverged, or a pretraining stage trained less than its budget
    because its workers were gone (later stages are skipped); calling the flow then raises Prefect's
    ``CancelledRun`` / ``FailedRun`` with the one-line reason. The report is written either way.
    """
    logger = get_run_logger()
    cfg = load_spec("config", config_file, overrides, value=config)
    seeds = cfg.run_seeds
    if len(seeds) == 1:
        cfg = cfg.for_seed(seeds[0])
    rd = preflight(cfg, run_dir)
    rename_flow_run(rd.name)  # the run directory's name: what `ls runs/` and the report call this run
    if stop_requested():  # a signal while Prefect started: nothing was written, nothing to save
        return Cancelled(message=f"stopped before the run started: {_signal_reason()}; nothing was written")
    created = not rd.exists()
    stages: list[str] = []
    with graceful_stop():
        make_run_dir(cfg, rd)
        logger.info("run directory: %s", rd)
        from training.mesh import backend_line  # (JAX has started: the preflight asked for its devices)

        logger.info("backend: %s; precision: %s", backend_line(), cfg.precision.describe())
        logger.info("derived: %s", ", ".join(f"{k} {v}" for k, v in cfg.derived().items()))
        try:
            try:
                manifest = shard_data_task(cfg, rd)
            except BaseException:
                if created and not stop_requested():  # the data step writes nothing partial
                    shutil.rmtree(rd, ignore_errors=True)
                raise
            stages.append("data")
            m, train = manifest, manifest["splits"]["train"]
            logger.info(
                f"data: {train['images']:,} train images of {'×'.join(map(str, m['image_shape']))} in "
                f"{m['num_classes']} classes, {len(m['shards'])} shards"
                if m.get("modality") == "image"
                else f"data: {train['tokens']:,} train tokens, {len(m['shards'])} shards, vocab {m['vocab_size']}"
            )
            problem = (_train_and_report if len(seeds) == 1 else _train_seeds)(cfg, rd, dp_cache, stages)
        except BaseException as exc:
            if stop_requested():
                return _interrupted(rd, stages)
            write_status(rd, "failed", stages, f"{type(exc).__name__}: {exc}")
            raise
        if stop_requested():
            return _interrupted(rd, stages)
        if problem:
            write_status(rd, "failed", stages, problem)
            return Failed(message=problem)
        write_status(rd, "completed", stages)
    logger.info("report: %s", RunLayout(rd).report / "report.md")
    return str(rd)


def _signal_reason() -> str:
    return f"{signal.Signals(stop_signal() or signal.SIGTERM).name} received"


def _interrupted(rd: Path, stages: list[str]) -> State:
    reason = _signal_reason()
    write_status(rd, "interrupted", stages, reason)
    done = ", ".join(stages) or "none"
    return Cancelled(message=f"stopped: {reason}; completed stages: {done} (recorded in {rd / 'status.json'})")
