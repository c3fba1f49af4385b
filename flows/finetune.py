"""The fine-tuning flow (also the pipeline's ``finetune`` stage): one recipe applied identically to
every pretrained model of a run directory, evaluated before and after, then the report rebuilt.
Every check runs before anything is written (:func:`flows.preflight.finetune_preflight`).
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import re
import shutil
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows import run_logger
from flows.naming import finetune_run_name
from flows.preflight import FinetunePlan, finetune_preflight
from run.control import graceful_stop, stop_requested
from run.directory import link_or_copy
from run.layout import RunLayout
from tasks.finetune import evaluate_finetune_task, finetune_data_task, finetune_task

__all__ = ["finetune", "run_finetune_stage"]


def _results(layout: RunLayout, method: str) -> list[Path]:
    out = [Path(p) for p in layout.holds_results("finetune", method)]
    extra = Path(layout.eval_outputs("finetune", method))
    return out + ([extra] if extra.exists() else [])


def _remove(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


_ASIDE = re.compile(r"^\.(?P<name>.+)\.replaced-[0-9a-f]{8}$")


def _recover_aside(layout: RunLayout) -> list[str]:
    """Move back results a killed ``--replace`` put aside where their place is empty; where newer results
    stand, keep both and name them (nothing is deleted). Returns (and logs) one line per item found."""
    lines: list[str] = []
    data = Path(layout.finetune_data)
    data_asides = sorted(data.parent.glob(f".{data.name}.replaced-*"), key=lambda p: p.stat().st_mtime)  # oldest first
    moved = kept = 0
    for folder in (layout.stage_dir("finetune"), layout.eval_dir("finetune")):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            m = _ASIDE.match(p.name)
            if m is None or p in data_asides:
                continue
            orig = p.with_name(m["name"])
            kept, moved = kept + orig.exists(), moved + (not orig.exists())
            if not orig.exists():
                p.rename(orig)
                lines.append(
                    f"{orig}: moved back from {p.name} (an earlier --replace was killed before it wrote new results)"
                )
            else:
                lines.append(
                    f"{p}: earlier results an interrupted --replace put aside; {orig} holds newer ones. "
                    f"Delete {p.name} to keep the newer, or put it back in place of {orig.name}"
                )
    for p in data_asides:  # the task's items the put-aside results were made from
        if moved and p == data_asides[-1]:  # results came back: so does their data
            shutil.rmtree(data, ignore_errors=True)
            p.rename(data)
            lines.append(f"{data}: moved back from {p.name} with the results made from it")
        elif kept:
            lines.append(f"{p}: the task data of the put-aside results above; keep or delete it with them")
        else:  # the replace had finished its results and was killed while cleaning up
            shutil.rmtree(p, ignore_errors=True)
            lines.append(f"{p}: removed (an earlier --replace had finished its results)")
    for line in lines:
        run_logger().warning(line)
    return lines


def run_finetune_stage(plan: FinetunePlan) -> dict:
    """Prepare the task, fine-tune and evaluate every planned method, in order. Returns
    ``{"task": …, "methods": {method: {"summary", "eval"}}, "interrupted": bool}``. With ``replace``,
    earlier results and the task data they were made from are put aside, deleted once the new ones are
    written, and moved back (partial new results removed) if the stage fails."""
    import uuid

    cfg, rd = plan["cfg"], str(plan["run_dir"])
    layout = RunLayout(rd)
    _recover_aside(layout)
    aside: list[tuple[Path, Path]] = []  # (a path, where its earlier content waits)
    if plan.get("replace"):
        tag = uuid.uuid4().hex[:8]
        data = Path(layout.finetune_data)
        if data.is_dir():  # a copy of hard links: the data step never writes a file in place, it swaps a folder in
            aside.append((data, data.with_name(f".{data.name}.replaced-{tag}")))
            shutil.copytree(data, aside[-1][1], copy_function=link_or_copy)
        for m in plan["methods"]:
            for p in _results(layout, m):
                aside.append((p, p.with_name(f".{p.name}.replaced-{tag}")))
                p.rename(aside[-1][1])
    out: dict[str, Any] = {"task": None, "methods": {}, "interrupted": False}
    try:
        out["task"] = task_info = finetune_data_task(cfg, rd)
        for method, ckpt in plan["methods"].items():
            if stop_requested():
                break
            summary = finetune_task(cfg, rd, method, task_info, ckpt)
            if summary.get("interrupted") or stop_requested():
                out["methods"][method] = {"summary": summary}
                break
            out["methods"][method] = {
                "summary": summary,
                "eval": evaluate_finetune_task(cfg, rd, method, task_info, ckpt),
            }
    except BaseException:
        if not stop_requested():
            for m in plan["methods"]:  # a failed method's partial results would read as a method
                for p in _results(layout, m):
                    _remove(p)
            for orig, dst in aside:
                _remove(orig)
                dst.rename(orig)
        raise
    for _, dst in aside:
        _remove(dst)
    out["interrupted"] = stop_requested()
    return out


@flow(name="finetune", flow_run_name=finetune_run_name, log_prints=True)
def finetune(
    run_dir: str | None = None,
    methods: list[str] | None = None,
    checkpoint: str | None = None,
    name: str | None = None,
    # a plain dict, never mutated: the UI form gives it a JSON editor (an Optional dict shows as a
    # dict/None switch with nothing to edit)
    overrides: dict[str, Any] = {},  # noqa: B006
    replace: bool = False,
    build_report: bool = True,
) -> str:
    """Fine-tune a run's pretrained models with one recipe (``finetune.*`` of its config, changed by
    ``overrides``), evaluate them before and after, and rebuild the report.

    Args:
        run_dir: a run directory made by the pipeline.
        methods: pretrained methods to fine-tune (default: all with a checkpoint).
        checkpoint: instead, an Orbax checkpoint folder of ours (its run directory is used).
        name: the method name for ``checkpoint``'s results.
        overrides: dotted ``finetune.*`` keys, e.g. ``{"finetune.mode": "lora"}``.
        replace: delete earlier fine-tuning results of these methods first.
        build_report: rebuild ``report/`` at the end (the pipeline builds it itself).

    Returns the run directory. Raises ``ValueError``/``FileNotFoundError``/``FileExistsError`` from
    :func:`flows.preflight.finetune_preflight` before anything is written.
    """
    plan = finetune_preflight(run_dir, methods, checkpoint, name, overrides, replace)
    logger = get_run_logger()
    with graceful_stop():
        result = run_finetune_stage(plan)
        if build_report:  # run alone: the run's record gains the stage
            from run.directory import read_status, write_status

            old = read_status(plan["run_dir"])
            if old.get("status") and not result["interrupted"]:
                done = [s for s in old.get("completed_stages", []) if s not in ("finetune", "report")]
                write_status(plan["run_dir"], old["status"], done + ["finetune", "report"], old.get("reason"))
            from tasks.evaluate import report_task

            report_task(plan["run_dir"], final_stage=False)
            logger.info("report: %s", RunLayout(plan["run_dir"]).report_md)
    if result["interrupted"]:
        from prefect.states import Cancelled

        return Cancelled(message="fine-tuning stopped by a signal; what finished is saved")
    return str(plan["run_dir"])
