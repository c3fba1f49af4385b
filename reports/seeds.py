"""The report of a run of several seeds (``seeds: [...]``): the verdict over seeds, then each seed.

Each seed's run (``RUN/seeds/seed-<s>/``) has its own full report; this one reads their
``report.json`` files and writes ``RUN/report/report.json`` and ``report.md``
(docs/report.md, "A run of several seeds").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reports.analyses import manifest_items, pipeline_status, setup
from reports.common import BASELINE, NOT_RUN, json_safe, settings
from reports.finetune import _per_item_matrix, paired_bootstrap_difference, verdict as post_verdict
from reports.live import report_html
from reports.markdown import render
from reports.read import open_run, read_json, read_run
from reports.verdict import mean_interval, seed_figures, verdict
from run import atomic
from run.layout import RunLayout

_MEAN_KEYS = ("test_loss", "val_loss_whole", "final_val_loss", "tokens", "wall_s", "tokens_per_s", "goodput", "uptime")


def _post_over_seeds(seed_dirs: list[Path], primary: str | None) -> dict | None:
    """DiLoCo − DP of the fine-tuned ``primary`` metric over every seed's run: per method a
    [P pretraining seeds, S fine-tuning seeds, N items] array, one paired bootstrap."""
    if not primary or not seed_dirs:
        return None
    mats: dict[str, list] = {"diloco": [], BASELINE: []}
    for sd in seed_dirs:
        recs = read_run(open_run(sd)).finetune or {}
        evals = {m: (recs.get(m).eval if recs.get(m) else None) for m in mats}
        if any(e is None for e in evals.values()):
            return None
        ft_seeds = [r.get("seed") for r in evals["diloco"].get("finetuned") or []]
        for m, e in evals.items():
            mat = _per_item_matrix(e, primary, ft_seeds)
            if mat is None:
                return None
            mats[m].append(mat)
    try:
        diff = paired_bootstrap_difference(mats["diloco"], mats[BASELINE])
    except ValueError:  # seeds scored different items or fine-tuning seeds: no paired difference
        return None
    import numpy as np

    diff["verdict"] = post_verdict(diff, True, "diloco")
    diff["scores"] = {m: float(np.mean(v)) for m, v in mats.items()}
    return diff


def build_seeds_report(run_dir: str | Path, config: dict, final_stage: bool = False) -> dict:
    """Read every seed's report of the run of several seeds at ``run_dir`` and write its
    ``report/report.json`` and ``report.md`` (see the module); returns the report. A seed without a
    report is listed as not run; nothing here trains or evaluates."""
    layout = open_run(run_dir)
    status = read_json(layout.status) if layout.status.exists() else None
    runs, done = [], []
    for s in config.get("seeds") or []:
        sd = RunLayout(layout.seed_run(s))
        path = sd.report_json
        rep = json.loads(path.read_text()) if path.is_file() else None
        st = read_json(sd.status) if sd.status.is_file() else None
        fig = seed_figures(rep) if rep else None
        runs.append(
            {
                "seed": s,
                "status": (st or {}).get("status", NOT_RUN),
                "run_dir": str(sd.root),
                "report": f"../seeds/seed-{s}/report/report.md" if rep else None,
                "figures": fig,
                "report_json": rep,
            }
        )
        if rep and (st or {}).get("status") == "completed":
            done.append(runs[-1])
    use = done or [r for r in runs if r["figures"]]
    primary = next((((r["report_json"] or {}).get("finetune") or {}).get("primary") for r in use), None)
    post = _post_over_seeds([Path(r["run_dir"]) for r in use], primary) if primary else None
    if post is not None:
        task = (use[0]["report_json"].get("finetune") or {}).get("task") or {}
        post.update(metric=primary, label=((task.get("metrics") or {}).get(primary) or {}).get("label", primary))
    v = verdict([r["figures"] for r in use], post) if use else None
    report: dict[str, Any] = {
        "schema": 3,
        "run": {
            "name": config.get("name") or layout.root.name,
            "run_dir": str(layout.root),
            "run_id": layout.root.name,
            "seeds": config.get("seeds"),
        },
        "setup": setup(settings(config)),
        "pipeline": pipeline_status(status, final_stage),
        "manifest": {"status": "ok", "items": manifest_items(read_json(layout.manifest))}
        if layout.manifest.exists()
        else {"status": NOT_RUN, "items": []},
        "verdict": v,
        "seed_runs": [
            {k: r[k] for k in ("seed", "status", "run_dir", "report")}
            | ({"loss": r["figures"]["loss"], "gap_pct": r["figures"]["gap_pct"]} if r["figures"] else {})
            for r in runs
        ],
        "stages": {"pretrain": _mean_stage(use, v)} if use else {},
        "finetune": _mean_finetune(use, post, primary),
        "config": config,
    }
    report = json.loads(json.dumps(json_safe(report), allow_nan=False))
    layout.report.mkdir(parents=True, exist_ok=True)
    atomic.write_json(layout.report_json, report, newline=True, default=None, allow_nan=False)
    markdown = render_seeds(report)
    atomic.write_text(layout.report_md, markdown)
    title = f"Run report over seeds: {report['run']['name']}" if report.get("run") else "Run report over seeds"
    atomic.write_text(layout.report_html, report_html(markdown, layout.report, title))
    return report


def _mean_stage(use: list[dict], v: dict | None) -> dict:
    methods: dict[str, dict] = {}
    for m in ("diloco", BASELINE):
        rows = [((r["report_json"]["stages"].get("pretrain") or {}).get("methods") or {}).get(m) or {} for r in use]
        f = {k: mean_interval([x.get(k) for x in rows])["mean"] for k in _MEAN_KEYS}
        f["test_loss_ci"] = mean_interval([x.get("test_loss") for x in rows])["ci"]
        f["bytes"] = {"total": mean_interval([(x.get("bytes") or {}).get("total") for x in rows])["mean"]}
        methods[m] = f
    gap = (v or {}).get("gap_pct") or {}
    return {
        "stage": "pretrain",
        "unit": use[0]["figures"]["unit"],
        "methods": methods,
        "loss_gaps": {
            "diloco": {
                "status": "ok" if gap.get("mean") is not None else NOT_RUN,
                "gap_pct": gap.get("mean"),
                "ci": gap.get("ci"),
                "seeds": gap.get("n"),
                "split": use[0]["figures"]["split"],
            }
        },
    }


def _mean_finetune(use: list[dict], post: dict | None, primary: str | None) -> dict | None:
    if not primary or post is None:
        return None
    first = use[0]["report_json"]["finetune"]
    return {
        "primary": primary,
        "task": first.get("task"),
        "methods": {m: {"scores": {primary: {"finetuned": post["scores"][m]}}} for m in ("diloco", BASELINE)},
        "differences": {
            "diloco": {"baseline": BASELINE, "metrics": {primary: {"finetuned": {"status": "ok", **post}}}}
        },
    }


def render_seeds(report: dict) -> str:
    """``report.md`` of a run of several seeds (pure): ``reports/templates/seeds.md.j2``."""
    return render("seeds.md.j2", report=report)
