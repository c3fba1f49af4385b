"""The report's figures, computed once from the records :mod:`reports.read` returns. Pure: no I/O.

Per stage (:func:`stage_figures`): each method's figures, the side-by-side rows of every method of
the stage, and each method's loss gap to the baseline (``dp``); docs/report.md ("Stage figures").
Units: tokens, seconds, payload bytes, nats/token (perplexity = exp(loss)).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from reports.common import BASELINE, NOT_RUN, flatten, label, nested, num, per_unit, safe_exp, short_label, stage_label
from reports.experts import expert_figures
from reports.interconnect import interconnect_figures
from reports.learners import syncer_sections
from reports.read import MethodRecords
from reports.wire import BYTE_ROWS, ByteSettings, allreduce_bytes, byte_cell, fragments, syncer_bytes, wire_format
from run.layout import STAGES

if TYPE_CHECKING:
    from configs.runtime import RuntimeConfig
    from configs.schema import ExperimentConfig

KNOWN_KINDS = {"dp": "allreduce", "diloco": "syncer"}  # kinds: see method_kind
# lm-eval metric names → (label, unit, format); tasks are discovered from the eval keys
# ("<task>/<metric>"), these only name and order the metrics we know.
EVAL_METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "word_perplexity": ("word perplexity", "", "{:.3f}"),
    "byte_perplexity": ("byte perplexity", "", "{:.4f}"),
    "bits_per_byte": ("bits per byte", "bits/byte", "{:.4f}"),
    "perplexity": ("perplexity", "", "{:.3f}"),
    "acc": ("accuracy", "fraction", "{:.3f}"),
    "acc_norm": ("accuracy (length-normalised)", "fraction", "{:.3f}"),
    "passages": ("passages", "passages", "int"),
    "questions": ("questions", "questions", "int"),
    "accuracy": ("top-1 accuracy", "fraction", "{:.4f}"),  # vision: evals/vision.py
    "loss": ("loss", "nats/image", "{:.4f}"),
    "images": ("images", "images", "int"),
}
EVAL_TASK_ORDER = ("heldout_ppl", "heldout_nextline", "test")  # first, then any other task, sorted
CHANCE_METRICS = ("acc", "acc_norm")  # shown with "(chance c)" when "<task>/chance" exists
# Keys of the eval dict that are not "<task>/<metric>": (key, label, unit, format).
EVAL_RUN_KEYS = (
    ("checkpoint_tokens", "budget units (tokens or images) in the evaluated checkpoint", "", "int"),
    ("truncated_requests", "truncated requests (contexts cut to fit the window)", "requests", "int"),
    ("eval_s", "lm-eval time", "s", "{:.1f}"),
)
# Summary fields read as numbers (the contract's names, docs/contracts.md "Summaries").
SUMMARY_FIELDS = (
    "tokens",
    "steps",
    "wall_s",
    "tokens_per_s",
    "final_val_loss",
    "params",
    "active_params",
    "flops_per_token",
    "goodput",
    "startup_s",
    "exchange_s",
    "learner_exchange_s",
)


def method_kind(rec: MethodRecords) -> str:
    """The method's kind, by what its records hold: ``allreduce`` (the baseline, or a summary with
    ``allreduce_bytes``: a ring all-reduce model of its bytes), ``syncer`` (DiLoCo, or any method with
    a merge log, learner events or a token ledger) or ``plain`` (training and evaluation figures only)."""
    s = rec.summary or {}
    if rec.method in KNOWN_KINDS or "allreduce_bytes" in s:
        return KNOWN_KINDS.get(rec.method, "allreduce")
    return "syncer" if rec.merges is not None or rec.events is not None or "ledger" in s else "plain"


def eval_metrics(raw: dict) -> dict[str, float]:
    """Our flat metrics dict, or lm-eval's ``{"results": {task: {"metric,filter": v}}}`` flattened
    to ``task/metric`` (standard errors kept as ``task/metric_stderr``; aliases and non-numbers
    such as "N/A" dropped)."""
    if not isinstance(raw.get("results"), dict):
        return {k: num(v) for k, v in raw.items() if num(v) is not None}
    flat: dict[str, float] = {}
    for task, metrics in raw["results"].items():
        for k, v in metrics.items() if isinstance(metrics, dict) else ():
            metric, _, filt = k.partition(",")
            if num(v) is not None:
                flat[f"{task}/{metric}" + (f",{filt}" if filt and filt != "none" else "")] = num(v)
    return flat | ({"eval_s": num(raw["eval_s"])} if num(raw.get("eval_s")) is not None else {})


def curve_summary(rows: list[dict] | None) -> dict:
    """Points of the held-out loss curve and its last and best loss (nats/token)."""
    if not rows:
        return {"status": NOT_RUN, "points": 0}
    pts = [r for r in rows if num(r.get("val/loss")) is not None]
    if not pts:
        return {"status": "no loss values", "points": 0}
    last = pts[-1]
    return {
        "status": "ok",
        "points": len(pts),
        "final_tokens": num(last.get("tokens")),
        "final_wall_s": num(last.get("wall_s")),
        "final_loss": num(last.get("val/loss")),
        "best_loss": min(num(r["val/loss"]) for r in pts),
    }


def method_figures(rec: MethodRecords, notes: list[str]) -> dict:
    """One method's training and evaluation figures (status "not run" without a summary). The final
    held-out loss is the summary's, else the last point of the eval curve (a note when they differ)."""
    summary, curve = rec.summary, curve_summary(rec.curve)
    s, hp = summary or {}, (summary or {}).get("hyperparameters")
    out: dict[str, Any] = {
        "status": "ok" if summary is not None else NOT_RUN,
        "interrupted": bool(s.get("interrupted")) if summary is not None else None,
        "summary_file": rec.files["summary"],
        "eval_status": "ok" if rec.eval is not None else NOT_RUN,
        "eval": eval_metrics(rec.eval) if rec.eval is not None else {},
        "curve": curve,
        "hyperparameters": flatten(hp) if isinstance(hp, dict) else {},
    } | {key: num(s.get(key)) for key in SUMMARY_FIELDS}
    cl, final = curve.get("final_loss"), out["final_val_loss"]
    out["final_val_loss_source"] = out["summary_file"] if final is not None else None
    if final is None and cl is not None:
        out["final_val_loss"], out["final_val_loss_source"] = cl, f"{rec.files['curve']} (last row)"
    elif final is not None and cl is not None and not math.isclose(cl, final, rel_tol=1e-6, abs_tol=1e-9):
        notes.append(
            f"{label(rec.method)}: summary final loss {final:.6f} differs from "
            f"the last eval-curve point {cl:.6f}; the table uses the summary's."
        )
    # the whole splits after training (training.evaluation.final_heldout)
    out["test_loss"], out["val_loss_whole"] = (num(nested(s, ("heldout", k, "loss"))) for k in ("test", "val"))
    out["final_val_ppl"] = safe_exp(out["final_val_loss"])
    if s.get("reused_from"):  # DP trained once for runs with the same DP settings
        also = "; its evaluation too" if (rec.eval or {}).get("reused_from") else ""
        notes.append(
            f"{label(rec.method)}: the result of another run with the same settings, reused from "
            f"{s['reused_from']} (its wall time and throughput are that run's{also})."
        )
    if summary is not None and out["tokens_per_s"] is None and out["tokens"] and out["wall_s"]:
        out["tokens_per_s"] = out["tokens"] / out["wall_s"]
    return out


