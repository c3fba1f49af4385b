"""Rendering of the run report: ``report.md`` from the dict that :func:`reports.build_report` returns.

:func:`render_markdown` computes no figure of its own: every number it prints is read from that
dict, so ``report.md`` and ``report.json`` cannot disagree. Layout: docs/report.md.
"""

from __future__ import annotations

from typing import Any

from reports.analyses import COMPLETING_TEXT
from reports.common import (
    BASELINE,
    BYTES_CONVENTION,
    NOT_RUN,
    PAPER,
    STALE_DEFINITION,
    format_value,
    label,
    md_table,
    per_unit,
    short_label,
)
from reports.experts import markdown_section
from reports.verdict import verdict_markdown


def row_cell(row: dict, m: str) -> str:
    """One method's cell of a comparison row; eval rows add "± stderr" and "(chance c)"."""
    v = row.get(m)
    text = format_value(v, row["fmt"])
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        se = (row.get("stderr") or {}).get(m)
        if se is not None:
            text += " ± " + format_value(se, row["fmt"])
        if row.get("chance") is not None:
            text += f" (chance {row['chance']:.3g})"
    return text


def row_label(row: dict) -> str:
    """The row's label with its unit: "training tokens (tokens)"."""
    return row["label"] + (f" ({row['unit']})" if row["unit"] else "")


def bytes_or_missing(figures: dict, key: str) -> str:
    """A merge-log byte total, or "not recorded" when (some) merge records lack the field."""
    if figures.get(key) is not None:
        return format_value(figures[key], "bytes")
    n, of = figures.get(f"{key}_recorded", 0), figures.get("merge_records", 0)
    return "not recorded" + (f" (in {n} of {of} merge records)" if n else "")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def headlines(report: dict) -> list[str]:
    """The bold lines right under the title: the pipeline's state, then each method that trained short
    of its budget (unless the pipeline's reason already says so), then each method's lost work."""
    pipeline = report.get("pipeline") or {}
    methods = [f for s in report["stages"].values() for f in s["methods"].values()]
    short = [
        b
        for f in methods
        if (b := f.get("budget")) and b.get("headline") and b["line"] not in (pipeline.get("reason") or "")
    ]
    found = [pipeline] + short + [f.get("work_lost") for f in methods]
    return [x["headline"] for x in found if x and x.get("headline")]


def _header(report: dict, L: list[str]) -> None:
    run = report["run"]
    L += [f"# Run report: {run['name']}", ""]
    for t in headlines(report):  # whatever makes the rest of the report read differently
        L += [t, ""]
    unit = next(iter(report["stages"].values()), {}).get("unit", "tokens")
    L += [f"{PAPER} compared with a data-parallel baseline on the same data and {per_unit(unit)} budget.", ""]
    L.append(f"- run directory: `{run['run_dir']}`")
    L.append(f"- generated: {run['generated_at']}")
    L.append(f"- git commit: `{run['git_commit']}`")
    L.append(f"- versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}")
    for key in ("backend", "precision"):  # what the methods trained on and in (their summaries)
        seen = {
            m: f["hyperparameters"][key]
            for s in report["stages"].values()
            for m, f in s["methods"].items()
            if key in (f.get("hyperparameters") or {})
        }
        if seen:
            values = sorted(set(seen.values()))
            L.append(
                f"- {key}: "
                + (values[0] if len(values) == 1 else "; ".join(f"{label(m)} {v}" for m, v in seen.items()))
            )
    pl = report.get("pipeline")
    if pl:
        done = pl["completed_stages"] + (["report"] if pl["status"] == "completing" else [])
        stages = ", ".join(done) or "none"
        status = {
            # the run's own last stage writes this report: once it is written the run has completed
            # (status.json records "completed" right after)
            "completing": COMPLETING_TEXT,
            "running": "running, or stopped without recording an end (a killed process): status.json says running",
        }.get(pl["status"], pl["status"])
        L.append(
            f"- pipeline status: {status} (completed stages: {stages})"
            + (f"; reason: {pl['reason']}" if pl.get("reason") else "")
        )
    if not report["stages"] and not report.get("finetune"):
        L.append(f"- training: **{NOT_RUN}** (no stage of this run holds a trained method)")
    if not report.get("verdict"):  # (the verdict, right below, has the post-training difference)
        L += _post_training_headline(report.get("finetune"))
    for st in report["stages"].values():
        noun = st["label"].lower()
        for m, f in st["methods"].items():
            if f["status"] != "ok":
                L.append(f"- {label(m)} {noun}: **{NOT_RUN}**")
            elif f.get("interrupted"):
                L.append(
                    f"- {label(m)} {noun}: **interrupted** (stopped early; its figures cover the tokens it trained on)"
                )
            if f["eval_status"] != "ok":
                L.append(f"- {label(m)} lm-eval after {noun}: **{NOT_RUN}**")
    L.append("")


def _side_by_side(st: dict, group: str, first: list[str], extra=None) -> tuple[list[str], list[list[str]]]:
    methods = list(st["methods"])
    rows = [
        [row_label(r)] + (extra(r) if extra else []) + [row_cell(r, m) for m in methods]
        for r in st["comparison"]
        if r["group"] == group
    ]
    return first + [label(m) for m in methods], rows


def _comparison_section(st: dict, L: list[str]) -> None:
    others = [short_label(m) for m in st["methods"] if m != BASELINE]
    vs = " vs data-parallel" if st["baseline"] else ""
    L += [f"### {', '.join(others) or 'data-parallel'}{vs if others else ''}", ""]
    L += [md_table(*_side_by_side(st, "training", ["metric"])), ""]
    every = "both methods" if len(st["methods"]) == 2 else "every method"
    unit = st.get("unit", "tokens")
    what = "next-token cross entropy" if unit == "tokens" else "cross entropy of the class labels"
    L += [
        f"Loss is the mean {what} on the same held-out batches for {every} "
        f"(nats/{per_unit(unit)}; DiLoCo measured on the syncer's global parameters; without an MoE model's "
        "auxiliary losses). Bytes: see *Bytes on the wire* below.",
        "",
    ]
    gaps = st["loss_gaps"]
    for m, gap in gaps.items():
        who, base = short_label(m), short_label(gap["baseline"])
        head = "**Loss gap:**" if len(gaps) == 1 else f"**Loss gap, {who} vs {base}:**"
        if gap["status"] == "ok":
            a, b = gap["method_loss"], gap["baseline_loss"]
            where = "test loss (the whole test split)" if gap.get("split") == "test" else "held-out loss"
            L.append(
                f"{head} {who}'s final {where} is {gap['gap_pct']:+.2f}% relative to {base}'s "
                f"(100 × ({a:.4f} − {b:.4f}) / {b:.4f}); negative means {who} is better."
            )
        else:
            L.append(f"{head} {gap['status']} ({gap['why']}).")
        L.append("")


