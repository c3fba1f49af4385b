"""The verdict: is Decoupled DiLoCo as good as DP, and what does it buy — one table and a sentence.

Built from the runs-table (:mod:`reports.table`) of one run's ``report.json`` (one seed: figures
without an interval) or of the reports of every seed of a run of several seeds (mean and 95 %
Student-t interval over seeds; the gap paired per seed; the published gap from the fits of arXiv
2503.09799). Rows and statistics: docs/verdict.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from reports.common import BASELINE, format_value, md_table, nested, num, settings, with_ci
from reports.table import runs_table, wide

_METHODS = ("diloco", BASELINE)
_FIGURES = ["loss", "bytes_per_token", "modelled_wall_s", "time_to_dp_final_s", "goodput", "uptime", "params"]

CONFIDENCE = 0.95
# arXiv 2503.09799 ("Scaling Laws for DiLoCo"), power-law fits L = A·N^α of the final evaluation
# loss against parameters N, each method tuned: DP and DiLoCo with M = 1, 2, 4, 8 replicas.
PUBLISHED_FITS = {
    "dp": (18.129, -0.0953),
    1: (18.363, -0.0961),
    2: (18.768, -0.0969),
    4: (19.762, -0.0992),
    8: (21.051, -0.1018),
}
PUBLISHED = "arXiv 2503.09799, fits at 20 tokens per parameter; each method tuned, H = 30"


def published_gap_pct(learners: int | None, params: float | None) -> float | None:
    """The gap DiLoCo − DP in % that the fits of :data:`PUBLISHED_FITS` predict at ``params``
    parameters with M = ``learners``: 100 · (A_M N^α_M / (A_DP N^α_DP) − 1); None for an M the
    study did not fit or no parameter count."""
    if learners not in PUBLISHED_FITS or not params:
        return None
    (a, al), (b, bl) = PUBLISHED_FITS[learners], PUBLISHED_FITS["dp"]
    return 100.0 * (a * params**al / (b * params**bl) - 1.0)


def mean_interval(values: Iterable[Any], confidence: float = CONFIDENCE) -> dict:
    """``{"mean", "ci", "n", "sd"}`` of the finite numbers among ``values`` (None, NaN and
    non-numbers are left out): the mean and its Student-t interval (``ci`` = [mean − h, mean + h],
    h = t_{(1+confidence)/2, n−1} · sd / √n, sd with ddof 1); ``ci`` is None for fewer than two
    values, ``mean`` None for none."""
    from scipy.stats import t

    v = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").astype(float).to_numpy()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"mean": None, "ci": None, "n": 0, "sd": None}
    if v.size == 1:
        return {"mean": float(v[0]), "ci": None, "n": 1, "sd": None}
    sd = float(v.std(ddof=1))
    h = float(t.ppf((1 + confidence) / 2, v.size - 1)) * sd / math.sqrt(v.size)
    return {"mean": float(v.mean()), "ci": [float(v.mean() - h), float(v.mean() + h)], "n": int(v.size), "sd": sd}


def context(report: dict) -> dict:
    """What the verdict's words read of a run's report besides its runs-table figures: the seed,
    unit, the split of the gap, the network the wall times are modelled on, and M."""
    cfg = settings(report.get("config"))
    pre = nested(report, ("stages", "pretrain")) or {}
    net = pre.get("interconnect") or {}
    return {
        "seed": cfg.seed if cfg is not None else None,
        "unit": pre.get("unit") or "tokens",
        "split": nested(pre, ("loss_gaps", "diloco", "split")) or "validation sample",
        "network": net.get("short"),
        "network_kind": net.get("kind", "modelled"),
        "assumption": net.get("assumption"),
        "learners": cfg.diloco.learners if cfg is not None else None,
    }


def _own_post(report: dict) -> dict | None:
    """The post-training difference of a run's own fine-tuning (its ``finetune``), or None."""
    ft = report.get("finetune") or {}
    primary = ft.get("primary")
    if not primary:
        return None
    scores = {m: num(nested(ft, ("methods", m, "scores", primary, "finetuned"))) for m in _METHODS}
    label = nested(ft, ("task", "metrics", primary, "label")) or primary
    diff = nested(ft, ("differences", "diloco", "metrics", primary, "finetuned")) or {}
    return {**diff, "metric": primary, "label": label, "scores": scores}