def eval_rows(methods: dict[str, dict], notes: list[str]) -> list[dict]:
    """The lm-eval table rows, discovered from the eval keys: ``<task>/<metric>`` (in
    EVAL_TASK_ORDER and EVAL_METRIC_NAMES order, then sorted), then the run-level keys; each with the
    per-method ``stderr`` (``<key>_stderr``) and, for accuracies, the task's ``chance``."""
    evals = {m: f["eval"] if f["eval_status"] == "ok" else None for m, f in methods.items()}
    keys = set().union(*(f["eval"] for f in methods.values()))
    known, tasks = list(EVAL_METRIC_NAMES), len(EVAL_TASK_ORDER)

    def order(k: str) -> tuple:
        task, metric = k.split("/", 1)
        t = EVAL_TASK_ORDER.index(task) if task in EVAL_TASK_ORDER else tasks
        return (t, task, known.index(metric) if metric in known else len(known), metric)

    specs = []  # (key, label, unit, format, chance)
    for k in sorted((k for k in keys if "/" in k and not k.endswith(("_stderr", "/chance"))), key=order):
        task, metric = k.split("/", 1)
        text, unit, fmt = EVAL_METRIC_NAMES.get(metric, (metric, "", "{:.4f}"))
        chance = f"{task}/chance" if metric in CHANCE_METRICS else None
        found = {m: e[chance] for m, e in evals.items() if e and chance in e}
        if len(set(found.values())) > 1:
            notes.append(
                f"{task}: chance accuracy differs between the methods' evals ({found}); the "
                f"table shows {short_label(next(iter(found)))}'s."
            )
        specs.append((k, f"{task}: {text}", unit, fmt, next(iter(found.values()), None)))
    specs += [(k, text, unit, fmt, None) for k, text, unit, fmt in EVAL_RUN_KEYS if k in keys]
    run_keys = {k for k, *_ in EVAL_RUN_KEYS}
    specs += [(k, k, "", "{:.4f}", None) for k in sorted(keys - run_keys) if "/" not in k and not k.endswith("_stderr")]
    return [
        {"key": k, "label": text, "unit": unit, "fmt": fmt, "group": "eval"}
        | {"stderr": {m: e.get(f"{k}_stderr") if e is not None else None for m, e in evals.items()}, "chance": chance}
        | {m: e.get(k) if e is not None else NOT_RUN for m, e in evals.items()}
        for k, text, unit, fmt, chance in specs
    ]


