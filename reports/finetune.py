"""The post-training part of the report: every pretrained model fine-tuned with one recipe, scored
before and after, and each method's difference to the data-parallel baseline with its paired two-level
bootstrap interval (docs/report.md, "Post-training"). Pure but for :func:`finetune_loss_figure`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from reports.analyses import EVAL_METRIC_NAMES
from reports.common import BASELINE, NOT_RUN, label, nested, num, short_label
from reports.plots import finish_axes, new_figure, series_color
from reports.read import FinetuneRecords

RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
LABEL = "Post-training"
MARKERS = ("o", "s", "^", "D", "v")  # held-out points, one shape per method (overlapping curves stay visible)
BOOTSTRAP_DEFINITION = (
    "95 % percentile interval of a bootstrap with 2,000 resamples (numpy default_rng(0), so the "
    "same inputs always give the same interval). Each resample draws the fine-tuning seeds with "
    "replacement (when there is more than one) and then the test items with replacement, and takes "
    "the mean over the drawn seeds and items. A difference A − B is paired: both methods get the "
    "same drawn seeds (the recipe fine-tunes both with the same seed) and the same drawn items, "
    "and the statistic is the mean over them of the per-item difference A − B."
)


def _plural(k: int, what: str) -> str:
    return f"{k:,} {what}{'s' if k != 1 else ''}"


def two_level_bootstrap(
    values: Any, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE
) -> dict:
    """Mean of ``values`` (shape [S seeds, N items], [N] for one seed, or [P, S, N]: S fine-tuning
    seeds of each of P pretraining seeds) with a percentile bootstrap interval (docs/report.md,
    "Post-training"): each resample (``numpy.random.default_rng(seed)``) draws the pretraining seeds
    (P > 1), the seeds (S > 1), then the items with replacement, one item draw shared by all drawn
    seeds (crossed), and takes the mean; the interval is the percentiles 100·α/2 and 100·(1 − α/2) of
    those means, α = 1 − ``confidence``. Returns ``estimate``, ``ci`` ([low, high]; None when a value
    is not finite), ``confidence``, ``resamples``, ``seeds`` (S; None for [N]), ``pretrain_seeds``
    (P; [P, S, N] only), ``items``, ``levels`` and ``over`` ("over N items and S seeds"). ``ValueError``
    for any other shape or an empty axis."""
    v = np.asarray(values, dtype=float)
    seed_axis = v.ndim >= 2
    v = v[None, :] if v.ndim == 1 else v
    if v.ndim not in (2, 3) or min(v.shape) < 1:
        raise ValueError(
            f"values must be [seeds, items] or [pretraining seeds, seeds, items] with at least one "
            f"of each, got shape {v.shape}"
        )
    *lead, n = v.shape
    s = lead[-1]
    over = f"over {_plural(n, 'item')}"
    out = {
        "estimate": float(v.mean()),
        "ci": None,
        "confidence": confidence,
        "resamples": resamples,
        "seeds": s if seed_axis else None,
        "items": n,
        "levels": "seeds and items" if s > 1 else "items",
        "over": over + (f" and {_plural(s, 'seed')}" if seed_axis else ""),
    }
    if v.ndim == 3:
        out.update(
            pretrain_seeds=lead[0],
            levels="pretraining seeds, fine-tuning seeds and items",
            over=f"{over}, {_plural(s, 'fine-tuning seed')} and {_plural(lead[0], 'pretraining seed')}",
        )
    if not np.isfinite(v).all():
        return out
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    keep = [np.arange(k) for k in lead]
    for r in range(resamples):
        idx = [rng.integers(0, k, size=k) if k > 1 else keep[i] for i, k in enumerate(lead)]
        idx.append(rng.integers(0, n, size=n))
        stats[r] = v[np.ix_(*idx)].mean()
    alpha = 1.0 - confidence
    lo, hi = np.percentile(stats, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    out["ci"] = [float(lo), float(hi)]
    return out


def paired_bootstrap_difference(
    a: Any, b: Any, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE
) -> dict:
    """Difference A − B of two methods' per-item scores ([S, N]: row s the s-th common seed, column i
    test item i; [N]; or [P, S, N]) with the paired interval: :func:`two_level_bootstrap` of a − b.
    Its dict with ``difference`` (= ``estimate``). ``ValueError`` when the shapes differ."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same seeds and items: shapes {a.shape} and {b.shape}")
    out = two_level_bootstrap(a - b, resamples, seed, confidence)
    out["difference"] = out["estimate"]
    return out


