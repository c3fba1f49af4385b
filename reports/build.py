"""Building the report: read the run directory, compute the figures, draw, render, write
(docs/report.md)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from reports.analyses import manifest_items, pipeline_status, setup, stage_figures
from reports.common import BYTES_CONVENTION, NOT_RUN, STALE_DEFINITION, figure_file, json_safe, label
from reports.experts import expert_load_figure
from reports.finetune import finetune_loss_figure, post_training_figures
from reports.live import report_html
from reports.markdown import render_markdown
from reports.plots import (
    confusion_figure,
    loss_figure,
    merges_figure,
    resilience_loss_figure,
    resilience_timeline_figure,
    save_png,
)
from reports.read import MethodRecords, ReportInputError, RunRecords, missing_results, open_run, read_json, read_run
from reports.resilience import curve_points, diloco_resilience, diloco_training_start, resilience_figures
from reports.verdict import verdict
from run import atomic
from run.layout import STAGES, RunLayout

PACKAGES = ("jax", "flax", "optax", "prefect", "lm_eval")
SCHEMA = 3  # report.json layout: 3 = one entry per stage under "stages"


def _git_commit() -> str:
    """Short commit of the code producing the report (``git rev-parse --short HEAD``), or "unknown"."""
    cmd = ["git", "rev-parse", "--short", "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.stdout.strip() if out.returncode == 0 else "") or "unknown"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _draw(fig: Figure | None, out_dir: Path, name: str) -> str | None:
    """Save ``fig`` as ``out_dir/name``; the file name, or None when there was nothing to draw."""
    if fig is None:
        return None
    save_png(fig, out_dir / name)
    return name


def _method_dict(rec: MethodRecords | None, role: str) -> dict | None:
    """A method's records as :func:`reports.resilience.resilience_figures` takes them; None when it left nothing."""
    if rec is None or (rec.summary is None and rec.curve is None and rec.events is None and rec.chaos_events is None):
        return None
    if role == "diloco":
        return {"events": rec.events, "merges": rec.merges, "curve": rec.curve, "summary": rec.summary}
    return {"events": rec.chaos_events, "train": rec.train, "curve": rec.curve, "summary": rec.summary}


def _reference(
    run_dir: str | Path | None, from_config: bool, notes: list[str]
) -> tuple[dict | None, RunRecords | None]:
    """The reference run (``resilience_figures``' ``reference``) and its records; a bad config.json path: a note."""
    if run_dir is None:
        return None, None
    try:
        recs = read_run(open_run(run_dir))
    except ReportInputError as exc:
        if not from_config:
            raise
        notes.append(f"chaos.reference_run: {exc}; the reference run is left out.")
        return None, None
    pre = recs.stages.get("pretrain") or {}
    ref = {"run_dir": str(run_dir), **{m: _method_dict(pre.get(m), m) for m in ("diloco", "dp")}}
    if ref["diloco"] is None and ref["dp"] is None:
        notes.append(f"reference run {run_dir} holds no pretraining curve of DiLoCo or DP; left out.")
        return None, None
    return ref, recs