def _eval_section(st: dict, L: list[str]) -> None:
    images = st.get("unit") == "images"
    L += ["### Evaluation (held-out test images)" if images else "### Evaluation (lm-eval, zero-shot)", ""]
    headers, rows = _side_by_side(st, "eval", ["metric"])
    if not rows:
        what = "test evaluation" if images else "lm-eval"
        L += [f"*{what}: {NOT_RUN} for {'either' if len(st['methods']) == 2 else 'any'} method.*", ""]
        return
    L += [md_table(headers, rows), ""]
    if images:
        L += [
            "Top-1 accuracy and mean cross entropy (nats/image) over every image of the test split "
            '(stratified, never trained or tuned on); "± x" is the binomial standard error √(p(1−p)/N).',
            "",
        ]
        if (st.get("plots") or {}).get("confusion"):
            L += [f"![confusion matrices]({st['plots']['confusion']})", ""]
        return
    L += [
        'Values are lm-eval\'s; "± x" is lm-eval\'s standard error of the metric and "(chance c)" '
        "the accuracy of guessing uniformly among each question's choices. Truncated requests "
        "are contexts cut to fit the window (the model's maximum length), counted over all tasks.",
        "",
    ]


def _bytes_section(st: dict, L: list[str]) -> None:
    L += ["### Bytes on the wire", ""]
    L += [md_table(*_side_by_side(st, "bytes", ["figure", "counted by"], lambda r: [r["counted_by"]])), ""]
    L += [BYTES_CONVENTION, ""]
    for m, f in st["methods"].items():
        L += _per_token_line(short_label(m), f["bytes"])
    if any(
        f["bytes"].get("merged_in") is not None or f["bytes"].get("published_out") is not None
        for f in st["methods"].values()
    ):
        L += [
            "Pulled bytes differ from published bytes: a learner pulls a fragment when it sees a newer "
            "version (skipping versions merged meanwhile) and pulls all fragments again when an "
            "attempt starts, whereas published bytes count every merge once per learner.",
            "",
        ]


def _per_token_line(who: str, d: dict) -> list[str]:
    """A learners-and-syncer method's bytes sent per token against DP's all-reduce of the same model."""
    dp = d.get("dp_allreduce")
    if d.get("kind") != "syncer" or d.get("sent_per_token") is None or not dp:
        return []
    wire = d.get("wire") or "float32"
    what = "its parameters θ" if wire == "float32" else "its update Δ = θ − Θ_base"
    return [
        f"**Bytes per token.** {who}'s learners sent {d['sent_per_token']:,.1f} bytes per training token "
        f"(wire format {wire}: {what}; the syncer publishes float32). DP's ring all-reduce of this model's "
        f"float32 gradient ({dp['gradient_bytes']:,} bytes, W = {dp['workers']} workers, "
        f"{dp['tokens_per_step']:,} tokens per step) sends 2(W − 1) × {dp['gradient_bytes']:,} ÷ "
        f"{dp['tokens_per_step']:,} = {dp['sent_per_token']:,.1f} bytes per token, "
        f"{d['sent_vs_dp']:,.1f}× as many as {who}'s learners.",
        "",
    ]


def _curves(st: dict, L: list[str]) -> None:
    L += ["### Held-out loss curves", ""]
    for key, alt in (
        ("loss_vs_tokens", "held-out loss vs training tokens"),
        ("loss_vs_time", "held-out loss vs wall-clock seconds"),
    ):
        p = st["plots"].get(key)
        L += [f"![{alt}]({p})" if p else f"*{alt}: {NOT_RUN} (no eval curve).*", ""]
    _interconnect(st.get("interconnect"), st["plots"].get("loss_vs_modelled_time"), L)
    rows = [
        [
            label(m),
            c.get("points", 0),
            format_value(c.get("final_tokens"), "int"),
            format_value(c.get("final_wall_s"), "{:.1f}"),
            format_value(c.get("final_loss"), "{:.4f}"),
            format_value(c.get("best_loss"), "{:.4f}"),
        ]
        for m, f in st["methods"].items()
        for c in [f["curve"]]
    ]
    L += [
        md_table(
            [
                "method",
                "points",
                f"last {st.get('unit', 'tokens')}",
                "last wall (s)",
                "last loss (nats)",
                "best loss (nats)",
            ],
            rows,
        ),
        "",
    ]


def _hyperparameters(st: dict, L: list[str]) -> None:
    """The stage's hyperparameters side by side (the report's appendix)."""
    L += [f"## Hyperparameters: {st['label']}", ""]
    if st["hyperparameters"]:
        L.append(
            md_table(
                ["hyperparameter"] + [label(m) for m in st["methods"]],
                [[h["name"]] + [format_value(h[m]) for m in st["methods"]] for h in st["hyperparameters"]],
            )
        )
    else:
        L.append(f"*{NOT_RUN}: no method summary recorded hyperparameters.*")
    L.append("")


def _interconnect(net: dict | None, plot: str | None, L: list[str]) -> None:
    """Time under the stated interconnect (``reports.interconnect``): one row per method, the plot."""
    if not net:
        return
    L += ["### Time under a stated interconnect", "", f"*{net['assumption']}.*", ""]
    rows = [
        [
            label(m),
            format_value(f["compute_s"], "{:.3f}"),
            format_value(f["comm_s"], "{:.3f}"),
            format_value(f["extra_s"], "{:.3f}"),
            format_value(f["keep_up_gbps"], "{:.4f}"),
            format_value(f["measured_wall_s"], "{:.1f}"),
            format_value(f["modelled_wall_s"], "{:.1f}"),
            format_value(net["time_to_dp_final_s"].get(m), "{:.1f}"),
        ]
        for m, f in net["methods"].items()
    ]
    L += [
        md_table(
            [
                "method",
                "compute per step (s)",
                "communication (s)",
                "added per step (s)",
                "Gbit/s to keep up",
                "measured wall (s)",
                "modelled wall (s)",
                "modelled s to DP's final loss",
            ],
            rows,
        ),
        "",
    ]
    L += [
        "Communication: DP's ring all-reduce per step; DiLoCo's fragment round trip (a learner moves its "
        'fragments and store requests in line with its steps: its added seconds). "Gbit/s to keep up": '
        "each step's traffic, per direction, moved within one step's compute "
        "(the paper's framing: DP 198 Gbit/s against 0.84 Gbit/s for Decoupled DiLoCo across eight datacenters). "
        "A method that never reached DP's final loss shows —.",
        "",
    ]
    if plot:
        L += [f"![held-out loss vs modelled seconds]({plot})", ""]