def verdict(diff: dict | None, higher_is_better: bool, method: str, baseline: str = BASELINE) -> dict:
    """``no significant difference`` when the interval contains 0, else which method is better
    (``higher_is_better`` orients the sign); ``undefined`` without an interval."""
    who, base = short_label(method), short_label(baseline)
    if not diff or diff.get("ci") is None:
        return {"status": "undefined", "better": None, "text": "undefined (no interval: missing or non-finite scores)"}
    lo, hi = diff["ci"]
    if lo <= 0.0 <= hi:
        return {
            "status": "no significant difference",
            "better": None,
            "text": f"no significant difference between {who} and {base} (the 95 % interval contains 0)",
        }
    better = method if (diff["difference"] > 0) == higher_is_better else baseline
    return {
        "status": "better",
        "better": better,
        "text": f"{short_label(better)} is better (the 95 % interval excludes 0)",
    }


def _finite_list(x: Any) -> list[float] | None:
    if not isinstance(x, list) or not x or any(num(v) is None for v in x):
        return None
    return [float(v) for v in x]


def _seed_rows(result: dict) -> list[dict]:
    return [r for r in (result.get("finetuned") or []) if isinstance(r, dict)]


def _score(metrics: dict | None, per_item: list[float] | None, key: str) -> float | None:
    v = num((metrics or {}).get(key))
    return float(np.mean(per_item)) if v is None and per_item else v


def method_scores(result: dict, metric_keys: list[str], notes: list[str], method: str) -> dict:
    """Per task metric: ``pretrained`` (with ``pretrained_ci``, items only), ``finetuned`` (mean
    over seeds of each seed's metric; ``finetuned_per_seed``; ``finetuned_ci``, seeds and items),
    ``change`` (fine-tuned − pretrained) and the intervals' ``over`` texts."""
    pre = result.get("pretrained") or {}
    rows = _seed_rows(result)
    out = {}
    for k in metric_keys:
        pre_items = _finite_list((pre.get("per_item") or {}).get(k))
        pre_v = _score(pre.get("metrics"), pre_items, k)
        matrix = [_finite_list((r.get("per_item") or {}).get(k)) for r in rows]
        scored = [(r.get("seed"), _score(r.get("metrics"), items, k)) for r, items in zip(rows, matrix)]
        per_seed = [{"seed": seed, "value": v} for seed, v in scored if v is not None]
        ft_v = float(np.mean([p["value"] for p in per_seed])) if per_seed else None
        pre_boot = two_level_bootstrap(pre_items) if pre_items else None
        whole = matrix and all(m is not None for m in matrix) and len({len(m) for m in matrix}) == 1
        ft_boot = two_level_bootstrap(matrix) if whole else None
        for what, value, boot in (("pretrained", pre_v, pre_boot), ("fine-tuned", ft_v, ft_boot)):
            if boot is None:
                continue
            if not math.isfinite(boot["estimate"]):
                notes.append(f"{label(method)}: the {what} {k} has non-finite per-item values; no interval.")
            elif value is not None and not math.isclose(value, boot["estimate"], rel_tol=1e-6, abs_tol=1e-9):
                notes.append(
                    f"{label(method)}: the {what} {k} ({value:.6g}) is not the mean of its per-item values "
                    f"({boot['estimate']:.6g}); its interval and the differences use the per-item mean."
                )
        out[k] = {
            "pretrained": pre_v,
            "pretrained_ci": (pre_boot or {}).get("ci"),
            "pretrained_over": (pre_boot or {}).get("over"),
            "finetuned": ft_v,
            "finetuned_per_seed": per_seed,
            "finetuned_ci": (ft_boot or {}).get("ci"),
            "finetuned_over": (ft_boot or {}).get("over"),
            "change": ft_v - pre_v if ft_v is not None and pre_v is not None else None,
        }
    return out


