"""The report's Prefect artifacts, the only module of the report that imports Prefect:
:func:`publish_report_artifacts` (a run report), :func:`publish_live_chart` (the loss curves while
training) and :func:`publish_comparison_artifacts` (a comparison across run directories) publish to
the current flow or task run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reports.common import nested, short_label
from reports.compare import cell, render_comparison
from reports.live import inline_figures, live_chart
from reports.markdown import render_markdown, row_cell, row_label
from run.layout import RunLayout


def artifact_key(prefix: str, name: str) -> str:
    """``<prefix>-<slug>``: lowercase letters, digits and dashes only (Prefect's rule for keys)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    return re.sub(r"-+", "-", f"{prefix}-{slug}")


def comparison_table(report: dict) -> list[dict]:
    """The side-by-side rows of every stage: ``stage``, ``metric`` and one text cell per method
    (methods a stage lacks: ""), then each stage's loss gaps (%, vs DP)."""
    methods = list(dict.fromkeys(m for st in report["stages"].values() for m in st["methods"]))
    table = []
    for stage, st in report["stages"].items():
        blank = {m: "" for m in methods}
        for r in st.get("comparison") or []:
            table.append(
                {"stage": stage, "metric": row_label(r), **blank, **{m: row_cell(r, m) for m in st["methods"]}}
            )
        for m, gap in (st.get("loss_gaps") or {}).items():
            metric = f"loss gap {short_label(m)} vs {short_label(gap.get('baseline', 'dp'))} (%)"
            value = f"{gap['gap_pct']:+.2f}" if gap["status"] == "ok" else gap["status"]
            table.append({"stage": stage, "metric": metric, **blank, m: value})
    return table


def ledger_table(report: dict) -> list[dict]:
    """The token ledger rows (tokens) of every learners-and-syncer method, with ``stage`` and
    ``method`` columns; drop reasons as JSON text."""
    return [
        {
            "stage": stage,
            "method": m,
            "learner": str(r["learner"]),
            **{c: (json.dumps(r[c]) if isinstance(r[c], dict) else r[c]) for c in led["columns"]},
            "merged_pct": r["merged_pct"],
        }
        for stage, st in report["stages"].items()
        for m, f in st["methods"].items()
        if (led := f.get("ledger") or {}).get("status") == "ok"
        for r in [*led["rows"], led["total"]]
    ]


def _finetune_row(
    metric: str, model: str, before: Any, after: Any, ci: list | None, over: str | None, fmt: str
) -> dict:
    text = ["" if x is None else fmt.format(x) for x in (before, after, *(ci or ()))]
    columns = ("metric", "model", "pretrained", "fine-tuned", "95 % interval", "over")
    return dict(zip(columns, (metric, model, *text[:2], f"[{text[2]}, {text[3]}]" if ci else "", over or "")))


def finetune_table(report: dict) -> list[dict]:
    """The post-training rows: per task metric, each method's pretrained and fine-tuned score (mean
    over seeds) and, for every method against DP, the difference with its 95 % interval."""
    ft = report.get("finetune") or {}
    rows = []
    for k in ft.get("metrics", []):
        for m, f in ft["methods"].items():
            if sc := (f.get("scores") or {}).get(k):
                values = (sc.get("pretrained"), sc.get("finetuned"), sc.get("finetuned_ci"), sc.get("finetuned_over"))
                rows.append(_finetune_row(k, short_label(m), *values, "{:.4f}"))
        for m, d in (ft.get("differences") or {}).items():
            fd = nested(d, ("metrics", k, "finetuned")) or {}
            if fd.get("status") == "ok":
                who = f"{short_label(m)} − {short_label(d['baseline'])}"
                rows.append(_finetune_row(k, who, None, fd["difference"], fd["ci"], fd.get("over"), "{:+.4f}"))
    return rows


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _markdown(path: Path, folder: Path, render: Callable[[], str]) -> str:
    """The markdown file (else ``render()``) with the figures of ``folder`` inlined."""
    return inline_figures(path.read_text(encoding="utf-8") if path.is_file() else render(), folder)


def publish_report_artifacts(report: dict, run_dir: str | Path) -> None:
    """Publish the report to Prefect: the markdown, the verdict, the comparison table and the token ledger.

    Must be called inside a Prefect flow or task run (it raises ``RuntimeError`` otherwise). Keys are
    ``report-``, ``verdict-`` (with a verdict), ``comparison-``, ``posttraining-`` (with a fine-tuning
    stage) and ``ledger-<slug>`` (when a method has a ledger), ``<slug>`` the run name
    (:func:`artifact_key`): repeated runs of one experiment become versions of the same keyed
    artifacts. The report's figures are inlined as PNG data URIs (:func:`reports.live.inline_figures`:
    the UI shows them wherever it runs; above its size cap, their paths on the worker's disk).
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    if not _in_prefect_run():
        raise RuntimeError("publish_report_artifacts must be called inside a Prefect flow or task run")
    layout = RunLayout(run_dir)
    folder = layout.report.absolute() if isinstance(layout.report, Path) else layout.report  # or an fsspec UPath
    name = report["run"]["name"]
    where = f"run directory {report['run']['run_dir']}"
    markdown = _markdown(layout.report_md, folder, lambda: render_markdown(report))
    create_markdown_artifact(markdown, key=artifact_key("report", name), description=f"Run report, {where}")
    v = report.get("verdict")
    unit = next(iter(report["stages"].values()), {}).get("unit", "tokens")
    tables = {  # key prefix: (rows, description); None: not published
        "verdict": (v["rows"], f"The verdict, DiLoCo vs DP: {v['words']} ({where})") if v else (None, ""),
        "comparison": (comparison_table(report), f"Every method vs DP, per stage, {where}"),
        "posttraining": (
            finetune_table(report) or None,
            f"Post-training: pretrained → fine-tuned, DiLoCo − DP with 95 % intervals, {where}",
        ),
        "ledger": (ledger_table(report) or None, f"Ledger per learner ({unit}), {where}"),
    }
    for prefix, (rows, description) in tables.items():
        if rows is not None:
            create_table_artifact(rows, key=artifact_key(prefix, name), description=description)


def run_slug(run_dir: str | Path) -> str:
    """The run directory's own name (a local path or an fsspec URL): the pipeline's flow run is
    named after it (``flows.naming``), and a run's own artifacts (live chart, progress) carry it."""
    return str(run_dir).rstrip("/").rsplit("/", 1)[-1]


def publish_live_chart(run_dir: str | Path, name: str, unit: str = "tokens") -> None:
    """The ``live-<run>`` markdown artifact (:func:`run_slug`: one key per run): the held-out loss of every
    method trained so far against ``unit`` (:func:`reports.live.live_chart`), a new version at each call;
    nothing before the first evaluation. ``name``: the config's, in the title. Inside a Prefect run."""
    from prefect.artifacts import create_markdown_artifact

    chart = live_chart(run_dir, unit, f"{name}: held-out loss while training")
    if chart is not None:
        create_markdown_artifact(
            chart,
            key=artifact_key("live", run_slug(run_dir)),
            description=f"Held-out loss of each method while it trains (run directory {run_dir})",
        )


def comparison_rows(comparison: dict) -> list[dict]:
    """The comparison's table as text cells ("—" for a missing value), one dict per run, keyed by
    the column headers (by the column keys where two headers are the same)."""
    cols = comparison["columns"]
    headers = [c["header"] for c in cols]
    names = [c["header"] if headers.count(c["header"]) == 1 else c["key"] for c in cols]
    return [{n: cell(row.get(c["key"]), c["fmt"]) for n, c in zip(names, cols)} for row in comparison["rows"]]


def publish_comparison_artifacts(comparison: dict, key_name: str) -> bool:
    """Publish a comparison (:func:`reports.compare.build_comparison`'s dict) to the current Prefect flow
    or task run: ``comparison.md`` (plots inlined) keyed ``compare-<slug>`` and the table keyed
    ``compare-table-<slug>``, the slug from ``key_name``. True when published; outside a flow or task
    run nothing is published (no server contacted): a warning and False."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    if not _in_prefect_run():
        logging.getLogger(__name__).warning(
            "publish_comparison_artifacts: not inside a Prefect flow or task run; no artifacts published "
            "(the comparison is in %s)",
            comparison["paths"]["out_dir"],
        )
        return False
    out_dir = comparison["paths"]["out_dir"]
    markdown = _markdown(Path(comparison["paths"]["markdown"]), Path(out_dir), lambda: render_comparison(comparison))
    where = f"{len(comparison['rows'])} runs, written to {out_dir}"
    create_markdown_artifact(
        markdown, key=artifact_key("compare", key_name), description=f"{comparison['title']}: {where}"
    )
    create_table_artifact(
        comparison_rows(comparison),
        key=artifact_key("compare-table", key_name),
        description=f"{comparison['title']}, one row per run: {where}",
    )
    return True
