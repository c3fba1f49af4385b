"""Rendering of the run report (package-private; use :mod:`evals.report`).

:func:`render_markdown` turns the dict that ``evals.report.build_report`` returns into the text of
``report.md``. It computes no figure of its own: every number it prints is read from that dict, so
``report.md`` and ``report.json`` cannot disagree, and a figure shown in two places of the markdown
is the same value both times.
"""

from __future__ import annotations

import json
from typing import Any

METHODS = ("diloco", "dp")
LABELS = {"diloco": "Decoupled DiLoCo", "dp": "Data-parallel"}
NOT_RUN = "not run"
PAPER = ('Decoupled DiLoCo (Douillard et al., "Decoupled DiLoCo for Resilient Distributed '
         'Pre-training", arXiv 2604.21428, 2026)')

# What each byte figure counts. report.json carries these texts (``bytes.definitions``) next to the
# numbers, and report.md prints them under the bytes table.
BYTES_CONVENTION = (
    "Bytes are payload bytes (tensor bytes, no framing). DiLoCo, counted by the learners: "
    "learner→syncer submission payload bytes (every fragment a learner sent, merged or not) and "
    "syncer→learner pulled bytes (every global fragment a learner pulled, including the pull at "
    "the start of each attempt); counted by the syncer in its merge log: bytes_in (submission "
    "bytes that went into merges) and bytes_out (fragment bytes × M per merge, the publish fan-out "
    "if every learner pulled every version). DP, counted by the model of a ring all-reduce of the "
    "gradient: each of the M workers sends 2(M−1)/M × the gradient bytes per step and receives as "
    "many, so the all-reduce bytes (sent + received, all workers) split evenly: half sent, half "
    "received. \"All\" figures are summed over all learners/workers and attempts; \"per\" figures "
    "are that sum divided by M."
)
STALE_DEFINITION = (
    "a stale contribution is a submission merged into a global fragment newer than the one it was "
    "based on, i.e. the syncer had merged that fragment again after the learner pulled it: "
    "merge-log stale > 0 versions behind"
)


# --------------------------------------------------------------------------------------------
# Cells and tables
# --------------------------------------------------------------------------------------------