def _ledger_section(f: dict, who: str, L: list[str], unit: str = "tokens") -> None:
    L += [f"### {who} {per_unit(unit)} ledger ({unit} per learner)", ""]
    led = f["ledger"]
    if led["status"] == "ok":
        cols = led["columns"]

        def _lcell(v: Any) -> str:
            if isinstance(v, dict):
                return "; ".join(f"{k}: {format_value(x, 'int')}" for k, x in v.items()) or "—"
            return format_value(v, "int")

        rows = [
            [r["learner"]] + [_lcell(r[c]) for c in cols] + [format_value(r["merged_pct"], "{:.1f}")]
            for r in [*led["rows"], led["total"]]
        ]
        L += [md_table(["learner"] + cols + ["merged % of processed"], rows), ""]
        p = led.get("fragments")
        tol = f"±{led['tolerance']} {unit} (P = {p})" if p else f"±{led['tolerance']} {per_unit(unit)}"
        L.append(
            f"{unit.capitalize()} per learner: processed = trained on, submitted = sent to the syncer, not_submitted "
            "= processed but never sent (progress overwritten when a newer global fragment arrived, or "
            "still local at stop"
            + (
                "; computed here as processed − submitted, as this summary does not record it"
                if led.get("not_submitted_computed")
                else ""
            )
            + "), merged = in a merged global fragment, "
            + (
                "recomputed = trained again by a restarted learner after that work had been merged (sent, "
                "not merged twice), "
                if "recomputed" in cols
                else ""
            )
            + "dropped = rejected by the syncer (drop_reasons "
            "by reason), pending = submitted but not yet merged at stop, attempts = task attempts; "
            "the syncer's counts are averaged over the P fragments and rounded, and per learner "
            "processed = submitted + not_submitted and submitted = merged + "
            + ("recomputed + " if "recomputed" in cols else "")
            + f"dropped + pending hold within {tol}."
        )
        for v in led.get("identity_violations") or []:
            L += [
                "",
                f"**Ledger check failed:** learner {v['learner']}: {v['identity']} is off by "
                f"{v['difference']:+,} {unit} (more than {tol}).",
            ]
    else:
        L.append(f"*token ledger: {led['status']}.*")
    L.append("")
    wl = f.get("work_lost")
    if wl:
        reasons = ", ".join(f"{k} {_pct(x)}" for k, x in wl["drop_reason_fractions"].items())
        L += [
            f"**Work lost:** {format_value(wl['dropped_tokens'], 'int')} of "
            f"{format_value(wl['processed_tokens'], 'int')} processed {unit} dropped "
            f"({_pct(wl['dropped_fraction'])}" + (f": {reasons}" if reasons else "") + "); "
            f"warning above {_pct(wl['warn_above'])} (diloco.warn_dropped_fraction), run fails above "
            f"{_pct(wl['fail_above'])} (diloco.max_dropped_fraction); status: {wl['status']}.",
            "",
        ]


def _chaos_section(f: dict, suffix: str, L: list[str], resilience: bool = False) -> None:
    """Scheduled chaos events of one syncer-run method; ``resilience``: the stage has a Resilience
    section (a drawn chaos schedule), which the text then points to."""
    ch = f["chaos"]
    L += [f"### Scheduled chaos events{suffix}", ""]
    if ch["status"] != "ok":
        L += [f"*chaos schedule: {ch['status']}.*", ""]
        return
    if not ch["rows"]:
        L += [
            "No step-scheduled failures or kills (config chaos.events holds no fail at a step and no kill)"
            + ("; the drawn chaos schedule's events are in *Resilience*." if resilience else "."),
            "",
        ]
        return
    rows = []
    for r in ch["rows"]:
        if r["fired"] is None:
            fired, at, back = "unknown (no learner log)", "—", "—"
        elif r["fired"]:
            fired, at = "yes", format_value(r["fired_at_s"], "{:.1f}")
            back = format_value(r["rejoined_at_s"], "{:.1f}") if r["rejoined_at_s"] is not None else "never"
        else:
            fired, at, back = "no", "did not fire", "—"
        rows.append([r["event"], fired, at, back, r["note"] or "—"])
    L += [md_table(["scheduled event", "fired", "at t (s)", "rejoined at t (s)", "note"], rows), ""]
    L += [
        "A scheduled failure fired when the learners log holds a failure of that learner whose reason "
        "is the injected failure at that local step (a kill: the SIGKILL logged just before it); "
        "rejoined is the start of its next attempt (seconds since training start).",
        "",
    ]


