"""Reading one run directory for the report; every path comes from :class:`run.layout.RunLayout`.

:func:`open_run` checks that a path is a run directory; :func:`read_run` reads everything the report
uses into plain dicts and lists (:class:`RunRecords`); a missing file reads as ``None``, a corrupt
one raises :class:`ReportInputError` naming it. What is read: docs/report.md ("Reading a run directory").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from upath import UPath

from configs.chaos import ChaosSchedule
from reports.common import ordered_methods, settings

if TYPE_CHECKING:
    from configs.schema import ExperimentConfig
from run.directory import NotARunDirectory, readable_run
from run.layout import METHOD_ORDER, STAGES, RunLayout

POST_TRAINING_STAGE = "finetune"


class ReportInputError(ValueError):
    """The input cannot be used: the path is not a run directory, or a run-directory file exists
    but is corrupt (bad JSON, wrong shape). The message starts with the path."""

    def __init__(self, path: str | Path, problem: str):
        self.path = path if isinstance(path, Path) else UPath(path)
        super().__init__(f"{self.path}: {problem}")


@dataclass
class MethodRecords:
    """What one method of one stage left (``None``: no such file): ``events`` is metrics/learners.jsonl,
    ``chaos_events`` a synchronous job's metrics/events.jsonl; ``files``: each source's path relative
    to the run directory; ``notes``: what reading left out (:func:`read_jsonl`)."""

    stage: str
    method: str
    summary: dict | None = None
    eval: dict | None = None
    curve: list[dict] | None = None
    merges: list[dict] | None = None
    events: list[dict] | None = None
    train: list[dict] | None = None
    chaos_events: list[dict] | None = None
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class FinetuneRecords:
    """What one method's post-training left (``None``: no such file; docs/report.md, "Post-training")."""

    method: str
    summary: dict | None = None
    eval: dict | None = None
    train: list[dict] | None = None
    curve: list[dict] | None = None
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class RunRecords:
    """The whole run directory as read: ``stages`` maps stage → method → :class:`MethodRecords`
    (pipeline order, report order); ``finetune`` method → :class:`FinetuneRecords` for a post-training
    stage (else empty); ``chaos_schedule`` is ``pretrain/chaos.json`` or None; ``config`` config.json
    as written and ``settings`` the typed config (``reports.common.settings``)."""

    layout: RunLayout
    config: dict | None
    manifest: dict | None
    status: dict | None
    stages: dict[str, dict[str, MethodRecords]]
    finetune: dict[str, FinetuneRecords] = field(default_factory=dict)
    chaos_schedule: ChaosSchedule | None = None

    @cached_property
    def settings(self) -> ExperimentConfig | None:
        return settings(self.config)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ReportInputError(path, f"not UTF-8 text ({e})") from e