def format_value(v: Any, fmt: str = "") -> str:
    """A table cell: ``None`` → "—", strings as is, ints with thousands separators,
    ``fmt == "bytes"`` → "12,345,678 (11.8 MiB)", otherwise ``fmt.format(v)``."""
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(", ", ": "))
    if fmt == "bytes":
        n, unit = float(v), "B"
        for u in ("KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024:
                break
            n, unit = n / 1024, u
        return f"{int(round(v)):,}" + (f" ({n:.1f} {unit})" if unit != "B" else "")
    if fmt == "int" or (isinstance(v, int) and not fmt):
        return f"{int(round(v)):,}"
    if fmt:
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def format_chance(c: float) -> str:
    """Chance accuracy: "0.25", "0.333"."""
    return f"{c:.3g}"


def row_cell(row: dict, m: str) -> str:
    """One method's cell of a comparison row; eval rows add "± stderr" and "(chance c)"."""
    v = row[m]
    text = format_value(v, row["fmt"])
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        se = (row.get("stderr") or {}).get(m)
        if se is not None:
            text += " ± " + format_value(se, row["fmt"])
        if row.get("chance") is not None:
            text += f" (chance {format_chance(row['chance'])})"
    return text


def row_label(row: dict) -> str:
    return row["label"] + (f" ({row['unit']})" if row["unit"] else "")


def _cell_text(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell_text(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def bytes_or_missing(figures: dict, key: str) -> str:
    """A merge-log byte total, or "not recorded" when (some) merge records lack the field."""
    if figures.get(key) is not None:
        return format_value(figures[key], "bytes")
    n, of = figures.get(f"{key}_recorded", 0), figures.get("merge_records", 0)
    return "not recorded" + (f" (in {n} of {of} merge records)" if n else "")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _header(report: dict, L: list[str]) -> None:
    run, methods = report["run"], report["methods"]
    L.append(f"# Run report: {run['name']}")
    L.append("")
    # Right under the title: whatever makes the rest of the report read differently.
    tops = [x["headline"] for x in (report.get("pipeline"), report.get("work_lost"))
            if x and x.get("headline")]
    for t in tops:
        L.append(t)
        L.append("")
    L.append(f"{PAPER} compared with a data-parallel baseline on the same data and token budget.")
    L.append("")
    vers = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    L.append(f"- run directory: `{run['run_dir']}`")
    L.append(f"- generated: {run['generated_at']}")
    L.append(f"- git commit: `{run['git_commit']}`")
    L.append(f"- versions: {vers}")
    pl = report.get("pipeline")
    if pl:
        stages = ", ".join(pl["completed_stages"]) or "none"
        status = ("running: this report is built as its last stage" if pl["status"] == "running"
                  else pl["status"])
        L.append(f"- pipeline status: {status} (completed stages: {stages})"
                 + (f"; reason: {pl['reason']}" if pl.get("reason") else ""))
    for m in METHODS:
        if methods[m]["status"] != "ok":
            L.append(f"- {LABELS[m]} pretraining: **{NOT_RUN}**")
        elif methods[m].get("interrupted"):
            L.append(f"- {LABELS[m]} pretraining: **interrupted** (stopped early; its figures cover the "
                     "tokens it trained on)")
        if methods[m]["eval_status"] != "ok":
            L.append(f"- {LABELS[m]} lm-eval: **{NOT_RUN}**")
    L.append("")


def _comparison_section(report: dict, L: list[str]) -> None:
    L.append("## DiLoCo vs data-parallel")
    L.append("")
    rows = [[row_label(r)] + [row_cell(r, m) for m in METHODS]
            for r in report["comparison"] if r["group"] == "training"]
    L.append(_table(["metric", LABELS["diloco"], LABELS["dp"]], rows))
    L.append("")
    L.append("Loss is the mean next-token cross entropy on the same held-out batches for both methods "
             "(nats/token; DiLoCo measured on the syncer's global parameters). Bytes: see "
             "*Bytes on the wire* below.")
    L.append("")
    gap = report["loss_gap"]
    if gap["status"] == "ok":
        L.append(
            f"**Loss gap:** DiLoCo's final held-out loss is {gap['gap_pct']:+.2f}% relative to DP's "
            f"(100 × ({gap['diloco_loss']:.4f} − {gap['dp_loss']:.4f}) / {gap['dp_loss']:.4f}); "
            "negative means DiLoCo is better."
        )
    else:
        L.append(f"**Loss gap:** {gap['status']} ({gap['why']}).")
    L.append("")


def _eval_section(report: dict, L: list[str]) -> None:
    L.append("## Evaluation (lm-eval, zero-shot)")
    L.append("")
    rows = [r for r in report["comparison"] if r["group"] == "eval"]
    if not rows:
        L.append(f"*lm-eval: {NOT_RUN} for either method.*")
        L.append("")
        return
    L.append(_table(["metric", LABELS["diloco"], LABELS["dp"]],
                    [[row_label(r)] + [row_cell(r, m) for m in METHODS] for r in rows]))
    L.append("")
    L.append("Values are lm-eval's; \"± x\" is lm-eval's standard error of the metric and \"(chance c)\" "
             "the accuracy of guessing uniformly among each question's choices. Truncated requests "
             "are contexts cut to fit the window (the model's maximum length), counted over all tasks.")
    L.append("")


def _bytes_section(report: dict, L: list[str]) -> None:
    L.append("## Bytes on the wire")
    L.append("")
    b = report["bytes"]
    rows = [[row_label(r), r["counted_by"]] + [row_cell(r, m) for m in METHODS]
            for r in report["comparison"] if r["group"] == "bytes"]
    L.append(_table(["figure", "counted by", LABELS["diloco"], LABELS["dp"]], rows))
    L.append("")
    L.append(BYTES_CONVENTION)
    L.append("")
    d = b["diloco"]
    if d.get("merged_in") is not None or d.get("published_out") is not None:
        L.append(
            "Pulled bytes differ from published bytes: a learner pulls a fragment when it sees a newer "
            "version (skipping versions merged meanwhile) and pulls all fragments again when an "
            "attempt starts, whereas published bytes count every merge once per learner."
        )
        L.append("")


def _loss_curves(report: dict, L: list[str]) -> None:
    methods = report["methods"]
    L.append("## Held-out loss curves")
    L.append("")
    for key, alt in (("loss_vs_tokens", "held-out loss vs training tokens"),
                     ("loss_vs_time", "held-out loss vs wall-clock seconds")):
        p = report["plots"].get(key)
        L.append(f"![{alt}]({p})" if p else f"*{alt}: {NOT_RUN} (no eval curve).*")
        L.append("")
    crow = [[LABELS[m], c.get("points", 0), format_value(c.get("final_tokens"), "int"),
             format_value(c.get("final_wall_s"), "{:.1f}"), format_value(c.get("final_loss"), "{:.4f}"),
             format_value(c.get("best_loss"), "{:.4f}")]
            for m in METHODS for c in [methods[m]["curve"]]]
    L.append(_table(["method", "points", "last tokens", "last wall (s)", "last loss (nats)", "best loss (nats)"], crow))
    L.append("")


def _hyper_and_data(report: dict, L: list[str]) -> None:
    L.append("## Hyperparameters")
    L.append("")
    if report["hyperparameters"]:
        L.append(_table(["hyperparameter", LABELS["diloco"], LABELS["dp"]],
                        [[h["name"], format_value(h["diloco"]), format_value(h["dp"])]
                         for h in report["hyperparameters"]]))
    else:
        L.append(f"*{NOT_RUN}: no method summary recorded hyperparameters.*")
    L.append("")
    L.append("## Data")
    L.append("")
    man = report["manifest"]
    if man["status"] == "ok":
        L.append(_table(["manifest field", "value"], man["items"]))
    else:
        L.append(f"*data manifest: {NOT_RUN}.*")
    L.append("")


def _ledger_section(report: dict, L: list[str]) -> None:
    L.append("## DiLoCo token ledger (tokens per learner)")
    L.append("")
    led = report["ledger"]
    if led["status"] == "ok":
        cols = led["columns"]

        def _lcell(v: Any) -> str:
            if isinstance(v, dict):
                return "; ".join(f"{k}: {format_value(x, 'int')}" for k, x in v.items()) or "—"
            return format_value(v, "int")

        rows = [[r["learner"]] + [_lcell(r[c]) for c in cols] + [format_value(r["merged_pct"], "{:.1f}")]
                for r in [*led["rows"], led["total"]]]
        L.append(_table(["learner"] + cols + ["merged % of processed"], rows))
        L.append("")
        p = led.get("fragments")
        tol = f"±{led['tolerance']} tokens (P = {p})" if p else f"±{led['tolerance']} token"
        L.append(
            "Tokens per learner: processed = trained on, submitted = sent to the syncer, not_submitted "
            "= processed but never sent (progress overwritten when a newer global fragment arrived, or "
            "still local at stop"
            + ("; computed here as processed − submitted, as this summary does not record it"
               if led.get("not_submitted_computed") else "")
            + "), merged = in a merged global fragment, dropped = rejected by the syncer (drop_reasons "
            "by reason), pending = submitted but not yet merged at stop, attempts = task attempts; "
            "the syncer's counts are averaged over the P fragments and rounded, and per learner "
            f"processed = submitted + not_submitted and submitted = merged + dropped + pending hold "
            f"within {tol}."
        )
        for v in led.get("identity_violations") or []:
            L.append("")
            L.append(f"**Ledger check failed:** learner {v['learner']}: {v['identity']} is off by "
                     f"{v['difference']:+,} tokens (more than {tol}).")
    else:
        L.append(f"*token ledger: {led['status']}.*")
    L.append("")
    wl = report.get("work_lost")
    if wl:
        reasons = ", ".join(f"{k} {_pct(x)}" for k, x in wl["drop_reason_fractions"].items())
        L.append(
            f"**Work lost:** {format_value(wl['dropped_tokens'], 'int')} of "
            f"{format_value(wl['processed_tokens'], 'int')} processed tokens dropped "
            f"({_pct(wl['dropped_fraction'])}" + (f": {reasons}" if reasons else "") + "); "
            f"warning above {_pct(wl['warn_above'])} (diloco.warn_dropped_fraction), run fails above "
            f"{_pct(wl['fail_above'])} (diloco.max_dropped_fraction); status: {wl['status']}."
        )
        L.append("")


def _chaos_section(report: dict, L: list[str]) -> None:
    ch = report["chaos"]
    L.append("## Scheduled chaos events")
    L.append("")
    if ch["status"] != "ok":
        L.append(f"*chaos schedule: {ch['status']}.*")
        L.append("")
        return
    if not ch["rows"]:
        L.append("No failures were scheduled (config chaos.failures is empty).")
        L.append("")
        return
    rows = []
    for r in ch["rows"]:
        if r["fired"] is None:
            fired, at, back = "unknown (no learner log)", "—", "—"
        elif r["fired"]:
            fired = "yes"
            at = format_value(r["fired_at_s"], "{:.1f}")
            back = format_value(r["rejoined_at_s"], "{:.1f}") if r["rejoined_at_s"] is not None else "never"
        else:
            fired, at, back = "no", "did not fire", "—"
        rows.append([r["event"], fired, at, back, r["note"] or "—"])
    L.append(_table(["scheduled event", "fired", "at t (s)", "rejoined at t (s)", "note"], rows))
    L.append("")
    L.append("A scheduled failure fired when the learners log holds a failure of that learner whose reason "
             "is the injected failure at that local step; rejoined is the start of its next attempt "
             "(seconds since training start).")
    L.append("")


def _merges_section(report: dict, L: list[str]) -> None:
    L.append("## Merges and learner failures")
    L.append("")
    mg, d = report["merges"], report["bytes"]["diloco"]
    if mg["status"] == "ok":
        by = ", ".join(f"fragment {k}: {v}" for k, v in mg["by_fragment"].items()) or "none"
        L.append(
            f"{mg['count']} merges ({by}); mean contributors per merge "
            f"{format_value(mg['mean_contributors'], '{:.2f}')}; "
            f"from {format_value(mg['first_s'], '{:.1f}')} s to {format_value(mg['last_s'], '{:.1f}')} s."
        )
        L.append("")
        worst = mg["max_stale_versions"]
        worst = (f", at most {worst} version{'' if worst == 1 else 's'} behind"
                 if mg["stale_contributions"] else "")
        L.append(f"Stale contributions: {mg['stale_contributions']} of {mg['contributions']} contributions "
                 f"to merges{worst} ({STALE_DEFINITION}).")
        L.append("")
        L.append(
            f"Merge-log bytes: bytes_in (submission bytes merged) {bytes_or_missing(d, 'merged_in')}; "
            f"bytes_out (syncer publishes: fragment bytes × learners) {bytes_or_missing(d, 'published_out')}."
        )
    elif mg["status"] == "from summary":
        L.append(f"{mg['count']} merges (from {mg['source']}; no merge log).")
    else:
        L.append(f"*merge log: {NOT_RUN}.*")
    L.append("")
    lt = report["learners"]
    if lt["status"] == "ok" and lt["rows"]:
        L.append(_table(["learner", "starts", "failures", "dropped submissions", "last step", "ended by"],
                        [[r["learner"], r["starts"], r["failures"], r["dropped_submissions"],
                          format_value(r["last_step"]), format_value(r["ended"])] for r in lt["rows"]]))
        L.append("")
    if report["failures"]:
        rows = []
        for f in report["failures"]:
            rows.append([
                f["learner"], format_value(f["attempt"]), format_value(f["failed_at_s"], "{:.1f}"),
                format_value(f["failed_at_step"]), format_value(f["reason"]),
                format_value(f["restarted_at_s"], "{:.1f}") if f["restarted_at_s"] is not None else "never",
                format_value(f["downtime_s"], "{:.1f}"), f["merges_while_down"],
                ", ".join(f"{k}: {v}" for k, v in f["merges_while_down_by_fragment"].items()) or "—",
                f["merges_while_down_with_learner"],
                "yes" if f["merged_again_after_restart"] else "no",
            ])
        L.append(_table(
            ["learner", "attempt", "failed at (s)", "inner steps done", "reason", "restarted at (s)", "down for (s)",
             "merges while down", "by fragment", "…of which with its earlier submissions",
             "its submissions merged after restart"],
            rows,
        ))
        L.append("")
        L.append("Merges while down count every merge the syncer made between the failure and the "
                 "learner's next start (seconds since training start), i.e. training that continued "
                 "without it.")
    elif lt["status"] == "ok":
        missed = [r for r in report["chaos"].get("rows", []) if r["fired"] is False]
        if missed:
            L.append(f"No learner failures were logged, although {len(missed)} "
                     f"{'was' if len(missed) == 1 else 'were'} scheduled: "
                     f"{'it' if len(missed) == 1 else 'they'} did not fire (see *Scheduled chaos events*).")
        else:
            L.append("No learner failures.")
    else:
        L.append(f"*learner events: {NOT_RUN}.*")
    L.append("")
    if report["plots"].get("merges_over_time"):
        L.append(f"![merges per fragment over time]({report['plots']['merges_over_time']})")
        L.append("")


def render_markdown(report: dict) -> str:
    """The ``report.md`` text for a report dict from ``build_report`` (pure)."""
    L: list[str] = []
    _header(report, L)
    if report.get("setup"):
        L.append("## Setup")
        L.append("")
        L.append(_table(["setting", "value"], [[k, format_value(v)] for k, v in report["setup"].items()]))
        L.append("")
    _comparison_section(report, L)
    _eval_section(report, L)
    _bytes_section(report, L)
    _loss_curves(report, L)
    _hyper_and_data(report, L)
    _ledger_section(report, L)
    _chaos_section(report, L)
    _merges_section(report, L)
    if report["notes"]:
        L.append("## Notes")
        L.append("")
        L += [f"- {n}" for n in report["notes"]]
        L.append("")
    return "\n".join(L)