def _merges_section(f: dict, suffix: str, L: list[str]) -> None:
    L += [f"### Merges and learner failures{suffix}", ""]
    mg, d = f["merges"], f["bytes"]
    if mg["status"] == "ok":
        by = ", ".join(f"fragment {k}: {v}" for k, v in mg["by_fragment"].items()) or "none"
        L += [
            f"{mg['count']} merges ({by}); mean contributors per merge "
            f"{format_value(mg['mean_contributors'], '{:.2f}')}; "
            f"from {format_value(mg['first_s'], '{:.1f}')} s to {format_value(mg['last_s'], '{:.1f}')} s.",
            "",
        ]
        worst = mg["max_stale_versions"]
        worst = f", at most {worst} version{'' if worst == 1 else 's'} behind" if mg["stale_contributions"] else ""
        L += [
            f"Stale contributions: {mg['stale_contributions']} of {mg['contributions']} contributions "
            f"to merges{worst} ({STALE_DEFINITION}).",
            "",
        ]
        L.append(
            f"Merge-log bytes: bytes_in (submission bytes merged) {bytes_or_missing(d, 'merged_in')}; "
            f"bytes_out (syncer publishes: fragment bytes × learners) {bytes_or_missing(d, 'published_out')}."
        )
    elif mg["status"] == "from summary":
        L.append(f"{mg['count']} merges (from {mg['source']}; no merge log).")
    else:
        L.append(f"*merge log: {NOT_RUN}.*")
    L.append("")
    lt = f["learners"]
    if lt["status"] == "ok" and lt["rows"]:
        L += [
            md_table(
                ["learner", "starts", "failures", "dropped submissions", "last step", "ended by"],
                [
                    [
                        r["learner"],
                        r["starts"],
                        r["failures"],
                        r["dropped_submissions"],
                        format_value(r["last_step"]),
                        format_value(r["ended"]),
                    ]
                    for r in lt["rows"]
                ],
            ),
            "",
        ]
    if f["failures"]:
        rows = [
            [
                x["learner"],
                format_value(x["attempt"]),
                format_value(x["failed_at_s"], "{:.1f}"),
                format_value(x["failed_at_step"]),
                format_value(x["reason"]),
                format_value(x["restarted_at_s"], "{:.1f}") if x["restarted_at_s"] is not None else "never",
                format_value(x["downtime_s"], "{:.1f}"),
                x["merges_while_down"],
                ", ".join(f"{k}: {v}" for k, v in x["merges_while_down_by_fragment"].items()) or "—",
                x["merges_while_down_with_learner"],
                "yes" if x["merged_again_after_restart"] else "no",
            ]
            for x in f["failures"]
        ]
        L += [
            md_table(
                [
                    "learner",
                    "attempt",
                    "failed at (s)",
                    "inner steps done",
                    "reason",
                    "restarted at (s)",
                    "down for (s)",
                    "merges while down",
                    "by fragment",
                    "…of which with its earlier submissions",
                    "its submissions merged after restart",
                ],
                rows,
            ),
            "",
        ]
        L.append(
            "Merges while down count every merge the syncer made between the failure and the "
            "learner's next start (seconds since training start), i.e. training that continued "
            "without it."
        )
    elif lt["status"] == "ok":
        missed = [r for r in f["chaos"].get("rows", []) if r["fired"] is False]
        if missed:
            one = len(missed) == 1
            L.append(
                f"No learner failures were logged, although {len(missed)} {'was' if one else 'were'} "
                f"scheduled: {'it' if one else 'they'} did not fire (see *Scheduled chaos events{suffix}*)."
            )
        else:
            L.append("No learner failures.")
    else:
        L.append(f"*learner events: {NOT_RUN}.*")
    L.append("")
    if f.get("syncer_restarts"):
        rows = [
            [
                format_value(x["attempt"]),
                x["how"],
                format_value(x["failed_at_s"], "{:.1f}"),
                format_value(x["merges_before"]),
                format_value(x["resumed_at_s"], "{:.1f}") if x["resumed_at_s"] is not None else "never",
                format_value(x["downtime_s"], "{:.1f}"),
                format_value(x["generation"]),
                format_value(x["replayed"]),
                format_value(x["republished"]),
            ]
            for x in f["syncer_restarts"]
        ]
        L += [
            md_table(
                [
                    "syncer attempt",
                    "ended by",
                    "at (s)",
                    "merges by then",
                    "next syncer recovered at (s)",
                    "down for (s)",
                    "its generation",
                    "journal entries replayed",
                    "merges published again",
                ],
                rows,
            ),
            "",
        ]
        L.append(
            "A restarted syncer takes office (a higher generation fences out the old one), loads its "
            "newest checkpoint and replays the journal, publishing only what the exchange lacks."
        )
        L.append("")
    plot = (f.get("plots") or {}).get("merges_over_time")
    if plot:
        L += [f"![merges per fragment over time]({plot})", ""]


def _s(x: float | None) -> str:
    return format_value(x, "{:.2f}")


def _pct_ci(d: dict | None, key: str = "goodput") -> str:
    if not d or d.get(key) is None:
        return "—"
    ci = d.get(f"{key}_ci")
    return f"{100 * d[key]:.1f} %" + (f" ± {100 * ci:.1f}" if ci is not None and ci == ci else "")


def resilience_headline(res: dict) -> str:
    """The Resilience section's summary line (every figure from ``res``, computed elsewhere)."""
    sm, d, p, sim = res["summary"], res.get("diloco") or {}, res.get("dp") or {}, res["simulator"]
    parts = []
    for who, fig in (("DiLoCo", d), ("DP", p)):
        if not fig:
            continue
        up = fig["uptime"]
        cad = up.get("cadence") or {}
        gap = (
            f", longest gap between {'merges' if who == 'DiLoCo' else 'logged steps'} {cad['longest_stall_s']:.2f} s"
            if cad.get("longest_stall_s") is not None
            else ""
        )
        parts.append(f"{who} uptime {_pct(up.get('uptime'))}{gap}, goodput {_pct(fig['global']['goodput'])}")
    line = "**Resilience:** " + "; ".join(parts) + "."
    pred = sim.get("predicted") or {}
    M = sm.get("learners")
    if pred:
        rb = pred.get("diloco_rollback")
        line += (
            f" The goodput simulator predicts, for the same knobs, DiLoCo (M = {M}) "
            f"{_pct_ci(pred.get(f'diloco-{M}'))}"
            + (f" ({_pct_ci(rb)} with rollback to resume points)" if rb else "")
            + f" and DP {_pct_ci(pred.get('dp'))}."
        )
    else:
        line += f" Simulator prediction: {sim['status']}."
    return line