def curve_summary(rec: FinetuneRecords) -> dict:
    """Points of the fine-tuning curves and, per seed, the first and last held-out loss and the last
    logged training loss."""
    train = [r for r in (rec.train or []) if num(r.get("train/loss")) is not None]
    val = [r for r in (rec.curve or []) if num(r.get("val/loss")) is not None]
    per_seed = []
    for s in dict.fromkeys(r.get("seed") for r in [*val, *train]):
        vs = [num(r["val/loss"]) for r in val if r.get("seed") == s] or [None]
        ts = [num(r["train/loss"]) for r in train if r.get("seed") == s] or [None]
        per_seed.append({"seed": s, "first_val_loss": vs[0], "last_val_loss": vs[-1], "last_train_loss": ts[-1]})
    return {"train_points": len(train), "eval_points": len(val), "per_seed": per_seed}


def method_post_training(rec: FinetuneRecords, metric_keys: list[str], notes: list[str]) -> dict:
    """One method's post-training figures: ``status``/``eval_status``, ``interrupted`` (fewer seeds or
    steps), ``source_checkpoint``, ``recipe``, parameter counts, ``runs`` (per seed), ``seeds`` (those
    evaluated), ``scores`` (:func:`method_scores`), ``pretrain_tasks`` and ``curve``."""
    s, e = rec.summary or {}, rec.eval or {}
    pretrain_tasks, recipe = e.get("pretrain_tasks"), s.get("recipe")
    return {
        "status": "ok" if rec.summary is not None else NOT_RUN,
        "interrupted": bool(s.get("interrupted")) if rec.summary is not None else None,
        "eval_status": "ok" if rec.eval is not None else NOT_RUN,
        "files": rec.files,
        "source_checkpoint": s.get("source_checkpoint"),
        "recipe": recipe if isinstance(recipe, dict) else {},
        "trainable_params": num(s.get("trainable_params")),
        "frozen_params": num(s.get("frozen_params")),
        "runs": [r for r in (s.get("runs") or []) if isinstance(r, dict)],
        "seeds": [r.get("seed") for r in _seed_rows(e)],
        "scores": method_scores(e, metric_keys, notes, rec.method) if rec.eval is not None else {},
        "pretrain_tasks": pretrain_tasks if isinstance(pretrain_tasks, dict) else None,
        "curve": curve_summary(rec),
    }


def _per_item_matrix(result: dict, key: str, seeds: list) -> np.ndarray | None:
    by_seed = {r.get("seed"): _finite_list((r.get("per_item") or {}).get(key)) for r in _seed_rows(result)}
    rows = [by_seed.get(s) for s in seeds]
    if not rows or any(r is None for r in rows) or len({len(r) for r in rows}) != 1:
        return None
    return np.asarray(rows)


def difference(
    a_res: dict,
    b_res: dict,
    method: str,
    task: dict,
    metric_keys: list[str],
    notes: list[str],
    baseline: str = BASELINE,
) -> dict:
    """``method − baseline`` for every task metric, pretrained and fine-tuned, with the paired
    bootstrap interval (:func:`paired_bootstrap_difference`) and a :func:`verdict` each; seeds
    paired by value (those both methods were fine-tuned with)."""
    seeds_a, seeds_b = [r.get("seed") for r in _seed_rows(a_res)], {r.get("seed") for r in _seed_rows(b_res)}
    seeds = [s for s in seeds_a if s in seeds_b]
    if unpaired := sorted({*seeds_a, *seeds_b} - set(seeds), key=str):
        notes.append(
            f"{short_label(method)} − {short_label(baseline)}: seed(s) {', '.join(map(str, unpaired))} "
            "were fine-tuned for only one of the two methods and are left out of the paired difference."
        )
    out: dict[str, Any] = {"method": method, "baseline": baseline, "seeds": seeds, "metrics": {}}
    for k in metric_keys:
        hib = bool(((task.get("metrics") or {}).get(k) or {}).get("higher_is_better", True))
        row: dict[str, Any] = {"higher_is_better": hib}
        pairs = {  # each method's per-item scores
            "pretrained": [_finite_list(nested(res, ("pretrained", "per_item", k))) for res in (a_res, b_res)],
            "finetuned": [_per_item_matrix(res, k, seeds) for res in (a_res, b_res)],
        }
        for what, (a, b) in pairs.items():
            if a is None or b is None:
                row[what] = {"status": NOT_RUN, "why": "per-item scores missing for a method"}
            elif np.shape(a) != np.shape(b):
                why = f"the methods scored different numbers of items ({np.shape(a)[-1]} and {np.shape(b)[-1]})"
                row[what] = {"status": "not paired", "why": why}
                notes.append(f"{k} ({what}): {why}; no paired difference.")
            else:
                row[what] = {"status": "ok", **paired_bootstrap_difference(a, b)}
            row[what]["verdict"] = verdict(row[what], hib, method, baseline)  # no interval: undefined
        out["metrics"][k] = row
    return out