def comparison(methods: dict[str, dict], rows_eval: list[dict], unit: str = "tokens") -> list[dict]:
    """Rows of the side-by-side tables (a value per method; None = not recorded, "not run"), each
    with a ``group``: "training", "eval" (:func:`eval_rows`) and "bytes" (read from each method's
    ``bytes``, the one computation of every byte figure)."""
    per, fs = per_unit(unit), list(methods.values())
    start, good, test = (any(f.get(k) is not None for f in fs) for k in ("startup_s", "goodput", "test_loss"))
    exchange = any(f.get("exchange_s") or f.get("learner_exchange_s") for f in fs)
    active = any(f.get("active_params") not in (None, f.get("params")) for f in fs)
    nats, s1 = f"nats/{per}", "{:.1f}"
    specs = [  # (key, label, unit, format, shown)
        ("tokens", f"training {unit}", unit, "int", True),
        ("steps", "optimizer steps (DiLoCo: inner steps summed over learners)", "steps", "int", True),
        ("wall_s", "training wall time", "s", s1, True),
        ("tokens_per_s", "throughput", f"{unit}/s", "{:,.0f}", True),
        ("startup_s", "start-up (set-up to the first learner step; process engines start workers)", "s", s1, start),
        ("exchange_s", "syncer's time in the exchange (storage calls, encoding, checksums)", "s", s1, exchange),
        ("learner_exchange_s", "learners' time in the exchange (summed over their processes)", "s", s1, exchange),
        ("goodput", "goodput", "fraction", "{:.3f}", good),
        ("test_loss", "final test loss (the whole test split: nothing tuned on it)", nats, "{:.4f}", test),
        (
            "val_loss_whole",
            "final validation loss (the whole validation split: what tuning reads)",
            nats,
            "{:.4f}",
            test,
        ),
        ("final_val_loss", "final held-out loss (the curves' validation sample)", nats, "{:.4f}", True),
        ("final_val_ppl", "final held-out perplexity exp(loss)", "", "{:.3f}", True),
        ("merges", "merges (DiLoCo)", "merges", "int", True),
        ("params", "parameters", "", "int", True),
        ("active_params", "active parameters per token (MoE: k of E experts)", "", "int", active),
        ("flops_per_token", f"training FLOPs per {per} (active, for MoE)", "FLOPs", "{:.4g}", True),
    ]
    rows: list[dict] = []
    for key, text, u, fmt, show in specs:
        if show:
            row = {"key": key, "label": text, "unit": u, "fmt": fmt, "group": "training"}
            for m, f in methods.items():
                v = (f.get("merges") or {}).get("count") if key == "merges" else f.get(key)
                row[m] = v if f["status"] == "ok" or v is not None else NOT_RUN  # None: not recorded ("—")
            rows.append(row)
    rows += rows_eval
    rows += [
        {"key": key, "label": text, "unit": "", "fmt": fmt[0] if fmt else "bytes", "group": "bytes", "counted_by": by}
        | {m: byte_cell(f["bytes"], sk, ak) for m, f in methods.items()}
        for key, text, by, sk, ak, *fmt in BYTE_ROWS
    ]
    return rows