def _resilience_section(res: dict, plots: dict, unit: str, L: list[str]) -> None:
    """The Resilience section: every number from ``res`` (``reports.resilience.resilience_figures``)."""
    L += ["### Resilience", "", resilience_headline(res), ""]
    d, p, sim, loss, sch = res.get("diloco"), res.get("dp"), res["simulator"], res["loss"], res["schedule"]
    if d:
        sp = d["span"]
        L += [
            f"DiLoCo's training span: {sp['length_s']:.2f} s, from the first learner start "
            f"({sp['start_s']:.2f} s on the run clock) to its last event. Seconds per learner:",
            "",
        ]
        secs, g = ("allocated", "running", "straggling", "waiting", "down", "absent", "lost_work"), d["global"]
        rows = [
            [f"{r['learner']}{' (scavenged)' if r['scavenged'] else ''}"]
            + [_s(r[f"{k}_s"]) for k in secs]
            + [_pct(r["goodput"]), r["failures"], r["restarts"], format_value(r["merged_again_after_restart"])]
            for r in d["learners"]
        ]
        for row, r in zip(rows, d["learners"]):  # a scavenged learner's window
            row[1] += (
                (f" ({r['window'][0]:.1f}–{r['window'][1]:.1f} s)" if r["window"] else " (never joined)")
                if r["scavenged"]
                else ""
            )
        rows.append(
            ["**all**"]
            + [_s(g[f"{k}_s"]) for k in secs]
            + [
                f"**{_pct(g['goodput'])}**",
                sum(r["failures"] for r in d["learners"]),
                sum(r["restarts"] for r in d["learners"]),
                "—",
            ]
        )
        L += [
            md_table(
                [
                    "learner",
                    "allocated (s)",
                    "running",
                    "straggling",
                    "waiting",
                    "down",
                    "absent",
                    "lost work",
                    "goodput",
                    "failures",
                    "restarts",
                    "merged again after restart",
                ],
                rows,
            ),
            "",
        ]
        up = d["uptime"]
        L += [
            f"DiLoCo uptime {_pct(up['uptime'])}: a learner computed and the syncer was up for "
            f"{_s(up['up_s'])} of {_s(d['span']['length_s'])} s ({len(up['outages'])} intervals with nothing "
            f"up, {_s(up['down_s'])} s in all).",
            "",
        ]
        up = up["cadence"]
        L += [
            f"Merge cadence {_pct(up['uptime'])} ({up['advances']} merges; median gap "
            f"{format_value(up['median_gap_s'], '{:.3f}')} s; {len(up['stalls'])} stalls longer than "
            f"{format_value(up['threshold_s'], '{:.3f}')} s, {format_value(up['stalled_s'], '{:.2f}')} s in all; "
            f"start-up before the first merge {format_value(up['startup_s'], '{:.2f}')} s, left out; counting it "
            f"{_pct(up['uptime_span'])}).",
            "",
        ]
    if p:
        L += [
            f"DP's training span: {p['span']['length_s']:.2f} s on its own clock, W = {p['workers']} replicas, "
            f"measured step {format_value(p['step_s'], '{:.4f}')} s:",
            "",
        ]
        secs = ("allocated", "running", "straggling", "waiting", "recomputing", "down")
        rows = [
            [r["replica"]] + [_s(r[f"{k}_s"]) for k in secs] + [_pct(r["goodput"]), r["failures"]]
            for r in p["replicas"]
        ] + [
            ["**job**"]
            + [_s(p["global"][f"{k}_s"]) for k in secs]
            + [f"**{_pct(p['global']['goodput'])}**", p["global"]["failures"]]
        ]
        L += [
            md_table(
                [
                    "DP replica",
                    "allocated (s)",
                    "running",
                    "straggling",
                    "waiting",
                    "recomputing",
                    "down",
                    "goodput",
                    "failures",
                ],
                rows,
            ),
            "",
        ]
        if p["restores"]:
            L += [
                md_table(
                    [
                        "failure at (s)",
                        "replica",
                        "step (high-water)",
                        "restored to step",
                        "down (s)",
                        "restore (s)",
                        "recomputing (s)",
                    ],
                    [
                        [
                            _s(x["failed_at_s"]),
                            format_value(x["replica"]),
                            f"{format_value(x['step_at_failure'])} ({format_value(x['high_water_step'])})",
                            format_value(x["restored_step"]),
                            _s(x["down_s"]),
                            format_value(x["restore_s"], "{:.3f}"),
                            _s(x["recompute_s"]),
                        ]
                        for x in p["restores"]
                    ],
                ),
                "",
            ]
        up = p["uptime"]
        L += [
            f"DP uptime {_pct(up['uptime'])}: the job computed new steps for {_s(up['up_s'])} of "
            f"{_s(p['span']['length_s'])} s ({len(up['outages'])} stalls or recomputations, {_s(up['down_s'])} s).",
            "",
        ]
        up = up["cadence"]
        L += [
            f"DP step cadence {_pct(up['uptime'])} ({up['advances']} logged steps, every 10th; median gap "
            f"{format_value(up['median_gap_s'], '{:.3f}')} s; {len(up['stalls'])} stalls, "
            f"{format_value(up['stalled_s'], '{:.2f}')} s; start-up before the first logged step "
            f"{format_value(up['startup_s'], '{:.2f}')} s, left out; counting it {_pct(up['uptime_span'])}).",
            "",
        ]
    L += [
        "Goodput = useful time / allocated time, per learner (replica) and Σ useful / Σ allocated overall. "
        "Allocated: the training span (a scavenged learner: its window, join to leave). Not useful: down "
        "(failure → next start, and start-up before the first start), waiting (DiLoCo: blocked on an overdue "
        "merge, or its budget spent before the span ended; DP: the job stalled by another replica's failure, "
        "or the share (f − 1)/f of a slowdown it waits for the slowest replica, drawn as one block), "
        "recomputing (DP after a rollback, until back at its high-water step), absent (outside a scavenged "
        "window) and lost work (DiLoCo: the steps from the resume point it restarted from to the step it had "
        "reached, at that attempt's seconds per step). Straggling time is useful (the learner computes, "
        "slower). Uptime (the simulator's): share of the span in which the system progressed: a DiLoCo "
        "learner computing (running or straggling) with the syncer up; DP computing new steps (not stalled, "
        "not recomputing). Merge (step) cadence: share of the span after the first advance in which the "
        "global model advanced (merges; DP steps past the high-water mark); a gap between advances over "
        f"{res['stall_factor']:g} × the median gap is a stall, counted minus one median gap.",
        "",
    ]
    # simulator
    if sim.get("knobs"):
        k = sim["knobs"]
        L += [
            f"Simulator knobs (`sim.config.GoodputConfig`): chips = learners = {k['chips'][0]} (slices of one "
            f"chip), MTBI {sim['mtbf_s']:g} s, recovery exponweib(a {k['recovery_a']:g}, c {k['recovery_c']:g}, "
            f"scale {k['recovery_scale_s']:g} s), detection 0, step {k['step_s']:.4f} s (DP's), checkpoint every "
            f"{k['checkpoint_every_steps']} steps, restart {k['restart_s']:.3f} s (DP's mean restore), "
            f"{k['failures_per_run']} failures per run × {k['seeds']} seeds."
            + "".join(f" {n}." for n in sim.get("notes") or [])
            + f" Status: {sim['status']}.",
            "",
        ]
    # loss at equal time and tokens
    cur = loss.get("curves") or {}
    ref = loss.get("reference") or {}
    if cur:
        reference = "reference" + (" (with chaos)" if loss.get("reference_has_chaos") else " (no chaos)")
        rows = [
            [label(m), run, format_value(c["final_tokens"], "int"), _s(c["final_s"])]
            + [format_value(c[k], "{:.4f}") for k in ("loss_at_s", "loss_at_tokens", "final_loss")]
            for run, curves in (("this run", cur), (reference, (ref.get("at_this_runs_points") or {}).get("curves")))
            for m, c in (curves or {}).items()
        ]
        L += [
            md_table(
                [
                    "method",
                    "run",
                    f"final {unit}",
                    "training s",
                    f"loss at {_s(loss['at_s'])} s",
                    f"loss at {format_value(loss['at_tokens'], 'int')} {unit}",
                    "final loss",
                ],
                rows,
            ),
            "",
        ]
        L += [
            f"Held-out loss (nats/{per_unit(unit)}) interpolated linearly at equal wall time (the shorter "
            "method's end, each method's time since its own training start) and at equal training "
            f"{unit} (the common final count); — outside a curve's range.",
            "",
        ]
        pair = ref.get("reference_pair")
        if pair and pair.get("curves"):
            at_n = format_value(pair["at_tokens"], "int")
            txt = "; ".join(
                f"{short_label(m)} {format_value(c['loss_at_s'], '{:.4f}')} at {_s(pair['at_s'])} s, "
                f"{format_value(c['loss_at_tokens'], '{:.4f}')} at {at_n} {unit}"
                for m, c in pair["curves"].items()
            )
            L += [f"Reference run `{ref['run_dir']}` on its own: {txt}.", ""]
    elif ref.get("run_dir"):
        L += [f"*held-out loss curves: {NOT_RUN} in this run.*", ""]
    # the schedule
    f, sl = sch["failures"], sch["slowdowns"]
    L += [
        md_table(
            ["scheduled", "drawn", "in DiLoCo's span", "fired in DiLoCo", "in DP's span", "fired in DP"],
            [
                [
                    "failures",
                    f["drawn"],
                    format_value(f["diloco_in_span"]),
                    format_value(f["diloco_fired"]),
                    format_value(f["dp_in_span"]),
                    format_value(f["dp_fired"]),
                ],
                [
                    "slowdowns (straggler / heterogeneity: "
                    f"{sl['by_kind']['straggler']} / {sl['by_kind']['heterogeneity']})",
                    sl["drawn"],
                    format_value(sl["diloco_in_span"]),
                    format_value(sl["diloco_fired"]),
                    format_value(sl["dp_in_span"]),
                    format_value(sl["dp_fired"]),
                ],
            ],
        ),
        "",
    ]
    L += [
        "In span: scheduled before the method's span ended (DiLoCo on each learner's training clock). Fired: "
        "DiLoCo's failure or kill events naming a scheduled time, slowdown events with factor > 1; DP's "
        "failure events, and its slowdown events (one per change of the job's factor).",
        "",
    ]
    if sch["scavenged"]:
        L += [
            md_table(
                ["scavenged learner", "window (s of training)", "joined at (s)", "left at (s)"],
                [
                    [
                        x["learner"],
                        f"{format_value(x['join_s'], '{:g}')}–"
                        + (format_value(x["leave_s"], "{:g}") if x["leave_s"] is not None else "end"),
                        _s(x["joined_at_s"]),
                        _s(x["left_at_s"]),
                    ]
                    for x in sch["scavenged"]
                ],
            ),
            "",
        ]
    if sch["corruptions"]:
        L += [
            md_table(
                [
                    "corrupted learner",
                    "after (s)",
                    "kind",
                    "sent at (s)",
                    "fragment",
                    "local step",
                    "dropped by the syncer",
                    "merged",
                ],
                [
                    [
                        x["learner"],
                        format_value(x["at_s"], "{:g}"),
                        x["kind"],
                        _s(x["sent_at_s"]) if x["sent"] else "not sent",
                        format_value(x["fragment"]),
                        format_value(x["step"]),
                        (f"yes ({x['reason']})" if x["dropped"] else format_value(x["dropped"])),
                        (
                            "**yes**"
                            if x["merged"]
                            else format_value(x["merged"])
                            + (
                                " (a retry sent that step again; its copy may be merged)"
                                if x.get("resent_by_a_later_attempt")
                                else ""
                            )
                        ),
                    ]
                    for x in sch["corruptions"]
                ],
            ),
            "",
        ]
        L += [
            "A corrupted submission must be dropped and never merged (merged: a merge of that fragment "
            "lists the learner at that local step and base version).",
            "",
        ]
    for key, alt in (
        ("resilience_timeline", "learner and replica states over training"),
        ("resilience_loss", "held-out loss vs training seconds under chaos"),
    ):
        if plots.get(key):
            L += [f"![{alt}]({plots[key]})", ""]