def _resilience(
    records: RunRecords, stages: dict, reference: str | Path | None, predict: Callable | None
) -> RunRecords | None:
    """Resilience figures into ``stages["pretrain"]`` under chaos (or a DP failure/slowdown); returns the reference."""
    pre = records.stages.get("pretrain")
    if not pre or "pretrain" not in stages:
        return None
    dp = pre.get("dp")
    met = dp is not None and any(e.get("event") in ("failure", "slowdown") for e in dp.chaos_events or [])
    if records.chaos_schedule is None and not met:  # (every DP run logs its start and checkpoints)
        return None
    notes = stages["pretrain"]["notes"]
    logs = [*(getattr(pre.get("diloco"), "events", None) or []), *(getattr(dp, "chaos_events", None) or [])]
    if logs and not any(e.get("event") == "state" for e in logs):  # intervals to sum are not on record
        notes.append("its logs predate state events (docs/contracts.md): the Resilience section is left out")
        return None
    from_config = reference is None
    if from_config:
        reference = records.settings.chaos.reference_run if records.settings is not None else None
    ref, ref_records = _reference(reference, from_config, notes)
    res = stages["pretrain"]["resilience"] = resilience_figures(
        records.settings,
        records.chaos_schedule,
        _method_dict(pre.get("diloco"), "diloco"),
        _method_dict(dp, "dp"),
        reference=ref,
        predict=predict,
    )
    if ref_records is not None:  # a reference meant to run without chaos: say so when it did not
        res["loss"]["reference_has_chaos"] = ref_records.chaos_schedule is not None
        if ref_records.chaos_schedule is not None:
            notes.append(
                f"the reference run {reference} ran under a chaos schedule too (its pretrain/chaos.json): "
                "it is no failure-free reference"
            )
    # each method's goodput beside its other figures (the comparison table; `ddiloco compare`, sweeps)
    st, goodput = stages["pretrain"], {}
    for m in st.get("methods") or {}:
        fig = res.get(m) if m in ("diloco", "dp") else None
        goodput[m] = fig["global"]["goodput"] if fig else None
        st["methods"][m]["goodput"] = goodput[m]
    rows = st["comparison"]
    if any(v is not None for v in goodput.values()) and not any(r.get("key") == "goodput" for r in rows):
        at = next((i + 1 for i, r in enumerate(rows) if r.get("key") == "wall_s"), len(rows))
        what = {"key": "goodput", "label": "goodput (useful / allocated time; Resilience)", "unit": "fraction"}
        rows.insert(at, {**what, "fmt": "{:.3f}", "group": "training", **goodput})
    return ref_records


def _learner_goodput(records: RunRecords, stages: dict) -> None:
    """``goodput`` (unless Resilience set it) and ``uptime`` of every learners-and-syncer method, chaos or not."""
    for m, f in ((stages.get("pretrain") or {}).get("methods") or {}).items():
        rec = (records.stages.get("pretrain") or {}).get(m)
        if f.get("kind") != "syncer" or rec is None or not rec.events:
            continue
        d = diloco_resilience(rec.events, rec.merges, records.chaos_schedule, None, None)
        if d is None:  # a run before state events (docs/contracts.md): no intervals to sum
            stages["pretrain"]["notes"].append(f"{m}: its learners log predates state events: no goodput or uptime.")
            continue
        if f.get("goodput") is None:
            f["goodput"] = (d.get("global") or {}).get("goodput")
        f["uptime"] = (d.get("uptime") or {}).get("uptime")


def _draw_resilience(stage: dict, records: dict[str, MethodRecords], ref: RunRecords | None, out_dir: Path) -> None:
    """The timeline and the loss-vs-time figures of the Resilience section into ``stage["plots"]``."""
    res = stage.get("resilience")
    if not res:
        return
    name = stage["stage"]
    d = res.get("diloco")
    t0 = d["span"]["start_s"] if d else 0.0
    rec = records.get("diloco")
    merges = [t - t0 for m in (rec.merges if rec else None) or [] if (t := m.get("merged_at_s")) is not None]
    stage["plots"]["resilience_timeline"] = _draw(
        resilience_timeline_figure(res, merges if d else None), out_dir, figure_file(name, "resilience_timeline")
    )
    runs = [("this run", {}, records, {"diloco": t0})]
    if ref is not None and (res["loss"].get("reference") or {}).get("reference_pair"):
        rpre = ref.stages.get("pretrain") or {}
        r = rpre.get("diloco")
        start = diloco_training_start(r.events, r.summary) if r is not None and r.curve else 0.0
        runs.append(("reference, no chaos", {"dashed": True}, rpre, {"diloco": start}))
    series = [
        {"method": m, "label": f"{label(m)} ({who})", **style, "points": curve_points(r.curve, "wall_s", t.get(m, 0.0))}
        for who, style, recs, t in runs
        for m in ("diloco", "dp")
        if (r := recs.get(m)) is not None and r.curve
    ]
    stage["plots"]["resilience_loss"] = _draw(
        resilience_loss_figure(series, res["loss"].get("at_s"), stage.get("unit", "tokens").removesuffix("s")),
        out_dir,
        figure_file(name, "resilience_loss"),
    )