def loss_gap(methods: dict[str, dict], method: str, baseline: str = BASELINE) -> dict:
    """``method``'s final loss relative to the baseline's, in %: 100 × (loss − baseline loss) /
    baseline loss (negative: ``method`` is better); on the whole test split when both methods were
    measured there (``split`` "test"), else on the curves' validation sample ("val sample")."""
    key = "test_loss" if all(methods[m].get("test_loss") is not None for m in (method, baseline)) else "final_val_loss"
    lm, lb = methods[method][key], methods[baseline][key]
    ok = lm is not None and lb is not None and math.isfinite(lm) and math.isfinite(lb) and lb != 0
    missing = [label(m) for m, v in ((method, lm), (baseline, lb)) if v is None]
    out = {"status": "ok" if ok else NOT_RUN if missing else "undefined", "method": method, "baseline": baseline}
    if ok:
        out |= {"method_loss": lm, "baseline_loss": lb, "split": "test" if key == "test_loss" else "val sample"}
        formula = f"100 * ({method}_loss - {baseline}_loss) / {baseline}_loss"
        return out | {"gap_pct": 100.0 * (lm - lb) / lb, "formula": formula}
    zero = f"a final held-out loss is not finite (or {short_label(baseline)}'s is 0)"
    return out | {"missing": missing, "why": f"no final held-out loss for {' and '.join(missing)}" if missing else zero}


def budget_figure(summary: dict | None, who: str) -> dict | None:
    """Whether the method trained its budget (summary ``budget``; None without one): ``status``
    (complete, interrupted, short), ``trained``, ``budget``, ``share``, ``unit``, ``reason``, ``line``,
    and ``headline``, the bold top line of report.md when it trained short (``who`` names the method)."""
    raw = (summary or {}).get("budget")
    if not isinstance(raw, dict):
        return None
    out = {k: raw.get(k) for k in ("status", "trained", "budget", "share", "unit", "reason", "line")}
    out["headline"] = f"**Failed: {who} {raw['line']}.**" if raw.get("status") == "short" and raw.get("line") else None
    return out


def stage_figures(stage: str, records: dict[str, MethodRecords], config: ExperimentConfig | None) -> dict:
    """Every figure of one stage: ``methods`` (per method, in report order), ``comparison`` rows,
    ``loss_gaps`` (each method vs the baseline, when the stage has one), ``hyperparameters`` rows
    and ``notes``. ``config``: the run's typed config (``reports.common.settings``), None without
    one. ``plots`` is filled in by the builder."""
    notes: list[str] = []
    methods: dict[str, dict] = {}
    first = stage == STAGES[0]
    for m, rec in records.items():
        kind, who = method_kind(rec), short_label(m)
        headline_who = who if first else f"{who} {stage_label(stage).lower()}"
        notes.extend(rec.notes)  # what reading left out (a metrics line cut short)
        fig = methods[m] = method_figures(rec, notes)
        fig.update(kind=kind, budget=budget_figure(rec.summary, headline_who))
        if kind == "syncer":  # config.json's diloco section describes DiLoCo
            cfg, s = ByteSettings.of(config), rec.summary
            frags = fragments(cfg and cfg.diloco, s)
            fig.update(syncer_sections(config, s, rec.merges, rec.events, frags, rec.files, notes, headline_who))
            fig["bytes"] = syncer_bytes(cfg, s, rec.merges, rec.files, notes, who)
        elif kind == "allreduce":
            fig["bytes"] = allreduce_bytes(config.diloco.learners if config else None, rec.summary, notes, who)
        else:
            fig["bytes"] = syncer_bytes(None, rec.summary, None, rec.files, notes, who, kind="plain")
    hyper = [
        {"name": k} | {m: f["hyperparameters"].get(k) if f["status"] == "ok" else NOT_RUN for m, f in methods.items()}
        for k in sorted(set().union(*(f["hyperparameters"] for f in methods.values())))
    ]
    unit, network = config.unit if config is not None else "tokens", None
    if first and config:
        curves = (
            {"summary": records[m].summary, "curve": records[m].curve} if m in records else None
            for m in ("dp", "diloco")
        )
        network = interconnect_figures(config, *curves)
    return {
        "stage": stage,
        "label": stage_label(stage),
        "baseline": BASELINE if BASELINE in methods else None,
        "methods": methods,
        "unit": unit,
        "comparison": comparison(methods, eval_rows(methods, notes), unit),
        "loss_gaps": {m: loss_gap(methods, m) for m in methods if m != BASELINE and BASELINE in methods},
        "hyperparameters": hyper,
        "experts": expert_figures(records),
        "interconnect": network,
        "plots": {},
        "notes": notes,
    }


def _exchange(runtime: RuntimeConfig) -> str:
    """The exchange a run used (``RuntimeConfig.exchange_kind``), in words."""
    if runtime.exchange_kind == "memory":
        return "memory (one process)"
    url = runtime.exchange_url
    return f"fsspec at {url}" if url else "fsspec (pretrain/diloco/exchange in the run directory)"