def _stage(st: dict, L: list[str]) -> None:
    L += [f"## {st['label']}", ""]
    _comparison_section(st, L)
    _eval_section(st, L)
    _bytes_section(st, L)
    _curves(st, L)
    L += markdown_section(st.get("experts"))
    if (st.get("plots") or {}).get("expert_load"):
        L += [f"![expert load over training]({st['plots']['expert_load']})", ""]
    syncers = [m for m, f in st["methods"].items() if f["kind"] == "syncer"]
    for m in syncers:
        f, who = st["methods"][m], short_label(m)
        suffix = f" ({who})" if len(syncers) > 1 else ""
        _ledger_section(f, who, L, st.get("unit", "tokens"))
        _chaos_section(f, suffix, L, resilience=bool(st.get("resilience")))
        _merges_section(f, suffix, L)
    if st.get("resilience"):
        _resilience_section(st["resilience"], st.get("plots") or {}, st.get("unit", "tokens"), L)
    if st["notes"]:
        L += ["### Notes", ""] + [f"- {n}" for n in st["notes"]] + [""]


def _ci(ci: list | None, fmt: str) -> str:
    return f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else ""


def _score_cell(v: Any, ci: list | None, fmt: str = "{:.4f}") -> str:
    return "—" if v is None else format_value(v, fmt) + _ci(ci, fmt)