def _draw_stage(stage: dict, records: dict[str, MethodRecords], out_dir: Path) -> None:
    """The stage's figures into ``out_dir``; their names into ``stage["plots"]`` (merge plots: each method's)."""
    name, unit = stage["stage"], stage.get("unit", "tokens")
    curves = {m: rec.curve for m, rec in records.items()}
    finals = {m: f["final_val_loss"] for m, f in stage["methods"].items()}  # the tables' final loss
    views = [  # (figure, curves, x, x label, title) of the held-out loss
        ("loss_vs_tokens", curves, "tokens", f"training {unit} (all learners)", f"Held-out loss vs {unit}"),
        (
            "loss_vs_time",
            curves,
            "wall_s",
            "wall-clock time since training start (s)",
            "Held-out loss vs wall-clock time",
        ),
    ]
    net = stage.get("interconnect")
    if net and not net["same_host"] and net.get("kind") != "measured":
        modelled = {m: f["curve"] for m, f in net["methods"].items()}
        title = f"Held-out loss vs modelled time ({net['short']})"
        views.append(("loss_vs_modelled_time", modelled, "modelled_s", "modelled wall-clock time (s)", title))
    figures = {key: loss_figure(c, x, xl, t, finals, unit=unit.removesuffix("s")) for key, c, x, xl, t in views}
    if unit == "images":
        figures["confusion"] = confusion_figure({m: rec.eval for m, rec in records.items()})
    if stage.get("experts"):  # an MoE model
        figures["expert_load"] = expert_load_figure(records, unit)
    stage["plots"].update({key: _draw(fig, out_dir, figure_file(name, key)) for key, fig in figures.items()})
    for m, f in stage["methods"].items():
        if f["kind"] == "syncer":
            fig = merges_figure(records[m].merges or [], f["failures"], m)
            f["plots"] = {"merges_over_time": _draw(fig, out_dir, figure_file(name, "merges_over_time", m))}


def _run_meta(layout: RunLayout, config: dict | None) -> dict:
    """report.json's ``run``: name, directory (absolute path or URL), id, when and from which commit."""
    root = layout.root
    return {
        "name": (config or {}).get("name") or root.name,
        "run_dir": str(root.resolve()) if isinstance(root, Path) else str(root),
        "run_id": root.name,
        "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git_commit": _git_commit(),
        "versions": {pkg: _version(pkg) for pkg in PACKAGES},
    }


