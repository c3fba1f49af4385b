"""The sweep flow: one pipeline run per cell of a grid of overrides, then one report across cells.

A sweep folder (``<sweep_root>/<name>``, or ``<name>-<UTC time>`` with ``resume: false``) is laid
out as :class:`run.layout.SweepLayout` says. **How cells run** (``launch``): ``subflow`` (the
default) runs each cell as a child flow run of ``pipeline`` from a ``sweep-cell`` task, in the
sweep's process (no work pool or worker needed); ``deployment`` runs each as a run of a pipeline
deployment (``run_deployment``, linked as a child run) by a worker of its pool: cells on several
machines, or isolated from each other's crashes. At most ``concurrency`` cells run at once, in grid
order (a ``ThreadPoolTaskRunner``), each holding a slot of the Prefect global concurrency limit
``sweep-<name>`` (:mod:`flows.slots`: a dead holder's slot comes back well within a minute).

**Resuming.** A cell is identified by its resolved config (:func:`configs.sweep.config_digest`); the
record is the cell's run directory itself, not a Prefect result cache: it sits beside the results it
vouches for and survives a new Prefect server. Which cells are skipped, run again (moved aside to
``attempts/`` first) or refused is :func:`flows.preflight._plan_cell`'s decision.
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import datetime as dt
import itertools
import json
import os
import shutil
import time
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.futures import as_completed
from prefect.states import Cancelled, Cancelling, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from configs.schema import ExperimentConfig
from configs.specs import load_spec
from configs.sweep import SweepSpec
from flows import run_logger
from flows.naming import sweep_run_name
from flows.pipeline import pipeline
from flows.preflight import PlannedCell, SweepPlan, sweep_preflight
from flows.slots import set_concurrency_limit, slot
from reports.artifacts import artifact_key, publish_comparison_artifacts
from run import atomic
from run.control import graceful_stop, stop_requested
from run.directory import read_status
from run.layout import SWEEP_RECORD as SWEEP_JSON, RunLayout, SweepLayout

__all__ = ["sweep", "sweep_cell", "limit_name"]


def limit_name(spec: SweepSpec) -> str:
    """The Prefect global concurrency limit of a sweep: ``sweep-<name>``."""
    return f"sweep-{spec.name}"


def _write_record(plan: SweepPlan, results: dict[str, dict]) -> None:
    atomic.write_json(SweepLayout(plan.sweep_dir).record, plan.record(results), newline=True, default=None)


def _run_through_deployment(deployment: str, parameters: dict, poll_s: float = 2.0):
    """Run ``deployment`` as a child of this task run: (final state, flow run id); cancelled on a stop signal."""
    flow_run = run_deployment(deployment, parameters=parameters, timeout=0)
    with get_client(sync_client=True) as client:
        cancelled = False
        while True:
            run = client.read_flow_run(flow_run.id)
            if run.state is not None and run.state.is_final():
                return run.state, str(run.id)
            if stop_requested() and not cancelled:
                run_logger().warning("stop: cancelling the cell's flow run %s", run.name)
                client.set_flow_run_state(run.id, Cancelling(message="the sweep was stopped"), force=True)
                cancelled = True
            if cancelled and (run.state is None or not run.state.is_running()):
                return client.read_flow_run(run.id).state, str(run.id)  # never started: nothing to wait for
            time.sleep(poll_s)


@task(name="sweep-cell", cache_policy=NO_CACHE, task_run_name="cell {name}")
def sweep_cell(
    name: str,
    config: ExperimentConfig,
    run_dir: str,
    launch: str,
    deployment: str,
    limit: str,
    dp_cache: str | None = None,
) -> dict:
    """Run one cell's pipeline while holding a slot of the global concurrency limit ``limit``;
    ``dp_cache``: the pipeline's shared DP results. Returns ``{"state": <Prefect state type>, "status":
    <the run's status.json status>, "reason", "wall_s" [s], "flow_run_id"}``; a failure is recorded,
    not raised, so the other cells go on."""
    logger = run_logger()
    with slot(limit) as held:
        if not held:
            return {"state": "NOT_STARTED", "status": None, "reason": "the sweep was stopped first"}
        t0 = time.perf_counter()
        logger.info("cell %s: %s in %s", name, launch, run_dir)
        if launch == "deployment":
            parameters = {"config": config.model_dump(mode="json"), "run_dir": run_dir, "dp_cache": dp_cache}
            state, run_id = _run_through_deployment(deployment, parameters)
        else:
            state = pipeline(config=config, run_dir=run_dir, dp_cache=dp_cache, return_state=True)
            run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        wall = time.perf_counter() - t0
    status = read_status(run_dir)
    out = {
        "state": state.type.value if state else "UNKNOWN",
        "status": status.get("status"),
        "reason": status.get("reason") or (state.message if state and not state.is_completed() else None),
        "wall_s": wall,
        "flow_run_id": run_id,
    }
    logger.info("cell %s: %s (%s) in %.0f s", name, out["status"], out["state"], wall)
    return out


@task(name="sweep-report", cache_policy=NO_CACHE)
def sweep_report(plan: SweepPlan, results: dict[str, dict]) -> dict:
    """The comparison across the cells that have a report (:func:`reports.compare.build_comparison`) in
    ``<sweep>/report/``, published as artifacts; a cell without a readable ``report/report.json`` is
    listed as "no results" (with a warning); ``{}`` (nothing written) when no cell has one."""
    from reports.compare import _read_run, build_comparison
    from reports.read import ReportInputError

    have, none, log = [], [], run_logger()
    for pc in plan.cells:
        why = "no report/report.json"
        try:
            if RunLayout(pc.run_dir).report_json.is_file():
                _read_run(pc.run_dir)
                why = None
        except ReportInputError as exc:  # corrupt or of another schema: shown, not fatal to the others
            why = str(exc)
        if why is None:
            have.append(pc)
            continue
        status = read_status(pc.run_dir) if pc.run_dir.is_dir() else {}
        none.append(
            {"label": pc.cell.name, "run_dir": str(pc.run_dir), "why": why}
            | {k: status.get(k) for k in ("status", "reason")}
        )
        state = status.get("status") or "no status.json"
        log.warning("sweep %s: cell %s has no results (%s); status %s", plan.spec.name, pc.cell.name, why, state)
    if not have:
        log.warning("sweep %s: no cell has results; no comparison written", plan.spec.name)
        return {}
    layout = SweepLayout(plan.sweep_dir)
    comparison = build_comparison(
        [pc.run_dir for pc in have],
        layout.report,
        axes=list(dict.fromkeys(k for pc in plan.cells for k in pc.cell.overrides)),
        labels=[pc.cell.name for pc in have],
        title=f"Sweep {plan.spec.name}",
        source=f"the sweep flow (`{layout.record}`)",
        no_results=none,
    )
    publish_comparison_artifacts(comparison, plan.spec.name)
    return comparison


def _run_cells(plan: SweepPlan, todo: list[PlannedCell], results: dict[str, dict]) -> None:
    """Run the cells ``todo`` in grid order; each result goes into ``results`` and ``sweep.json`` as it ends."""
    spec, limit = plan.spec, limit_name(plan.spec)
    set_concurrency_limit(limit, spec.concurrency)
    total, done = len(plan.cells), len(plan.cells) - len(todo)
    progress = create_progress_artifact(
        100.0 * done / max(total, 1),
        key=artifact_key("sweep-progress", spec.name),
        description=f"sweep {spec.name}: cells finished of {total}",
    )
    dp_cache = str(SweepLayout(plan.sweep_dir).dp_cache) if spec.reuse_dp else None
    with ThreadPoolTaskRunner(max_workers=spec.concurrency) as runner:
        shared = {"launch": spec.launch, "deployment": spec.deployment, "limit": limit, "dp_cache": dp_cache}
        cells = [{"name": pc.cell.name, "config": pc.cfg, "run_dir": str(pc.run_dir)} | shared for pc in todo]
        futures = {runner.submit(sweep_cell, cell): cell["name"] for cell in cells}
        for future in as_completed(list(futures)):
            name = futures[future]
            try:
                results[name] = {**future.result(), "skipped": False}
            except Exception as exc:  # the cell's own failure is recorded; the others go on
                status = read_status(SweepLayout(plan.sweep_dir).cell(name)).get("status")
                results[name] = {
                    "state": "FAILED",
                    "reason": f"{type(exc).__name__}: {exc}",
                    "skipped": False,
                    "status": status,
                }
            _write_record(plan, results)
            done += 1
            if progress is not None:
                update_progress_artifact(progress, 100.0 * done / max(total, 1))


@flow(name="sweep", flow_run_name=sweep_run_name, log_prints=True)
def sweep(
    spec: SweepSpec = load_spec("sweep", "tiny_grid"), sweep_file: str | None = None, sweep_dir: str | None = None
) -> str | State:
    """Run every cell of a sweep through the pipeline, then build the sweep's comparison report.

    Args:
        spec: the sweep, field by field (the UI form; :class:`configs.sweep.SweepSpec`).
        sweep_file: instead of ``spec``: a shipped sweep's name (``configs/sweeps/<name>.yaml``) or a YAML path.
        sweep_dir: the sweep's folder (default ``<sweep_root>/<name>``, or ``<name>-<UTC time>``
            when ``resume`` is false); an existing sweep folder is resumed.

    Returns the sweep folder (its report is ``report/comparison.md``). Raises
    ``ValueError``/``FileNotFoundError``/``ConnectionError`` from the checks, before anything is
    written. Ends ``Failed`` when a cell failed (the other cells run, the report covers the cells
    that have one) and ``Cancelled`` after a stop signal.
    """
    logger = run_logger()
    spec = load_spec("sweep", sweep_file, value=spec)
    plan = sweep_preflight(spec, sweep_dir)
    for warning in plan.warnings:
        logger.warning(warning)
    if stop_requested():
        return Cancelled(message="stopped before the sweep started; nothing was written")
    todo = [pc for pc in plan.cells if pc.action != "skip"]
    logger.info(
        f"sweep {spec.name}: {len(plan.cells)} cells ({len(todo)} to run, {len(plan.cells) - len(todo)} completed "
        f"before) in {plan.sweep_dir}; at most {spec.concurrency} at once ({spec.launch})"
    )
    prior = _prior_results(plan.sweep_dir, logger)
    skipped = {"status": "completed", "state": "COMPLETED", "skipped": True}
    results = {pc.cell.name: prior.get(pc.cell.name, {}) | skipped for pc in plan.cells if pc.action == "skip"}
    with graceful_stop():
        attempts = SweepLayout(plan.sweep_dir).attempts
        plan.sweep_dir.mkdir(parents=True, exist_ok=True)
        for pc in (pc for pc in todo if pc.action == "rerun"):
            attempts.mkdir(parents=True, exist_ok=True)
            moved = next(t for n in itertools.count(1) if not (t := attempts / f"{pc.cell.name}-{n}").exists())
            shutil.move(str(pc.run_dir), str(moved))
            logger.info("cell %s: the earlier attempt (%s) moved to %s", pc.cell.name, pc.previous, moved)
        _write_record(plan, results)
        _run_cells(plan, todo, results)
        comparison = sweep_report(plan, results)
    report = SweepLayout(plan.sweep_dir).comparison_md
    failed = [n for n, r in results.items() if r.get("status") != "completed" and r.get("state") != "NOT_STARTED"]
    if comparison:
        logger.info("sweep report: %s", report)
    if stop_requested():
        n = sum(r.get("status") == "completed" for r in results.values())
        return Cancelled(
            message=f"stopped: cells completed: {n} of {len(plan.cells)}; re-run the sweep to resume ({plan.sweep_dir})"
        )
    if failed:
        return Failed(
            message=f"{len(failed)} of {len(plan.cells)} cells did not complete: "
            + "; ".join(f"{n}: {results[n].get('reason') or results[n].get('status')}" for n in failed)
            + f" (report of the others: {report})"
        )
    return str(plan.sweep_dir)


def _prior_results(sweep_dir: Path, logger=None) -> dict[str, dict]:
    """Each cell's earlier results; a ``sweep.json`` that is not a sweep record is kept aside, with a warning."""
    path = SweepLayout(sweep_dir).record
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        cells = record["cells"] if isinstance(record, dict) and isinstance(record.get("cells"), list) else None
        ok = cells is not None and all(isinstance(c, dict) and "name" in c for c in cells)
        problem = None if ok else "no list of cells with names"
    except (ValueError, UnicodeDecodeError):
        problem = "not valid JSON"
    if problem is None:
        return {c["name"]: {k: c[k] for k in ("wall_s", "flow_run_id") if k in c} for c in cells}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    names = (f"{SWEEP_JSON}.corrupt-{stamp}" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
    kept = next(k for name in names if not (k := path.with_name(name)).exists())
    os.replace(path, kept)
    (logger or run_logger()).warning(
        "%s is not a sweep record (%s); kept as %s, and a new record is written", path, problem, kept.name
    )
    return {}