def verdict(reports: dict[Any, dict], post: dict | None = None, part_of_seeds: bool = False) -> dict:
    """The verdict over the report records of each seed's run (one or more; seed → report).

    ``post``: the post-training difference over every seed (a dict of
    :func:`reports.finetune.paired_bootstrap_difference` with ``verdict``, ``metric``, ``label`` and
    per method ``scores``); default: the one seed's own. ``part_of_seeds``: the run is one seed of a
    run of several. Returns the figures (:func:`mean_interval` of the runs-table's ``loss`` per method
    and of the paired per-seed gaps, means of the others), ``rows`` (the table) and ``words`` (the
    verdict in a paragraph); keys: docs/contracts.md."""
    seeds = list(reports)
    t = runs_table(reports)
    w = wide(t[t.stage == "pretrain"], _FIGURES, list(_METHODS), seeds)
    first = context(reports[seeds[0]]) | {"params": w["diloco/params"].iloc[0]}
    n = len(seeds)
    ok = w[w["diloco/loss"].notna() & w[f"{BASELINE}/loss"].notna()]
    loss = {m: mean_interval(ok[f"{m}/loss"]) for m in _METHODS}
    gap = mean_interval(100 * (ok["diloco/loss"] - ok[f"{BASELINE}/loss"]) / ok[f"{BASELINE}/loss"])
    pub = published_gap_pct(first.get("learners"), first.get("params"))
    means = {k: {m: mean_interval(w[f"{m}/{k}"])["mean"] for m in _METHODS} for k in _FIGURES}
    if post is None and n == 1:
        post = _own_post(reports[seeds[0]])
    v = {"seeds": [context(r)["seed"] for r in reports.values()], "n": n, "loss": loss, "gap_pct": gap}
    v |= {"published_gap_pct": pub, "published": PUBLISHED}
    v |= {k: means[k] for k in ("bytes_per_token", "modelled_wall_s", "time_to_dp_final_s")}
    v |= {"reached_dp_final": [x is not None for x in w["diloco/time_to_dp_final_s"]]}
    v |= {"goodput": means["goodput"]["diloco"], "uptime": means["uptime"]["diloco"]}
    v |= {"network": first.get("network"), "assumption": first.get("assumption"), "post": post}
    v["rows"] = _rows(v, first)
    v["words"] = _words(v, first, part_of_seeds)
    return v


def _whole(x) -> str:
    return format_value(x, "{:,.0f}")


def _row(figure: str, diloco: str, dp: str, vs: str) -> dict:
    return {"figure": figure, "DiLoCo": diloco, "DP": dp, "DiLoCo vs DP": vs}


def _ratio_row(figure: str, values: dict, reached: bool = True, missed: str = "") -> dict:
    """A row of whole numbers per method and DiLoCo's as a multiple of DP's ("0.10×")."""
    d, p = values["diloco"], values[BASELINE]
    ratio = f"{d / p:.2f}×" if d is not None and p and reached else "—"
    return _row(figure, _whole(d) if reached else missed, _whole(p), ratio)


def _rows(v: dict, first: dict) -> list[dict]:
    """The verdict's table (figure, DiLoCo, DP, DiLoCo vs DP) from :func:`verdict`'s figures."""
    n, loss, gap, pub = v["n"], v["loss"], v["gap_pct"], v["published_gap_pct"]
    over, params = (f"{n} seeds" if n > 1 else "one seed: no interval"), f"{_whole(first.get('params'))} parameters"
    published = "not fitted for this M" if pub is None else f"{pub:+.2f} %"
    rows = [
        _row(
            f"{first['split']} loss (nats/{first['unit'].removesuffix('s')}; mean [95 % interval], {over})",
            *(with_ci(loss[m]["mean"], loss[m]["ci"]) for m in _METHODS),
            with_ci(gap["mean"], gap["ci"], "{:+.2f}") + " %" + (" (paired)" if n > 1 else ""),
        ),
        _row(f"published gap at M = {first.get('learners')}, {params} (arXiv 2503.09799 fits)", "", "", published),
        _ratio_row("bytes sent per token (learner→syncer; DP: ring all-reduce)", v["bytes_per_token"]),
    ]
    if first.get("network"):
        reached = v["reached_dp_final"]
        missed = "not reached" if n == 1 else f"not reached ({sum(not r for r in reached)} of {n} seeds)"
        net, kind = first["network"], first.get("network_kind", "modelled")
        rows.append(_ratio_row(f"{kind} wall time, s ({net})", v["modelled_wall_s"]))
        to_final = f"time to DP's final held-out loss, s ({net})"
        rows.append(_ratio_row(to_final, v["time_to_dp_final_s"], all(reached), missed))
    good, up = format_value(v["goodput"], "{:.3f}"), format_value(v["uptime"], "{:.3f}")
    rows.append(_row("goodput / uptime of the learners (measured; fraction of time)", f"{good} / {up}", "", ""))
    post = v["post"]
    if post and post.get("metric"):
        scores = [format_value((post.get("scores") or {}).get(m), "{:.4f}") for m in _METHODS]
        figure = f"post-training {post['label']} (fine-tuned; paired bootstrap {post.get('over', '')})"
        rows.append(_row(figure, *scores, with_ci(post.get("difference"), post.get("ci"), "{:+.4f}")))
    return rows


