"""The report's Prefect artifacts: the only module of the report that imports Prefect.

:func:`publish_report_artifacts` publishes what :func:`evals.report.build_report` returned (the
markdown, the comparison table and the token ledger) to the current flow or task run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from evals.report import render_markdown, row_cell, row_label

def artifact_key(prefix: str, name: str) -> str:
    """``<prefix>-<slug>``: lowercase letters, digits and dashes only (Prefect's rule for keys)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    return re.sub(r"-+", "-", f"{prefix}-{slug}")


def publish_report_artifacts(report: dict, run_dir: Path) -> None:
    """Publish the report to Prefect: the markdown, the comparison table and the token ledger.

    Must be called inside a Prefect flow or task run (it raises ``RuntimeError`` otherwise), so the
    artifacts attach to that run. Keys are ``report-<slug>``, ``comparison-<slug>`` and
    ``ledger-<slug>`` with ``<slug>`` the run name (``config.name``) in lowercase letters, digits and
    dashes: repeated runs of one experiment become versions of the same keyed artifacts, and each
    description names the run directory. Images are not uploaded; the markdown artifact lists the
    plots' file paths instead.
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        raise RuntimeError("publish_report_artifacts must be called inside a Prefect flow or task run")
    run_dir = Path(run_dir)
    out_dir = (run_dir / "report").resolve()
    md_path = run_dir / "report" / "report.md"
    markdown = md_path.read_text() if md_path.is_file() else render_markdown(report)
    markdown = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", lambda m: f"*{m[1]}*: `{out_dir / m[2]}`", markdown)
    name = report["run"]["name"]
    where = f"run directory {report['run']['run_dir']}"
    create_markdown_artifact(markdown, key=artifact_key("report", name), description=f"DiLoCo vs DP report, {where}")
    table = [{"metric": row_label(r), "diloco": row_cell(r, "diloco"), "dp": row_cell(r, "dp")}
             for r in report["comparison"]]
    gap = report["loss_gap"]
    table.append({
        "metric": "loss gap DiLoCo vs DP (%)",
        "diloco": f"{gap['gap_pct']:+.2f}" if gap["status"] == "ok" else gap["status"],
        "dp": "",
    })
    create_table_artifact(table, key=artifact_key("comparison", name), description=f"DiLoCo vs DP, {where}")
    led = report["ledger"]
    if led["status"] == "ok":
        rows = [
            {
                "learner": str(r["learner"]),
                **{c: (json.dumps(r[c]) if isinstance(r[c], dict) else r[c]) for c in led["columns"]},
                "merged_pct": r["merged_pct"],
            }
            for r in [*led["rows"], led["total"]]
        ]
        create_table_artifact(rows, key=artifact_key("ledger", name),
                              description=f"DiLoCo token ledger per learner (tokens), {where}")
