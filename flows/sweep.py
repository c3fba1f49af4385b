"""The sweep flow: one pipeline run per cell of a grid of overrides, then one report across cells.

A sweep folder (``<sweep_root>/<name>``, or ``<name>-<UTC time>`` with ``resume: false``) is laid
out as :class:`run.layout.SweepLayout` says: ``sweep.json``, ``cells/<cell>/`` (a whole pipeline run
each), ``attempts/``, ``dp/`` and ``report/`` (``reports.compare``).

**How cells run** (``launch``):

* ``subflow`` (the default): each cell is a child flow run of the ``pipeline`` flow, called from a
  ``sweep-cell`` task of the sweep's own flow run, in the sweep's process. It needs no work pool or
  worker, so ``ddiloco sweep`` runs anywhere; the UI shows each cell as a flow run nested under
  its task, with the pipeline's learner and syncer tasks inside.
* ``deployment``: each cell is a run of a pipeline deployment (``run_deployment``, linked as a
  child run), executed by a worker of that deployment's pool in a process of its own: cells on
  several machines, or isolated from each other's crashes.

Either way at most ``concurrency`` cells run at once, taken in grid order by a Prefect
``ThreadPoolTaskRunner`` of that many threads, and each ``sweep-cell`` task holds a slot of the
Prefect global concurrency limit ``sweep-<name>`` (created, or updated to ``concurrency``, when the
sweep starts) while its cell runs, so sweeps of one name share the limit, wherever they run. A
slot whose holder died (a process killed, a machine gone) comes back well within a minute, on a
persistent server too: the holder renews its lease and a heartbeat record every few seconds, and
a cell waiting for a slot releases the leases whose heartbeat stopped (:mod:`flows.slots`).

**Resuming.** A cell is identified by its resolved config (:func:`configs.sweep.config_digest`); the
record is the cell's run directory itself, not a Prefect result cache: it sits beside the results it
vouches for, survives a new Prefect server or database, and cannot point at results that were
deleted. Which cells are skipped, run again (moved aside to ``attempts/`` first) or refused is
:func:`flows.preflight._plan_cell`'s decision.
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import datetime as dt
import json
import os
import shutil
import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.states import Cancelled, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from configs.schema import ExperimentConfig
from configs.specs import load_spec
from configs.sweep import SweepSpec
from flows import run_logger
from flows.naming import sweep_run_name
from flows.preflight import PlannedCell, SweepPlan, sweep_preflight
from flows.slots import set_concurrency_limit, slot
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


def _move_aside(pc: PlannedCell, sweep_dir: Path) -> Path:
    attempts = SweepLayout(sweep_dir).attempts
    attempts.mkdir(parents=True, exist_ok=True)
    n = 1
    while (attempts / f"{pc.cell.name}-{n}").exists():
        n += 1
    target = attempts / f"{pc.cell.name}-{n}"
    shutil.move(str(pc.run_dir), str(target))
    return target


def _run_through_deployment(deployment: str, parameters: dict, poll_s: float = 2.0):
    """Start a run of ``deployment`` (a child of this task run) and wait for its final state; on a stop
    signal ask it to cancel and return. Returns (state, flow run id)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

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
    ``dp_cache``: the sweep's shared DP results (the pipeline's ``dp_cache``: DP trained once per
    DP setting).

    Returns ``{"state": <Prefect state type>, "status": <the run's status.json status>, "reason",
    "wall_s" [s], "flow_run_id"}``; a cell that fails is recorded, not raised, so the other cells
    go on.
    """
    logger = run_logger()
    with slot(limit) as held:
        if not held:
            return {"state": "NOT_STARTED", "status": None, "reason": "the sweep was stopped first"}
        t0 = time.perf_counter()
        logger.info("cell %s: %s in %s", name, launch, run_dir)
        if launch == "deployment":
            state, run_id = _run_through_deployment(
                deployment, {"config": config.model_dump(mode="json"), "run_dir": run_dir, "dp_cache": dp_cache}
            )
        else:
            from flows.pipeline import pipeline

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
    """The comparison across the cells that have a report (:func:`reports.compare.build_comparison`),
    written to ``<sweep>/report/`` and published as artifacts. Every planned cell is listed: one
    without a readable ``report/report.json`` (failed before its report, or damaged) is shown as
    "no results" with its status and a warning is logged; with no cell to compare nothing is written
    and ``{}`` is returned."""
    from reports.artifacts import publish_comparison_artifacts
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
            {
                "label": pc.cell.name,
                "run_dir": str(pc.run_dir),
                "why": why,
                **{k: status.get(k) for k in ("status", "reason")},
            }
        )
        log.warning(
            "sweep %s: cell %s has no results (%s); status %s",
            plan.spec.name,
            pc.cell.name,
            why,
            status.get("status") or "no status.json",
        )
    if not have:
        log.warning("sweep %s: no cell has results; no comparison written", plan.spec.name)
        return {}
    axes = list(dict.fromkeys(k for pc in plan.cells for k in pc.cell.overrides))
    comparison = build_comparison(
        [pc.run_dir for pc in have],
        SweepLayout(plan.sweep_dir).report,
        axes=axes,
        labels=[pc.cell.name for pc in have],
        title=f"Sweep {plan.spec.name}",
        source=f"the sweep flow (`{SweepLayout(plan.sweep_dir).record}`)",
        no_results=none,
    )
    publish_comparison_artifacts(comparison, plan.spec.name)
    return comparison


def _run_cells(plan: SweepPlan, todo: list[PlannedCell], results: dict[str, dict]) -> None:
    """Run the cells ``todo``, ``concurrency`` threads taking them in grid order, each holding a slot of
    the sweep's global limit (which holds them to ``concurrency`` at once across every sweep of this
    name); each cell's result goes into ``results`` and ``sweep.json`` as it finishes."""
    spec = plan.spec
    limit = limit_name(spec)
    set_concurrency_limit(limit, spec.concurrency)
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from reports.artifacts import artifact_key

    total, done = len(plan.cells), len(plan.cells) - len(todo)
    progress = create_progress_artifact(
        100.0 * done / max(total, 1),
        key=artifact_key("sweep-progress", spec.name),
        description=f"sweep {spec.name}: cells finished of {total}",
    )
    dp_cache = str(SweepLayout(plan.sweep_dir).dp_cache) if spec.reuse_dp else None
    with ThreadPoolTaskRunner(max_workers=spec.concurrency) as runner:
        futures = {
            runner.submit(
                sweep_cell,
                {
                    "name": pc.cell.name,
                    "config": pc.cfg,
                    "run_dir": str(pc.run_dir),
                    "launch": spec.launch,
                    "deployment": spec.deployment,
                    "limit": limit,
                    "dp_cache": dp_cache,
                },
            ): pc.cell.name
            for pc in todo
        }
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