def _diff_cell(d: dict, fmt: str = "{:+.4f}") -> str:
    if d.get("status") != "ok":
        return f"{d.get('status')} ({d.get('why')})"
    return format_value(d["difference"], fmt) + (_ci(d["ci"], fmt) if d.get("ci") else " [interval undefined]")


def _recipe_rows(ft: dict) -> list[list[str]]:
    methods = ft["methods"]
    known = [
        ("task", "task"),
        ("mode", "mode"),
        ("lora_rank", "LoRA rank"),
        ("lora_alpha", "LoRA α (scale α/r)"),
        ("lora_targets", "LoRA targets"),
        ("steps", "steps per run"),
        ("batch_size", "batch size (examples per step)"),
        ("optimizer", "optimizer"),
        ("lr", "learning rate"),
        ("warmup_steps", "warmup steps"),
        ("weight_decay", "weight decay"),
        ("seeds", "seeds"),
        ("packing", "packing"),
        ("row_len", "row length (tokens)"),
    ]
    keys = list(dict.fromkeys([k for k, _ in known] + [k for f in methods.values() for k in f["recipe"]]))
    names = dict(known)

    def cell(v: Any) -> str:
        if isinstance(v, list):
            return ", ".join(str(x) for x in v) or "—"
        return format_value(v)

    rows = [
        [names.get(k, k)] + [cell(f["recipe"].get(k)) if f["status"] == "ok" else NOT_RUN for f in methods.values()]
        for k in keys
        if any(f["recipe"].get(k) is not None for f in methods.values())
    ]
    rows.append(["trainable parameters"] + [format_value(f["trainable_params"], "int") for f in methods.values()])
    rows.append(["frozen parameters"] + [format_value(f["frozen_params"], "int") for f in methods.values()])
    rows.append(
        ["fine-tuned from"]
        + [f"`{f['source_checkpoint']}`" if f["source_checkpoint"] else "—" for f in methods.values()]
    )
    return rows