_MODEL_SETUP = (
    "kind",
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "patch_size",
    "n_experts",
    "top_k",
    "moe_every",
    "expert_d_ff",
)


def setup(config: ExperimentConfig | None) -> dict:
    """A few config values a reader needs to read the tables (M, P, H, K, budgets, model size), from
    the run's typed config (``reports.common.settings``); empty without one."""
    if config is None:
        return {}
    d, unit = config.diloco, config.unit
    text = unit == "tokens"
    events = Counter(e.kind for e in config.chaos.events)
    tau = d.grace_overlap_steps or d.sync_every
    adaptive = f"adaptive, Eq. 3 (γ {d.grace_gamma}, τ {tau} steps; {d.grace_s} s until step times are measured)"
    out = {
        "learners (M)": d.learners,
        "fragments (P)": d.fragments,
        "sync every (H, inner steps)": d.sync_every,
        "quorum (K)": d.quorum,
        "grace window (s)": d.grace_s,
        "grace window rule": None if d.grace == "fixed" else adaptive,
        "merge rule": d.merge,
        "wire format (learner→syncer; syncer→learner is float32)": wire_format(config.diloco, None),
        f"budget per method ({unit})": config.train.token_budget,
        "data source": config.data.source,
        "sequence length (tokens)": config.data.seq_len if text else None,
        f"learner batch ({'sequences' if text else 'images'})": d.batch_size,
        "model": " ".join(f"{k}={v}" for k in _MODEL_SETUP if (v := getattr(config.model, k, None)) is not None)
        or None,
        "DP enabled": config.dp.enabled,
        "lm-eval enabled": config.eval.enabled if text else None,
        "scheduled faults (chaos.events)": ", ".join(f"{n} {k}" for k, n in sorted(events.items())) or None,
        "engine": config.runtime.engine,
        "exchange": _exchange(config.runtime),
        "devices per learner": config.runtime.devices_per_learner,
        "compute slots per host": d.compute_slots,
    }
    return {k: v for k, v in out.items() if v is not None}


def manifest_items(manifest: dict) -> list[list[str]]:
    """The manifest flattened to (key, short text) pairs; long lists are abbreviated, a list of
    mappings shown by their ``name`` (shards), an unset value as ``(none)``. A value of the recorded
    data config (``config/…``) that the manifest also states at its top level with the same value
    (``learners``, ``seq_len``, ``vocab_size``) is shown once, at the top level."""
    items = []
    flat = flatten(manifest)
    top = {k: v for k, v in flat.items() if "/" not in k}
    for k, v in flat.items():
        name = k.rsplit("/", 1)[-1]
        if k.startswith("config/") and name in top and top[name] == v:
            continue
        if isinstance(v, list):
            v = [x.get("name", "…") if isinstance(x, dict) else x for x in v]
            if len(v) <= 8 and all(not isinstance(x, (dict, list)) for x in v):
                text = ", ".join(str(x) for x in v) or "(none)"
            else:
                text = f"{len(v)} items: {', '.join(str(x) for x in v[:3])}, …"
        elif isinstance(v, int) and not isinstance(v, bool):
            text = f"{v:,}"
        else:
            text = "(none)" if v is None else str(v)
        items.append([k, text])
    return items


# how a report written by the run's own last stage states the pipeline's status ("completing")
COMPLETING_TEXT = "completed (this report is the run's last stage)"


def pipeline_status(raw: dict | None, final_stage: bool = False) -> dict | None:
    """``status.json`` (None when absent); ``headline`` is the bold top line when the pipeline was
    interrupted or failed; ``status`` ``completing`` for a ``running`` pipeline whose last stage
    builds this report (``final_stage``)."""
    if raw is None:
        return None
    stages = raw.get("completed_stages")
    stages = [str(s) for s in stages] if isinstance(stages, list) else []
    status = str(raw.get("status") or "unknown")
    status = "completing" if status == "running" and final_stage else status
    reason = str(raw["reason"]) if raw.get("reason") else None
    done, why = ", ".join(stages) or "none", f" ({reason})" if reason else ""
    headline = {
        "interrupted": f"**Interrupted: this run stopped before it finished{why}; completed stages: {done}. "
        "Figures of the stages that did not complete are missing below.**",
        "failed": f"**Failed: the pipeline failed{why}; completed stages: {done}.**",
    }.get(status)
    return {"status": status, "completed_stages": stages, "reason": reason, "headline": headline}
