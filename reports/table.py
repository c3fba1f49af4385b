"""The runs-table: the figures of one or more report records (``report.json``, or the dict
:func:`reports.build_report` returns) as one pandas DataFrame, one row per run × stage × method.

The report over seeds (means and intervals over seeds), the verdict (paired gaps), the study and the
comparison across runs (runs side by side) are groupbys and pivots of this table. Each figure is
defined here once: where a report record holds it (:data:`FIGURES`), and its header, unit and format.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd

from reports.common import BASELINE, nested, num, short_label


class Figure(NamedTuple):
    """Where a figure is read and how it is shown. ``path``: keys under the method's record of a
    stage (``stages.<stage>.methods.<method>``), or, starting with ``"stage"``, under the stage with
    ``{m}`` the method, or, starting with ``"finetune"``, under ``finetune`` with ``{p}`` the primary
    metric. ``header``: ``{s}`` the method's short label, ``{b}`` the baseline's, ``{per}`` the
    loss's denominator, ``{unit}`` what the budget counts. ``fmt``: a format string, ``int``,
    ``bytes`` or "" (as is)."""

    path: tuple[str, ...]
    header: str
    unit: str = ""
    fmt: str = ""


_FT_DIFF = ("finetune", "differences", "{m}", "metrics", "{p}", "finetuned")
_GAP = ("stage", "loss_gaps", "{m}")
FIGURES: dict[str, Figure] = {
    # the loss on the validation split's sample the curves use (nats per token or image)
    "final_val_loss": Figure(("final_val_loss",), "{s} validation loss (sample; nats/{per})", "nats/{per}", "{:.4f}"),
    "val_loss_whole": Figure(("val_loss_whole",), "{s} validation loss (nats/{per})", "nats/{per}", "{:.4f}"),
    "test_loss": Figure(("test_loss",), "{s} test loss (nats/{per})", "nats/{per}", "{:.4f}"),
    "test_accuracy": Figure(("eval", "test/accuracy"), "{s} test accuracy", "fraction", "{:.3f}"),
    "tokens": Figure(("tokens",), "{s} {unit}", "{unit}", "int"),
    "wall_s": Figure(("wall_s",), "{s} wall (s)", "s", "{:,.1f}"),
    "tokens_per_s": Figure(("tokens_per_s",), "{s} {unit}/s", "{unit}/s", "{:,.0f}"),
    "goodput": Figure(("goodput",), "{s} goodput", "fraction", "{:.3f}"),
    "uptime": Figure(("uptime",), "{s} uptime", "fraction", "{:.3f}"),
    "params": Figure(("params",), "{s} parameters", "parameters", "int"),
    "bytes_total": Figure(("bytes", "total"), "{s} bytes (total)", "bytes", "bytes"),
    "bytes_per_token": Figure(("bytes", "sent_per_token"), "{s} bytes sent per {per}", "bytes/{per}", "{:,.0f}"),
    "modelled_wall_s": Figure(("stage", "interconnect", "methods", "{m}", "modelled_wall_s"), "{s} modelled wall (s)"),
    "time_to_dp_final_s": Figure(("stage", "interconnect", "time_to_dp_final_s", "{m}"), "{s} time to DP's final (s)"),
    "loss_gap_pct": Figure((*_GAP, "gap_pct"), "{s} − {b} loss gap (%)", "%", "{:+.2f}"),
    "loss_gap_pct_ci_low": Figure((*_GAP, "ci", "0"), "95 % interval low (seeds)", "%", "{:+.2f}"),
    "loss_gap_pct_ci_high": Figure((*_GAP, "ci", "1"), "95 % interval high (seeds)", "%", "{:+.2f}"),
    "seeds": Figure((*_GAP, "seeds"), "seeds", "", "int"),
    "post_score": Figure(("finetune", "methods", "{m}", "scores", "{p}", "finetuned"), "{s} fine-tuned", "", "{:.4f}"),
    "post_diff": Figure((*_FT_DIFF, "difference"), "{s} − {b} [95 % interval]", "", "{:+.4f}"),
    "post_diff_ci_low": Figure((*_FT_DIFF, "ci", "0"), "95 % interval low", "", "{:+.4f}"),
    "post_diff_ci_high": Figure((*_FT_DIFF, "ci", "1"), "95 % interval high", "", "{:+.4f}"),
    "post_verdict": Figure((*_FT_DIFF, "verdict"), "verdict"),
}
DERIVED: dict[str, Figure] = {  # columns of the table computed from the figures above
    # the whole validation split where measured (what selection reads), else the curves' sample
    "val_loss": Figure((), "{s} validation loss (nats/{per})", "nats/{per}", "{:.4f}"),
    # the test split where measured, else the validation sample (the verdict's)
    "loss": Figure((), "{s} held-out loss (nats/{per})", "nats/{per}", "{:.4f}"),
}
# figures read only where their record's status is "ok" (else None)
_OK_ONLY = dict.fromkeys(("loss_gap_pct", "loss_gap_pct_ci_low", "loss_gap_pct_ci_high"), _GAP)
_OK_ONLY |= dict.fromkeys(("post_diff", "post_diff_ci_low", "post_diff_ci_high", "post_verdict"), _FT_DIFF)


def shown(figure: str, method: str, per: str = "token", unit: str = "tokens") -> Figure:
    """``figure`` (:data:`FIGURES` or :data:`DERIVED`) with its header and unit for ``method``."""
    f = FIGURES.get(figure) or DERIVED[figure]
    words = {"s": short_label(method), "b": short_label(BASELINE), "per": per, "unit": unit}
    return f._replace(header=f.header.format(**words), unit=f.unit.format(**words))


def _get(d: Any, keys: tuple[str, ...]) -> Any:
    """``nested`` with list indices ("0", "1") for intervals."""
    for k in keys:
        if isinstance(d, list) and k.isdigit():
            d = d[int(k)] if int(k) < len(d) else None
        else:
            d = nested(d, (k,))
    return d


def _verdict_text(v: Any) -> str | None:
    """A post-training verdict in a word: "DP better", or its status ("no difference", ...)."""
    if not isinstance(v, dict):
        return v if isinstance(v, str) else None
    if v.get("status") == "better" and v.get("better"):
        return f"{short_label(v['better'])} better"
    return v.get("status")


def _value(report: dict, stage: dict, f: dict, name: str, m: str, primary: str | None) -> Any:
    """One figure of ``method`` ``m`` (its record ``f`` in ``stage`` of ``report``)."""
    path = tuple(k.format(m=m, p=primary) for k in FIGURES[name].path)
    root, path = {"stage": (stage, path[1:]), "finetune": (report, path)}.get(path[0], (f, path))
    if path[0] == "finetune" and not primary:
        return None
    ok = _OK_ONLY.get(name)
    if ok is not None:  # the figure's record says whether it holds one
        rec = _get(root, path[: len(ok) - (root is stage)])
        if not isinstance(rec, dict) or rec.get("status") != "ok":
            return rec.get("status") if name == "post_verdict" and isinstance(rec, dict) else None
    v = _get(root, path)
    return _verdict_text(v) if name == "post_verdict" else v if name == "seeds" else num(v)


def runs_table(reports: dict[Any, dict]) -> pd.DataFrame:
    """The runs-table of ``reports`` (run or seed → its report record): columns ``run``, ``stage``,
    ``method``, ``status`` (the method's), ``unit`` (``tokens``/``images``; None where the stage
    does not say), ``split`` (what the stage's gap is measured on), ``val_loss`` (the whole
    validation split where measured, else the sample), ``loss`` (the test split where measured,
    else the validation sample: the verdict's), ``post_task``, ``post_metric`` and one column per
    :data:`FIGURES` entry (floats; None where the record lacks it). Rows in the records' order."""
    rows = []
    for run, rep in reports.items():
        ft = rep.get("finetune") or {}
        primary = ft.get("primary")
        for name, stage in (rep.get("stages") or {}).items():
            for m, f in (stage.get("methods") or {}).items():
                row = {"run": run, "stage": name, "method": m, "status": f.get("status"), "unit": stage.get("unit")}
                row["split"] = _get(stage, ("loss_gaps", "diloco", "split"))
                row.update({k: _value(rep, stage, f, k, m, primary) for k in FIGURES})
                rows.append(row | {"post_task": _get(ft, ("task", "name")), "post_metric": primary})
    cols = ["run", "stage", "method", "status", "unit", "split", *FIGURES, "post_task", "post_metric"]
    t = pd.DataFrame(rows, columns=cols, dtype=object)
    t["val_loss"] = t.val_loss_whole.where(t.val_loss_whole.notna(), t.final_val_loss)
    t["loss"] = t.test_loss.where(t.test_loss.notna(), t.final_val_loss)
    return t


def wide(table: pd.DataFrame, figures: list[str], methods: list[str], runs: list | None = None) -> pd.DataFrame:
    """``table`` (one stage) pivoted to one row per run of ``runs`` (default: the table's, in
    order), one column ``<method>/<figure>`` per method of ``methods`` and figure (None where a
    run lacks it)."""
    runs = list(dict.fromkeys(table.run)) if runs is None else runs
    w = table.pivot(index="run", columns="method", values=figures).reindex(runs)
    w = w.reindex(columns=pd.MultiIndex.from_product([figures, methods]))
    w.columns = [f"{m}/{k}" for k, m in w.columns]
    return w.astype(object).where(w.notna(), None)