def _post_training(ft: dict, L: list[str]) -> None:
    """The post-training section: every number from ``report["finetune"]``."""
    methods, task = ft["methods"], ft["task"]
    L += [f"## {ft['label']}", ""]
    L += [
        "Each pretrained model is fine-tuned with the same recipe (same task data, example order, seeds, "
        "steps and optimizer) and scored on the task's held-out test items before (pretrained) and after "
        "(fine-tuned).",
        "",
    ]
    if task:
        metrics = task.get("metrics") or {}
        primary = ft["primary"]
        plabel = (metrics.get(primary) or {}).get("label", primary)
        items = ", ".join(
            x
            for x in (
                f"{format_value(task['train_items'], 'int')} training items"
                if task.get("train_items") is not None
                else "",
                f"{format_value(task['test_items'], 'int')} test items" if task.get("test_items") is not None else "",
            )
            if x
        )
        L.append(
            f"**Task:** {task.get('name', '?')} ({task.get('modality', '?')})"
            + (f": {task['description']}" if task.get("description") else "")
            + (f"; {items}" if items else "")
            + f"; primary metric: {plabel}."
        )
        baselines = task.get("baselines") or {}
        if baselines:
            L += [
                "",
                "Reference scores without the model ("
                + plabel
                + "): "
                + "; ".join(f"{k}: {format_value(v, '{:.4f}')}" for k, v in baselines.items())
                + ".",
            ]
        L.append("")
    else:
        L += [f"*task evaluation: {NOT_RUN} for any method.*", ""]

    for m, f in methods.items():
        if f["status"] != "ok":
            L += [f"- {label(m)} fine-tuning: **{NOT_RUN}** (no summary)"]
        elif f["interrupted"]:
            L += [
                f"- {label(m)} fine-tuning: **interrupted** (stopped early; its figures cover the seeds and "
                "steps it ran)"
            ]
        if f["eval_status"] != "ok":
            L += [f"- {label(m)} task evaluation: **{NOT_RUN}**"]
    if L[-1] != "":
        L.append("")
    L += ["### Recipe", ""]
    L += [md_table(["setting"] + [label(m) for m in methods], _recipe_rows(ft)), ""]

    L += ["### Task scores: pretrained → fine-tuned", ""]
    for k in ft["metrics"]:
        meta = (task.get("metrics") or {}).get(k) or {}
        hib = meta.get("higher_is_better", True)
        head = meta.get("label", k) + (" (primary)" if k == ft["primary"] else "")
        L += [f"#### {head}: {'higher' if hib else 'lower'} is better", ""]
        rows = []
        for m, f in methods.items():
            sc = f["scores"].get(k)
            if sc is None:
                rows.append([label(m), NOT_RUN, NOT_RUN, "—", "—"])
                continue
            n_seeds = len(sc["finetuned_per_seed"])
            per_seed = (
                "; ".join(f"seed {p['seed']}: {format_value(p['value'], '{:.4f}')}" for p in sc["finetuned_per_seed"])
                or "—"
            )
            ft_cell = _score_cell(sc["finetuned"], sc["finetuned_ci"])
            if n_seeds > 1:
                ft_cell += f" (mean of {n_seeds} seeds)"
            rows.append(
                [
                    label(m),
                    _score_cell(sc["pretrained"], sc["pretrained_ci"]),
                    ft_cell,
                    format_value(sc["change"], "{:+.4f}"),
                    per_seed,
                ]
            )
        for m, d in ft["differences"].items():
            row = d["metrics"][k]
            rows.append(
                [
                    f"**{short_label(m)} − {short_label(d['baseline'])}**",
                    _diff_cell(row["pretrained"]),
                    _diff_cell(row["finetuned"]),
                    "—",
                    row["finetuned"]["verdict"]["text"],
                ]
            )
        L += [md_table(["model", "pretrained", "fine-tuned", "change", "fine-tuned per seed / verdict"], rows), ""]
        for m, d in ft["differences"].items():
            over = [
                x["over"]
                for x in (d["metrics"][k]["finetuned"], d["metrics"][k]["pretrained"])
                if x.get("status") == "ok"
            ]
            if over:
                L += [
                    f"{short_label(m)} − {short_label(d['baseline'])}: mean over the test items (and seeds) of the "
                    f"per-item difference; fine-tuned {over[0]}"
                    + (f", pretrained {over[1]}" if len(over) > 1 else "")
                    + ".",
                    "",
                ]
    L += [
        "Brackets: " + ft["bootstrap"]["definition"] + " A method's own score: the same bootstrap of its "
        "per-item scores (pretrained: items only). Change = fine-tuned − pretrained.",
        "",
    ]
    for m, v in ft["verdicts"].items():
        d = ft["differences"][m]["metrics"][v["metric"]]
        meta = (task.get("metrics") or {}).get(v["metric"]) or {}
        name = meta.get("label", v["metric"])
        for what, key in (("fine-tuned", "finetuned"), ("pretrained", "pretrained")):
            x = d[key]
            nums = (
                f": {short_label(m)} − {short_label(ft['differences'][m]['baseline'])} = "
                f"{format_value(x['difference'], '{:+.4f}')}{_ci(x.get('ci'), '{:+.4f}')} {x['over']}"
                if x.get("status") == "ok"
                else ""
            )
            L += [f"**Parity, {name}, {what}:** {v[key]['text']}{nums}.", ""]

    rows = ft["pretrain_tasks"]
    if rows:
        have = [m for m in methods if m in rows[0] or any(m in r for r in rows)]
        L += ["### Pretraining tasks before → after fine-tuning", ""]

        def cell(x: dict | None, fmt: str) -> str:
            if not x:
                return NOT_RUN
            return f"{format_value(x['pretrained'], fmt)} → {format_value(x['finetuned'], fmt)}" + (
                f" ({x['change']:+.4g})" if x["change"] is not None else ""
            )

        L += [
            md_table(
                ["metric"] + [label(m) for m in have],
                [[r["label"]] + [cell(r.get(m), r["fmt"]) for m in have] for r in rows],
            ),
            "",
        ]
        L += [
            "The pretraining evaluation (held-out text of the pretraining corpus) of each model before and after "
            "fine-tuning (change in parentheses): what fine-tuning cost or gained on the original task.",
            "",
        ]

    L += ["### Fine-tuning runs", ""]
    runs = [
        [
            label(m),
            format_value(r.get("seed")),
            format_value(r.get("steps"), "int"),
            format_value(r.get("examples"), "int"),
            format_value(r.get("wall_s"), "{:.1f}"),
            format_value(r.get("final_train_loss"), "{:.4f}"),
            format_value(r.get("final_val_loss"), "{:.4f}"),
            f"`{str(r['order_sha256'])[:12]}`" if r.get("order_sha256") else "—",
        ]
        for m, f in methods.items()
        for r in f["runs"]
    ]
    if runs:
        L += [
            md_table(
                [
                    "method",
                    "seed",
                    "steps",
                    "examples",
                    "wall (s)",
                    "final training loss",
                    "final held-out loss",
                    "example order (sha256)",
                ],
                runs,
            ),
            "",
        ]
        same = ft["order"]["same"]
        if same is not None:
            L += [
                "Example order: "
                + (
                    "the same for every method at each seed (order_sha256)."
                    if same
                    else f"**differs between methods at seed(s) "
                    f"{', '.join(ft['order']['differs_at_seeds'])}** (order_sha256): the runs "
                    "are not paired as the recipe intends."
                ),
                "",
            ]
    else:
        L += [f"*fine-tuning runs: {NOT_RUN}.*", ""]
    plot = ft["plots"].get("loss")
    L += [f"![fine-tuning loss]({plot})" if plot else f"*fine-tuning loss curves: {NOT_RUN}.*", ""]
    if ft["notes"]:
        L += ["### Notes (post-training)", ""] + [f"- {n}" for n in ft["notes"]] + [""]


def render_markdown(report: dict) -> str:
    """The ``report.md`` text for a report dict from ``build_report`` (pure)."""
    L: list[str] = []
    _header(report, L)
    if report.get("verdict"):
        L += verdict_markdown(report["verdict"])
    for st in report["stages"].values():
        _stage(st, L)
    if report.get("finetune"):
        _post_training(report["finetune"], L)
    if report.get("setup"):  # the appendix: what the run was, after what it found
        setup = [[k, format_value(v)] for k, v in report["setup"].items()]
        L += ["## Setup", "", md_table(["setting", "value"], setup), ""]
    for st in report["stages"].values():
        _hyperparameters(st, L)
    L += ["## Data", ""]
    man = report["manifest"]
    L += [
        md_table(["manifest field", "value"], man["items"])
        if man["status"] == "ok"
        else f"*data manifest: {NOT_RUN}.*",
        "",
    ]
    return "\n".join(L)


def _post_training_headline(ft: dict | None) -> list[str]:
    """One line per fine-tuned method against DP: the primary task metric pretrained → fine-tuned
    and the difference with its 95 % interval (the *Post-training* section has the rest)."""
    if not ft or not ft.get("primary"):
        return []
    k = ft["primary"]
    parts = []
    for m, f in ft["methods"].items():
        sc = (f.get("scores") or {}).get(k) or {}
        if sc.get("pretrained") is not None and sc.get("finetuned") is not None:
            parts.append(f"{label(m)} {sc['pretrained']:.3f} → {sc['finetuned']:.3f}")
    if not parts:
        return []
    line = f"- post-training ({(ft.get('task') or {}).get('name', 'task')}, {k.replace('_', ' ')}): " + "; ".join(parts)
    for m, d in (ft.get("differences") or {}).items():
        fd = ((d.get("metrics") or {}).get(k) or {}).get("finetuned") or {}
        if fd.get("status") == "ok":
            v = fd["verdict"]
            said = f"{label(v['better'])} is better" if v.get("better") else v["status"]
            line += (
                f"; {label(m)} − {label(d['baseline'])} {fd['difference']:+.3f} "
                f"[{fd['ci'][0]:+.3f}, {fd['ci'][1]:+.3f}] (95 %, {fd['over']}): {said}"
            )
    return [line]