def _recipe_differences(a: dict | None, b: dict | None) -> list[str]:
    """The fields (but seeds) two summaries' ``finetune_config`` (if both have it) or ``recipe`` disagree on."""
    if not a or not b:
        return []
    key = "finetune_config" if a.get("finetune_config") and b.get("finetune_config") else "recipe"
    ra, rb = a.get(key) or {}, b.get(key) or {}
    return sorted(k for k in {*ra, *rb} if k != "seeds" and ra.get(k) != rb.get(k))


def _task(records: dict[str, FinetuneRecords], notes: list[str]) -> dict:
    tasks = {m: r.eval["task"] for m, r in records.items() if r.eval and isinstance(r.eval.get("task"), dict)}
    if not tasks:
        return {}
    first = next(iter(tasks.values()))
    for m, t in tasks.items():
        if diff := [k for k in ("name", "train_items", "test_items", "primary") if t.get(k) != first.get(k)]:
            notes.append(
                f"{label(m)}'s evaluation describes another task ({', '.join(diff)} differ); the section "
                f"shows {label(next(iter(tasks)))}'s."
            )
    return dict(first)


def _metric_keys(task: dict, records: dict[str, FinetuneRecords]) -> list[str]:
    keys = list((task.get("metrics") or {}).keys())
    if not keys:  # no task description: whatever the scores hold
        for r in records.values():
            keys += [k for k in ((r.eval or {}).get("pretrained") or {}).get("metrics", {}) if k not in keys]
    primary = task.get("primary")
    return sorted(keys, key=lambda k: k != primary)  # the primary metric first


def _pretrain_task_label(key: str) -> tuple[str, str]:
    task, _, metric = key.partition("/")
    text, _, fmt = EVAL_METRIC_NAMES.get(metric, (metric, "", "{:.4f}"))
    return (f"{task}: {text}" if metric else key), ("{:.4f}" if fmt == "int" else fmt)


def _task_value(pt: dict, key: str) -> tuple[float | int | None, float | int | None]:
    return num((pt.get("pretrained") or {}).get(key)), num((pt.get("finetuned") or {}).get(key))


def pretrain_task_rows(methods: dict[str, dict]) -> list[dict]:
    """The pretraining tasks before → after fine-tuning: one row per key (``_stderr`` keys attached
    to their metric; chance levels and word perplexity, which runs to 1e10 once fine-tuning has worn
    the model down, left out: bits per byte says the same), per method ``pretrained``, ``finetuned``,
    ``change`` (after − before)."""
    have = {m: f["pretrain_tasks"] for m, f in methods.items() if f.get("pretrain_tasks")}
    skip = ("_stderr", "/chance", "/word_perplexity")
    keys = [
        k
        for pt in have.values()
        for part in ("pretrained", "finetuned")
        for k, v in (pt.get(part) or {}).items()
        if not k.endswith(skip) and num(v) is not None
    ]
    rows = []
    for k in dict.fromkeys(keys):
        text, fmt = _pretrain_task_label(k)
        row: dict[str, Any] = {"key": k, "label": text, "fmt": fmt}
        for m, pt in have.items():
            (before, after), (b_se, a_se) = _task_value(pt, k), _task_value(pt, f"{k}_stderr")
            change = after - before if before is not None and after is not None else None
            row[m] = {"pretrained": before, "finetuned": after, "change": change}
            row[m] |= {"pretrained_stderr": b_se, "finetuned_stderr": a_se}
        rows.append(row)
    return rows


def order_check(methods: dict[str, dict]) -> dict:
    """Whether every method saw the same fine-tuning examples in the same order at each seed
    (the summaries' ``order_sha256`` per run): ``same`` true/false, or None when not recorded."""
    by_seed: dict[str, dict[str, str]] = {}
    for m, f in methods.items():
        for r in f["runs"]:
            if r.get("order_sha256"):
                by_seed.setdefault(str(r.get("seed")), {})[m] = r["order_sha256"]
    compared = {s: len(set(h.values())) == 1 for s, h in by_seed.items() if len(h) > 1}
    return {
        "same": all(compared.values()) if compared else None,
        "differs_at_seeds": [s for s, same in compared.items() if not same],
    }


