"""Figures inside the Prefect UI: PNGs as inline data URIs in markdown artifacts.

:func:`inline_figures` turns a report's ``![alt](file.png)`` links into the images themselves, so
the report artifact shows its figures wherever the UI runs (the files live on the worker's disk);
:func:`live_chart` draws the held-out loss of every method trained so far against tokens, the
``live-<run name>`` artifact the pretraining stages refresh while they train. No Prefect here.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

from reports.common import ordered_methods
from reports.plots import loss_figure
from run.layout import RunLayout
from run.metrics import read_jsonl

MAX_INLINE_BYTES = 4_000_000  # all of a report's PNGs together; above it the figures stay paths
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def data_uri(png: bytes) -> str:
    """``data:image/png;base64,…`` of PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def inline_figures(markdown: str, folder: Path, max_bytes: int = MAX_INLINE_BYTES) -> str:
    """``markdown`` with each ``![alt](name.png)`` whose file is in ``folder`` (a local path or an
    fsspec ``UPath``) replaced by the image
    as a data URI; a figure whose file is missing, or all of them when together they exceed
    ``max_bytes`` (bytes of PNG), becomes ``*alt*: `folder/name.png``` (its path) instead."""
    files = {m[2]: folder / m[2] for m in _IMAGE.finditer(markdown)}
    sizes = {k: p.stat().st_size for k, p in files.items() if p.is_file()}
    inline = sum(sizes.values()) <= max_bytes

    def one(m: re.Match) -> str:
        alt, name = m[1], m[2]
        if inline and name in sizes:
            return f"![{alt}]({data_uri(files[name].read_bytes())})"
        return f"*{alt}*: `{folder}/{name}`"

    return _IMAGE.sub(one, markdown)


def live_chart(run_dir: str | Path, unit: str = "tokens", title: str | None = None) -> str | None:
    """Markdown with the held-out loss of every pretraining method of ``run_dir`` against ``unit``
    (its ``pretrain/<method>/metrics/eval.jsonl`` as they stand) as an inline PNG, and each method's
    latest point in words; None before any method has evaluated."""
    layout, curves = RunLayout(run_dir), {}
    folder = Path(layout.stage_dir("pretrain"))
    found = [p.name for p in folder.iterdir() if (p / "metrics" / "eval.jsonl").is_file()] if folder.is_dir() else []
    for m in ordered_methods(found):
        try:
            rows = read_jsonl(layout.metrics("pretrain", m, "eval"))
        except ValueError:  # a line being written at this instant: the next refresh has it
            continue
        if rows:
            curves[m] = rows
    one = unit.removesuffix("s")
    fig = loss_figure(curves, "tokens", unit, title or "held-out loss while training (live)", unit=one)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    latest = "; ".join(
        f"{m}: {rows[-1]['val/loss']:.4f} at {int(rows[-1]['tokens']):,} {unit}" for m, rows in curves.items()
    )
    return f"![held-out loss against {unit}, live]({data_uri(buf.getvalue())})\n\nLatest held-out loss: {latest}.\n"


def report_html(markdown_text: str, folder: Path, title: str) -> str:
    """One self-contained HTML page of a report (``reports/templates/report.html.j2``):
    ``markdown_text`` (``report.md``) rendered with Python-Markdown (tables, fenced code, heading
    anchors) and its figures from ``folder`` inlined (:func:`inline_figures`), so the file can be
    mailed or attached as it is."""
    import markdown

    from reports.markdown import render

    body = markdown.markdown(
        inline_figures(markdown_text, folder), extensions=["tables", "fenced_code", "toc", "sane_lists"]
    )
    return render("report.html.j2", title=title, body=body)
