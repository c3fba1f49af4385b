"""The report of a run of several seeds (``seeds: [...]``): the verdict over seeds, then each seed.

Each seed's run (``RUN/seeds/seed-<s>/``) has its own full report; this one reads their
``report.json`` files and writes ``RUN/report/report.json`` and ``report.md``
(docs/report.md, "A run of several seeds").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from reports.analyses import manifest_items, pipeline_status, setup
from reports.common import BASELINE, NOT_RUN, json_safe, nested, settings
from reports.finetune import _per_item_matrix, paired_bootstrap_difference, verdict as post_verdict
from reports.live import report_html
from reports.markdown import render
from reports.read import open_run, read_json, read_run
from reports.table import runs_table, wide
from reports.verdict import context, mean_interval, verdict
from run import atomic
from run.layout import RunLayout

_MEAN_KEYS = ("test_loss", "val_loss_whole", "final_val_loss", "tokens", "wall_s", "tokens_per_s", "goodput", "uptime")


def _post_over_seeds(seed_dirs: list[Path], primary: str | None) -> dict | None:
    """DiLoCo − DP of the fine-tuned ``primary`` over every seed: [P seeds, S fine-tuning seeds, N items] per method."""
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
    diff["verdict"] = post_verdict(diff, True, "diloco")
    diff["scores"] = {m: float(np.mean(v)) for m, v in mats.items()}
    return diff


def build_seeds_report(run_dir: str | Path, config: dict, final_stage: bool = False) -> dict:
    """Read every seed's report of the run of several seeds at ``run_dir`` and write its
    ``report/report.json`` and ``report.md`` (see the module); returns the report. A seed without a
    report is listed as not run; nothing here trains or evaluates."""
    layout = open_run(run_dir)
    status = read_json(layout.status) if layout.status.exists() else None
    runs = []
    for s in config.get("seeds") or []:
        sd = RunLayout(layout.seed_run(s))
        rep = read_json(sd.report_json) if sd.report_json.is_file() else None
        st = (read_json(sd.status) if sd.status.is_file() else None) or {}
        report = f"../seeds/seed-{s}/report/report.md" if rep else None
        runs.append(
            dict(seed=s, status=st.get("status", NOT_RUN), run_dir=str(sd.root), report=report, report_json=rep)
        )
    use = [r for r in runs if r["report_json"] and r["status"] == "completed"] or [r for r in runs if r["report_json"]]
    reports = {r["seed"]: r["report_json"] for r in use}
    primary = next((nested(rep, ("finetune", "primary")) for rep in reports.values()), None)
    post = _post_over_seeds([Path(r["run_dir"]) for r in use], primary) if primary else None
    if post is not None:
        task = nested(use[0]["report_json"], ("finetune", "task")) or {}
        post.update(metric=primary, label=nested(task, ("metrics", primary, "label")) or primary)
    v = verdict(reports, post) if use else None
    every = runs_table({r["seed"]: r["report_json"] for r in runs if r["report_json"]})
    every = wide(every[every.stage == "pretrain"], ["loss", "loss_gap_pct"], ["diloco", BASELINE])
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
        "seed_runs": [{k: r[k] for k in ("seed", "status", "run_dir", "report")} | _seed_row(every, r) for r in runs],
        "stages": {"pretrain": _mean_stage(reports, v)} if use else {},
        "finetune": _mean_finetune(use, post, primary),
        "config": config,
    }
    report = json.loads(json.dumps(json_safe(report), allow_nan=False))
    layout.report.mkdir(parents=True, exist_ok=True)
    atomic.write_json(layout.report_json, report, newline=True, default=None, allow_nan=False)
    markdown = render("seeds.md.j2", report=report)
    atomic.write_text(layout.report_md, markdown)
    title = f"Run report over seeds: {report['run']['name']}" if report.get("run") else "Run report over seeds"
    atomic.write_text(layout.report_html, report_html(markdown, layout.report, title))
    return report


def _seed_row(every, r: dict) -> dict:
    """A seed's losses (per method) and DiLoCo − DP gap (%) from the runs-table; {} without a report."""
    if not r["report_json"]:
        return {}
    row = every.loc[r["seed"]]
    return {"loss": {m: row[f"{m}/loss"] for m in ("diloco", BASELINE)}, "gap_pct": row["diloco/loss_gap_pct"]}


def _mean_stage(reports: dict, v: dict | None) -> dict:
    """The pretraining stage over seeds: each method's :data:`_MEAN_KEYS` means, DiLoCo's paired gap."""
    t = runs_table(reports).query("stage == 'pretrain'")
    mean = t.groupby("method")[[*_MEAN_KEYS, "bytes_total"]].agg(lambda x: mean_interval(x)["mean"])
    ci = t.groupby("method")["test_loss"].agg(lambda x: mean_interval(x)["ci"])
    mean = mean.reindex(["diloco", BASELINE]).astype(object)
    methods = {
        m: {k: f[k] for k in _MEAN_KEYS} | {"test_loss_ci": ci.get(m), "bytes": {"total": f["bytes_total"]}}
        for m, f in mean.where(mean.notna(), None).iterrows()
    }
    gap = (v or {}).get("gap_pct") or {}
    first = context(next(iter(reports.values())))
    g = {"status": "ok" if gap.get("mean") is not None else NOT_RUN, "gap_pct": gap.get("mean"), "ci": gap.get("ci")}
    g |= {"seeds": gap.get("n"), "split": first["split"]}
    return {"stage": "pretrain", "unit": first["unit"], "methods": methods, "loss_gaps": {"diloco": g}}


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