def _default_spec() -> SweepSpec:
    return load_spec("sweep", "tiny_grid")


@flow(name="sweep", flow_run_name=sweep_run_name, log_prints=True)
def sweep(
    spec: SweepSpec = _default_spec(), sweep_file: str | None = None, sweep_dir: str | None = None
) -> str | State:
    """Run every cell of a sweep through the pipeline, then build the sweep's comparison report.

    Args:
        spec: the sweep, field by field (the UI form): base config, shared overrides, grid and/or
            cells, concurrency, launch, sweep_root, resume (:class:`configs.sweep.SweepSpec`).
        sweep_file: instead of ``spec``: a shipped sweep's name (``configs/sweeps/<name>.yaml``) or
            the path of a sweep YAML file.
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
    results: dict[str, dict] = {
        pc.cell.name: {**prior.get(pc.cell.name, {}), "status": "completed", "state": "COMPLETED", "skipped": True}
        for pc in plan.cells
        if pc.action == "skip"
    }
    with graceful_stop():
        plan.sweep_dir.mkdir(parents=True, exist_ok=True)
        for pc in todo:
            if pc.action == "rerun":
                moved = _move_aside(pc, plan.sweep_dir)
                logger.info("cell %s: the earlier attempt (%s) moved to %s", pc.cell.name, pc.previous, moved)
        _write_record(plan, results)
        _run_cells(plan, todo, results)
        comparison = sweep_report(plan, results)
    report = SweepLayout(plan.sweep_dir).comparison_md
    failed = [n for n, r in results.items() if r.get("status") != "completed" and r.get("state") != "NOT_STARTED"]
    if comparison:
        logger.info("sweep report: %s", report)
    if stop_requested():
        return Cancelled(
            message=f"stopped: cells completed: {sum(r.get('status') == 'completed' for r in results.values())} "
            f"of {len(plan.cells)}; re-run the sweep to resume ({plan.sweep_dir})"
        )
    if failed:
        return Failed(
            message=f"{len(failed)} of {len(plan.cells)} cells did not complete: "
            + "; ".join(f"{n}: {results[n].get('reason') or results[n].get('status')}" for n in failed)
            + f" (report of the others: {report})"
        )
    return str(plan.sweep_dir)


def _prior_results(sweep_dir: Path, logger=None) -> dict[str, dict]:
    """The results recorded for each cell by an earlier run of the sweep (empty if none).

    A ``sweep.json`` that is not a sweep record (not UTF-8 JSON, or not an object whose ``cells``
    is a list of objects with a ``name``) is not overwritten silently: it is renamed
    ``sweep.json.corrupt-<UTC time>`` beside it and a warning naming both is logged (on
    ``logger``, default the run's or this module's); the sweep then starts a new record."""
    path = SweepLayout(sweep_dir).record
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        cells = record["cells"] if isinstance(record, dict) and isinstance(record.get("cells"), list) else None
        problem = (
            None
            if cells is not None and all(isinstance(c, dict) and "name" in c for c in cells)
            else "no list of cells with names"
        )
    except (ValueError, UnicodeDecodeError):
        problem = "not valid JSON"
    if problem is None:
        return {c["name"]: {k: c[k] for k in ("wall_s", "flow_run_id") if k in c} for c in cells}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    kept, n = path.with_name(f"{SWEEP_JSON}.corrupt-{stamp}"), 1
    while kept.exists():
        n += 1
        kept = path.with_name(f"{SWEEP_JSON}.corrupt-{stamp}-{n}")
    os.replace(path, kept)
    (logger or run_logger()).warning(
        "%s is not a sweep record (%s); kept as %s, and a new record is written", path, problem, kept.name
    )
    return {}