def post_training_figures(records: dict[str, FinetuneRecords]) -> dict | None:
    """Every figure of the post-training part, or None when the run has no post-training stage:
    ``task``, ``metrics`` (the primary first), ``methods`` (:func:`method_post_training`),
    ``differences`` (each method − ``dp``: :func:`difference`), ``verdicts`` (the primary metric's),
    ``pretrain_tasks``, ``order`` (:func:`order_check`), ``bootstrap``, ``plots`` and ``notes``."""
    if not records:
        return None
    notes: list[str] = []
    task = _task(records, notes)
    keys = _metric_keys(task, records)
    methods = {m: method_post_training(r, keys, notes) for m, r in records.items()}
    primary = task.get("primary") if task.get("primary") in keys else (keys[0] if keys else None)
    differences, verdicts = {}, {}
    base = records.get(BASELINE)
    for m, rec in records.items():
        if m == BASELINE or base is None or rec.eval is None or base.eval is None:
            continue
        d = difference(rec.eval, base.eval, m, task, keys, notes)
        if differs := _recipe_differences(rec.summary, base.summary):  # no comparison of pretrained models any more
            why = f"the recipes differ ({', '.join(differs[:4])})"
            notes.append(
                f"{short_label(m)} − {short_label(BASELINE)}: {why}; the fine-tuned difference is shown "
                "but is not a like-for-like comparison."
            )
            for row in d["metrics"].values():
                row["finetuned"]["verdict"] = {
                    "status": "not comparable",
                    "better": None,
                    "text": f"not comparable: {why}",
                }
        differences[m] = d
        if primary is not None:
            verdicts[m] = {"metric": primary} | {
                w: d["metrics"][primary][w]["verdict"] for w in ("finetuned", "pretrained")
            }
    return {
        "stage": "finetune",
        "label": LABEL,
        "task": task,
        "metrics": keys,
        "primary": primary,
        "baseline": BASELINE if BASELINE in methods else None,
        "methods": methods,
        "differences": differences,
        "verdicts": verdicts,
        "pretrain_tasks": pretrain_task_rows(methods),
        "order": order_check(methods),
        "bootstrap": {
            "resamples": RESAMPLES,
            "seed": BOOTSTRAP_SEED,
            "confidence": CONFIDENCE,
            "interval": "percentile",
            "definition": BOOTSTRAP_DEFINITION,
        },
        "plots": {},
        "notes": notes,
    }


def _points(rows: list[dict] | None, key: str) -> list[dict]:
    return [r for r in rows or [] if num(r.get("step")) is not None and num(r.get(key)) is not None]


def finetune_loss_figure(records: dict[str, FinetuneRecords], modality: str | None = "text") -> Figure | None:
    """Fine-tuning loss against fine-tuning step, every method on one axes in its own colour:
    the training loss of each seed thin and transparent, the loss on the task's held-out test items
    (``val/loss``, step 0 = the pretrained model) as markers joined by a line. None without a curve."""
    series = [(m, _points(r.train, "train/loss"), _points(r.curve, "val/loss")) for m, r in records.items()]
    series = [x for x in series if x[1] or x[2]]
    if not series:
        return None
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    for i, (m, train, val) in enumerate(series):
        marked = {"lw": 1.4, "marker": MARKERS[i % len(MARKERS)], "ms": 4}
        for rows, key, what, style in (
            (train, "train/loss", "training", {"lw": 0.8, "alpha": 0.35}),
            (val, "val/loss", "held-out test", marked),
        ):
            for j, s in enumerate(dict.fromkeys(r.get("seed") for r in rows)):
                pts = sorted((float(r["step"]), float(r[key])) for r in rows if r.get("seed") == s)
                text = f"{label(m)}: {what} loss (each seed)" if j == 0 else None
                ax.plot(*zip(*pts), color=series_color(m, i), label=text, **style)
    unit = "nats/image" if modality == "image" else "nats/token, response tokens"
    ax.set_yscale("log")  # from the pretrained model's ~5 nats down to where the methods differ
    finish_axes(
        ax,
        "fine-tuning step",
        f"loss ({unit}, log scale)",
        "Fine-tuning loss (thin: training, each seed; markers: held-out test items)",
        title_size=10,
    )
    ax.legend(fontsize=8)
    return fig