def _head(g: float, ci: list | None, n: int, first: dict, part_of_seeds: bool) -> str:
    """The verdict's first sentence: the gap ``g`` (%) with its interval ``ci`` over ``n`` seeds."""
    loss = f"DiLoCo's {first['split']} loss is {g:+.2f} % against DP's"
    if ci is None and part_of_seeds:
        return (
            f"This is seed {first['seed']} of a run of several seeds: {loss} here; the verdict over seeds, "
            "with its interval, is the run's report (../../report/report.md)."
        )
    if ci is None:
        no = "one seed gives no interval, so this is no verdict yet (set seeds: [0, 1, 2] for one)"
        return f"On one seed, {loss}; {no}."
    said = "no significant difference" if ci[0] <= 0 <= ci[1] else f"{'DP' if g > 0 else 'DiLoCo'} is better"
    return f"Over {n} seeds, {loss} (95 % interval {ci[0]:+.2f} to {ci[1]:+.2f} %): {said} at equal tokens."


def _words(v: dict, first: dict, part_of_seeds: bool = False) -> str:
    """The verdict in a paragraph from :func:`verdict`'s figures ``v``."""
    gap, pub, bpt, post = v["gap_pct"], v["published_gap_pct"], v["bytes_per_token"], v["post"]
    wall, reached = v["modelled_wall_s"], v["reached_dp_final"]
    if gap["mean"] is None:
        return "No verdict: a method has no final held-out loss (see the stages below)."
    parts = [_head(gap["mean"], gap["ci"], v["n"], first, part_of_seeds)]
    if pub is not None:
        parts.append(
            f"The published fits predict {pub:+.2f} % at this size and M = {first.get('learners')} ({PUBLISHED})."
        )
    if bpt["diloco"] and bpt[BASELINE]:
        parts.append(f"DiLoCo sends {bpt['diloco'] / bpt[BASELINE]:.2f}× DP's bytes per token.")
    if first.get("network") and wall["diloco"] and wall[BASELINE]:
        reaching = "reaching DP's final held-out loss"
        if not all(reached):
            reaching = f"without {reaching}" if not any(reached) else f"{reaching} on {sum(reached)} of {v['n']} seeds"
        parts.append(
            f"Under the {first.get('network_kind', 'modelled')} network ({first['network']}) it finishes in "
            f"{wall['diloco'] / wall[BASELINE]:.2f}× DP's time, {reaching}."
        )
    scores = (post or {}).get("scores") or {}
    if post and scores and all(x == 0 for x in scores.values()):
        parts.append(
            f"Post-training ({post['label']}): both methods score 0 on every test item, so the task "
            "cannot tell them apart at this size."
        )
    elif post and (post.get("verdict") or {}).get("text"):
        parts.append(f"Post-training ({post['label']}): {post['verdict']['text']}.")
    return " ".join(parts)


def verdict_table(v: dict, fmt: str = "github") -> str:
    """The verdict's rows as a table: markdown (``github``, :func:`reports.common.md_table`) or
    tabulate's ``fmt`` for a terminal (``simple``)."""
    if fmt == "github":
        return md_table(list(v["rows"][0]), [list(r.values()) for r in v["rows"]])
    return pd.DataFrame(v["rows"]).to_markdown(
        index=False, tablefmt=fmt, disable_numparse=True, maxcolwidths=[44, None, None, None]
    )  # the labels wrap