def read_json(path: Path, kind: type = dict) -> Any | None:
    """The parsed file, or ``None`` if it does not exist. Corrupt or wrong-typed → ReportInputError."""
    if not path.is_file():
        return None
    try:
        value = json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise ReportInputError(path, f"corrupt JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    if not isinstance(value, kind):
        raise ReportInputError(path, f"expected a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def read_schedule(path: Path) -> ChaosSchedule | None:
    """``pretrain/chaos.json`` as the typed schedule, or ``None`` if it does not exist. Not a
    schedule → ReportInputError."""
    raw = read_json(path)
    try:
        return None if raw is None else ChaosSchedule.model_validate(raw)
    except ValidationError as e:
        raise ReportInputError(path, f"not a chaos schedule ({e.errors()[0]['msg']})") from e


def read_jsonl(path: Path, notes: list[str] | None = None, name: str | None = None) -> list[dict] | None:
    """One dict per non-empty line, or ``None`` if the file does not exist. A line that is not a
    JSON object → ReportInputError naming the file and the line, except a last line cut short (not
    valid JSON and no trailing newline: a process killed mid-append), which is left out with a
    warning naming the file (``name``, default its path), also appended to ``notes`` when given."""
    if not path.is_file():
        return None
    rows = []
    text = _text(path)
    lines = text.splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith(("\n", "\r")):
                note = (
                    f"{name or path}: its last line (line {lineno}) is cut short (no newline; a write stopped "
                    "part-way) and was left out."
                )
                logging.getLogger(__name__).warning(note)
                if notes is not None:
                    notes.append(note)
                break
            raise ReportInputError(path, f"corrupt JSON on line {lineno} ({e.msg})") from e
        if not isinstance(row, dict):
            raise ReportInputError(path, f"line {lineno} is not a JSON object")
        rows.append(row)
    return rows


def relative(layout: RunLayout, path: Path) -> str:
    """``path`` relative to the run directory, as text (``pretrain/diloco/summary.json``)."""
    try:
        return path.relative_to(layout.root).as_posix()
    except ValueError:
        return str(path)


def open_run(run_dir: str | Path) -> RunLayout:
    """The layout of ``run_dir`` (a local path or fsspec URL) once it is known to be a run directory.

    Raises :class:`ReportInputError` naming the path when it does not exist, is not a directory, or
    holds neither ``config.json`` nor a stage with a method (``run.directory.readable_run``).
    """
    try:
        return readable_run(run_dir)
    except NotARunDirectory as e:
        raise ReportInputError(e.path, e.problem) from None


def _paths(layout: RunLayout, stage: str, method: str, metrics: tuple[str, ...]) -> dict[str, Path]:
    """summary, eval and the ``metrics`` files (``curve``: metrics/eval.jsonl) of one method."""
    paths = {"summary": layout.summary(stage, method), "eval": layout.eval_result(stage, method)}
    return paths | {k: layout.metrics(stage, method, "eval" if k == "curve" else k) for k in metrics}


def read_method(layout: RunLayout, stage: str, method: str) -> MethodRecords:
    """Every file the report reads of ``stage``/``method`` (absent files: ``None``)."""
    paths, notes = _paths(layout, stage, method, ("curve", "merges", "learners", "train", "events")), []
    rows = {k: read_jsonl(p, notes, relative(layout, p)) for k, p in paths.items() if k not in ("summary", "eval")}
    return MethodRecords(
        stage,
        method,
        summary=read_json(paths["summary"]),
        eval=read_json(paths["eval"]),
        curve=rows["curve"],
        merges=rows["merges"],
        events=rows["learners"],
        train=rows["train"],
        chaos_events=rows["events"],
        files={k: relative(layout, p) for k, p in paths.items()},
        notes=notes,
    )


def is_post_training(summary: dict | None, result: dict | None) -> bool:
    """Whether a method's records are the fine-tuning recipe's (a summary with ``recipe`` or
    ``runs``, or an evaluation with ``finetuned`` scores or a ``task``)."""
    return (isinstance(summary, dict) and ("recipe" in summary or "runs" in summary)) or (
        isinstance(result, dict) and ("finetuned" in result or isinstance(result.get("task"), dict))
    )


def read_post_training(layout: RunLayout) -> dict[str, FinetuneRecords]:
    """method → :class:`FinetuneRecords` for every method of the ``finetune`` stage when any of them
    holds post-training records (:func:`is_post_training`); empty otherwise."""
    records = {}
    for m in layout.methods(POST_TRAINING_STAGE):
        paths = _paths(layout, POST_TRAINING_STAGE, m, ("train", "curve"))
        records[m] = FinetuneRecords(
            m,
            summary=read_json(paths["summary"]),
            eval=read_json(paths["eval"]),
            train=read_jsonl(paths["train"]),
            curve=read_jsonl(paths["curve"]),
            files={k: relative(layout, p) for k, p in paths.items()},
        )
    return records if any(is_post_training(r.summary, r.eval) for r in records.values()) else {}


def missing_results(layout: RunLayout, status: dict | None) -> list[tuple[str, str]]:
    """Results that the run's record says exist but are gone: ``[(file relative to the run
    directory, why it should be there)]``. A method's ``summary.json`` is missing when ``status.json``
    lists ``<stage>-<method>`` as completed, or when the run completed (or, for ``finetune``, its
    stage did) and the method holds metrics or checkpoints; an evaluation result
    (``eval/pretrain/<method>.json``) when ``eval-<method>`` is listed. A method of an interrupted or
    failed stage is not listed (its results read "not run")."""
    status = status if isinstance(status, dict) else {}
    done = [s for s in status.get("completed_stages") or [] if isinstance(s, str)]
    completed = status.get("status") == "completed"
    out: list[tuple[str, str]] = []
    for stage in STAGES:
        names = {s[len(stage) + 1 :] for s in done if s.startswith(stage + "-")}
        if (base := layout.root / stage).is_dir():
            names |= {d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith(".")}
        for method in sorted(names):
            try:
                summary = layout.summary(stage, method)
            except ValueError:  # not a method's name (e.g. finetune/data)
                continue
            if summary.exists():
                continue
            metrics = layout.metrics(stage, method, "eval").parent
            has_work = layout.checkpoints(stage, method).exists() or (metrics.is_dir() and any(metrics.glob("*.jsonl")))
            if f"{stage}-{method}" in done:
                out.append((relative(layout, summary), f"status.json lists {stage}-{method} as completed"))
            elif has_work and (completed or (stage == POST_TRAINING_STAGE and stage in done)):
                what = "completed" if completed else f"completed its {stage} stage"
                why = f"the run {what} and {stage}/{method}/ holds its metrics or checkpoints"
                out.append((relative(layout, summary), why))
    for s in done:
        try:
            result = layout.eval_result("pretrain", s[len("eval-") :]) if s.startswith("eval-") else None
        except ValueError:
            continue
        if result is not None and not result.exists():
            out.append((relative(layout, result), f"status.json lists {s} as completed"))
    return out


def read_run(layout: RunLayout) -> RunRecords:
    """The run directory as :class:`RunRecords`. Each stage of ``layout.stages()`` lists the methods
    it holds plus the known methods (``run.layout.METHOD_ORDER``) it lacks, whose records are empty;
    a post-training ``finetune`` stage (:func:`read_post_training`) is in ``finetune`` instead."""
    finetune = read_post_training(layout)
    stages = {
        stage: {m: read_method(layout, stage, m) for m in ordered_methods([*METHOD_ORDER, *layout.methods(stage)])}
        for stage in layout.stages()
        if not (stage == POST_TRAINING_STAGE and finetune)
    }
    return RunRecords(
        layout,
        config=read_json(layout.config),
        manifest=read_json(layout.manifest),
        status=read_json(layout.status),
        stages=stages,
        finetune=finetune,
        chaos_schedule=read_schedule(layout.chaos_schedule),
    )