def _draw_figures(report: dict, records: RunRecords, ref_records: RunRecords | None, out_dir: Path) -> None:
    """Every figure of ``report`` into ``out_dir`` (stale ones of an earlier build removed first)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:  # never leave a stale figure from an earlier build
        for old in out_dir.glob(figure_file(stage, "*")):
            old.unlink()
    for s, st in report["stages"].items():
        _draw_stage(st, records.stages[s], out_dir)
        _draw_resilience(st, records.stages[s], ref_records, out_dir)
    if report["finetune"] is not None:
        report["finetune"]["plots"]["loss"] = _draw(
            finetune_loss_figure(records.finetune, report["finetune"]["task"].get("modality")),
            out_dir,
            figure_file("finetune", "loss"),
        )


def build_report(
    run_dir: str | Path,
    final_stage: bool = False,
    reference: str | Path | None = None,
    predict: Callable[[dict, list[str]], dict] | None = None,
) -> dict:
    """Read one run directory, write ``RUN/report/`` (docs/report.md), return the report.

    ``run_dir``: a local path or an fsspec URL. The returned dict is exactly what ``report.json``
    holds (its keys: docs/contracts.md, "Report"): ``schema``, ``run``, ``setup``, ``pipeline``,
    ``manifest``, ``definitions``, ``config``, ``stages`` (per stage its ``methods``, ``comparison``,
    ``loss_gaps`` in %, ``hyperparameters``, ``plots``, ``notes``; under chaos ``resilience``),
    ``finetune`` (:func:`reports.finetune.post_training_figures`, or None) and, with both DiLoCo and
    DP, ``verdict``. Units: tokens, seconds, nats/token, payload bytes.

    ``final_stage``: the pipeline builds this report as its last stage (a ``running`` status then
    means "completing"). ``reference``: a run directory of the same experiment without chaos for the
    Resilience section (default: config.json's ``chaos.reference_run``). ``predict(knobs, systems)``:
    runs the goodput simulator (``reports`` may not import ``sim``; ``sim.study.simulate_goodput`` is
    one); None leaves the prediction "not computed".

    Raises :class:`reports.read.ReportInputError` naming the path when ``run_dir`` does not exist
    or is not a run directory, or a ``reference`` given here is not one (nothing is written then),
    naming the file when an input exists but is corrupt, and naming it ("results missing") when a
    result the run's record says exists is gone (:func:`reports.read.missing_results`; nothing is
    written then either).
    """
    layout = open_run(run_dir)
    seeded = read_json(layout.config) or {}
    if len(seeded.get("seeds") or []) > 1:  # a run of several seeds: the report over its seeds' reports
        from reports.seeds import build_seeds_report

        return build_seeds_report(run_dir, seeded, final_stage)
    records = read_run(layout)
    if missing := missing_results(layout, records.status):  # "not run" would be wrong: refuse, report/ untouched
        (file, why), rest = missing[0], [f for f, _ in missing[1:]]
        more = f" (and {len(rest)} more: {', '.join(rest[:2])})" if rest else ""
        raise ReportInputError(
            layout.root / file,
            f"results missing: {why}, but the file is gone{more}; restore it (e.g. from a copy of the run) or "
            "re-run that stage in a new run directory; report/ was left as it was",
        )
    config = records.config
    stages = {s: stage_figures(s, recs, records.settings) for s, recs in records.stages.items()}
    ref_records = _resilience(records, stages, reference, predict)
    _learner_goodput(records, stages)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "run": _run_meta(layout, config),
        "setup": setup(records.settings),
        "pipeline": pipeline_status(records.status, final_stage),
        "manifest": {
            "status": "ok" if records.manifest is not None else NOT_RUN,
            "items": manifest_items(records.manifest) if records.manifest is not None else [],
        },
        "definitions": {"bytes": BYTES_CONVENTION, "stale_contribution": STALE_DEFINITION},
        "stages": stages,
        "finetune": post_training_figures(records.finetune),
        "config": config,
    }
    pre = stages.get("pretrain") or {}
    if {"diloco", "dp"} <= set(pre.get("methods") or {}):
        parent = layout.root.parent
        report["verdict"] = verdict(
            {"run": report},
            part_of_seeds=parent.name == "seeds"
            and len((read_json(RunLayout(parent.parent).config) or {}).get("seeds") or []) > 1,
        )

    _draw_figures(report, records, ref_records, layout.report)
    # What is on disk is what is returned: round-trip through strict JSON once.
    report = json.loads(json.dumps(json_safe(report), allow_nan=False))
    atomic.write_json(layout.report_json, report, newline=True, default=None, allow_nan=False)
    atomic.write_text(layout.report_md, markdown := render_markdown(report))
    # the same report as one file to share: figures inlined (after the PNGs it inlines are written)
    atomic.write_text(layout.report_html, report_html(markdown, layout.report, f"Run report: {report['run']['name']}"))
    return report
