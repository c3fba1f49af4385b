"""The report's post-training part: the paired bootstrap, and the section on a synthetic run.

The run is tests/test_report.py's pretraining run plus a ``finetune`` stage written as the
fine-tuning recipe writes it: per method a summary (recipe, runs per seed), train/eval loss rows
per seed and step, and ``eval/finetune/<method>.json`` with per-item scores (the same 40 test
items, in the same order, for every method and seed). Scores are made up but consistent: each
``metrics`` value is the mean of its per-item values.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reports import build_report
from reports.finetune import paired_bootstrap_difference, two_level_bootstrap
from run.layout import RunLayout
from tests.conftest import squash
from tests.test_report import _make_run, _write, _write_jsonl

FT = "finetune"
N = 40
TEXT_TASK = {
    "name": "speakers",
    "modality": "text",
    "description": "name the character who speaks a line of a held-out play",
    "primary": "exact_match",
    "metrics": {
        "exact_match": {"higher_is_better": True, "label": "exact match"},
        "response_nll": {"higher_is_better": False, "label": "response NLL (nats/token)"},
    },
    "train_items": 160,
    "test_items": N,
    "baselines": {"majority speaker of the play": 0.18},
}
IMAGE_TASK = {
    "name": "rotation",
    "modality": "image",
    "description": "which of 0/90/180/270° an image was turned by",
    "primary": "accuracy",
    "metrics": {
        "accuracy": {"higher_is_better": True, "label": "accuracy"},
        "loss": {"higher_is_better": False, "label": "loss (nats)"},
    },
    "train_items": 300,
    "test_items": N,
    "baselines": {"chance": 0.25},
}


# -- the bootstrap ------------------------------------------------------------------------------------


def _reference(d: np.ndarray, resamples: int = 2000) -> list[float]:
    """The documented procedure written out again: seeds (if more than one), then items, per resample."""
    d = np.atleast_2d(np.asarray(d, dtype=float))
    s, n = d.shape
    rng = np.random.default_rng(0)
    stats = []
    for _ in range(resamples):
        rows = rng.integers(0, s, size=s) if s > 1 else np.array([0])
        cols = rng.integers(0, n, size=n)
        stats.append(np.mean([[d[r, c] for c in cols] for r in rows]))
    return list(np.percentile(stats, [2.5, 97.5]))


def test_identical_inputs_give_zero():
    a = np.random.default_rng(1).normal(size=(3, 50))
    out = paired_bootstrap_difference(a, a.copy())
    assert out["difference"] == 0.0 and out["ci"] == [0.0, 0.0]
    assert (out["seeds"], out["items"], out["levels"], out["over"]) == (
        3,
        50,
        "seeds and items",
        "over 50 items and 3 seeds",
    )


def test_a_constant_shift_is_that_shift():
    b = np.random.default_rng(2).normal(size=(2, 30))
    out = paired_bootstrap_difference(b + 0.25, b)
    assert out["difference"] == pytest.approx(0.25)
    assert out["ci"] == pytest.approx([0.25, 0.25])
    one = paired_bootstrap_difference(b[:1] - 1.0, b[:1])  # one seed: items only
    assert one["difference"] == pytest.approx(-1.0) and one["ci"] == pytest.approx([-1.0, -1.0])
    assert (one["levels"], one["over"]) == ("items", "over 30 items and 1 seed")
    pre = paired_bootstrap_difference(b[0], b[1])  # no seed axis: two pretrained models
    assert (pre["levels"], pre["seeds"], pre["over"]) == ("items", None, "over 30 items")
    assert pre["ci"] == pytest.approx(_reference(b[0] - b[1]), abs=1e-12)


def test_the_interval_narrows_with_more_items():
    rng = np.random.default_rng(3)
    widths = []
    for n in (40, 640):
        a, b = rng.normal(0.1, 1.0, size=(2, n)), rng.normal(0.0, 1.0, size=(2, n))
        lo, hi = paired_bootstrap_difference(a, b, resamples=500)["ci"]
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # ~ 1/√16 = 1/4 of it


def test_the_interval_is_the_documented_procedure():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(3, 12)), rng.normal(size=(3, 12))
    assert paired_bootstrap_difference(a, b, resamples=300)["ci"] == pytest.approx(_reference(a - b, 300), abs=1e-12)
    # One seed: a bootstrap over items only; near the normal approximation mean ± 1.96 sd/√N.
    d = rng.normal(0.3, 1.0, size=400)
    out = two_level_bootstrap(d)
    assert out["ci"] == pytest.approx(_reference(d), abs=1e-12)
    half = 1.96 * d.std(ddof=1) / np.sqrt(d.size)
    assert out["ci"] == pytest.approx([d.mean() - half, d.mean() + half], abs=0.25 * half)
    # Seeds add their own spread: a seed offset widens the interval over the items-only one.
    seeds = d[None, :] + np.array([[-1.0], [0.0], [1.0]])
    assert np.diff(two_level_bootstrap(seeds)["ci"])[0] > 2 * np.diff(out["ci"])[0]
    with pytest.raises(ValueError, match="same seeds and items"):
        paired_bootstrap_difference(a, b[:, :5])
    assert two_level_bootstrap([1.0, float("nan")])["ci"] is None


# -- the run ------------------------------------------------------------------------------------------


def _items(method: str, seed: int | None, modality: str) -> dict[str, list]:
    """Per-item scores; fine-tuned DiLoCo gets a few more items right than DP at each seed."""
    rng = np.random.default_rng(10 * len(method) + (seed if seed is not None else 7))
    base = np.random.default_rng(11).random(N)  # item difficulty, shared by everyone
    skill = {None: 0.05, 0: 0.55, 1: 0.6}[seed] + (0.05 if method == "diloco" and seed is not None else 0.0)
    correct = (base < skill).astype(int)
    if seed is not None:
        flip = rng.random(N) < 0.1
        correct = np.where(flip, 1 - correct, correct)
    nll = np.round(3.0 - 2.0 * correct + 0.5 * rng.random(N), 4)
    first, second = ("exact_match", "response_nll") if modality == "text" else ("accuracy", "loss")
    return {first: [int(x) for x in correct], second: [float(x) for x in nll]}


def _scores(per_item: dict[str, list]) -> dict:
    return {"metrics": {k: float(np.mean(v)) for k, v in per_item.items()}, "per_item": per_item}


def _write_finetune(run: Path, methods=("diloco", "dp"), seeds=(0,), modality: str = "text") -> None:
    lay = RunLayout(run)
    task = TEXT_TASK if modality == "text" else IMAGE_TASK
    for m in methods:
        _write(
            lay.summary(FT, m),
            {
                "method": m,
                "source_checkpoint": f"{run}/pretrain/{m}/checkpoints/32768",
                "recipe": {
                    "mode": "lora",
                    "lora_rank": 8,
                    "steps": 20,
                    "batch_size": 8,
                    "lr": 0.001,
                    "seeds": list(seeds),
                    "packing": False,
                    "task": task["name"],
                },
                "trainable_params": 4096,
                "frozen_params": 123456,
                "runs": [
                    {
                        "seed": s,
                        "steps": 20,
                        "examples": 160,
                        "wall_s": 3.5,
                        "final_train_loss": 1.2 + 0.1 * s,
                        "final_val_loss": 1.4 + 0.1 * s,
                        "order_sha256": f"{s:02d}ab12cd34ef56" * 4,
                    }
                    for s in seeds
                ],
            },
        )
        _write_jsonl(
            lay.metrics(FT, m, "train"),
            [
                {
                    "seed": s,
                    "step": st,
                    "examples": 8 * st,
                    "train/loss": 3.0 / (1 + 0.1 * st) + 0.05 * s,
                    "t": 0.1 * st,
                }
                for s in seeds
                for st in range(5, 21, 5)
            ],
        )
        _write_jsonl(
            lay.metrics(FT, m, "eval"),
            [
                {"seed": s, "step": st, "examples": 8 * st, "val/loss": 3.2 / (1 + 0.08 * st) + 0.05 * s}
                for s in seeds
                for st in (0, 10, 20)
            ],
        )
        result = {
            "method": m,
            "stage": FT,
            "task": task,
            "pretrained": _scores(_items(m, None, modality)),
            "finetuned": [{"seed": s, **_scores(_items(m, s, modality))} for s in seeds],
        }
        if modality == "text":
            result["pretrain_tasks"] = {
                "pretrained": {
                    "heldout_ppl/bits_per_byte": 2.33,
                    "heldout_nextline/acc": 0.44,
                    "heldout_nextline/acc_stderr": 0.03,
                },
                "finetuned": {
                    "heldout_ppl/bits_per_byte": 2.41,
                    "heldout_nextline/acc": 0.40,
                    "heldout_nextline/acc_stderr": 0.03,
                },
            }
        _write(lay.eval_result(FT, m), result)


def _eval(run: Path, m: str) -> dict:
    return json.loads(RunLayout(run).eval_result(FT, m).read_text())


def _without_timestamp(md: str) -> str:
    return "\n".join(x for x in md.splitlines() if not x.startswith("- generated:"))


def test_post_training_section_one_seed(tmp_path: Path):
    run = _make_run(tmp_path)
    lay = RunLayout(run)
    before = (build_report(run), lay.report_md.read_text())
    assert before[0]["finetune"] is None and "Post-training" not in before[1]

    _write_finetune(run, seeds=(0,))
    report = build_report(run)
    md = squash(lay.report_md.read_text())
    ft = report["finetune"]
    assert list(report["stages"]) == ["pretrain"]  # the post-training stage is reported apart
    assert md.index("## Pretraining") < md.index("## Post-training") < md.index("## Data")
    # The difference, computed here from the per-item arrays (one seed: items only).
    a = np.array(_eval(run, "diloco")["finetuned"][0]["per_item"]["exact_match"], dtype=float)
    b = np.array(_eval(run, "dp")["finetuned"][0]["per_item"]["exact_match"], dtype=float)
    d = ft["differences"]["diloco"]["metrics"]["exact_match"]["finetuned"]
    assert d["difference"] == pytest.approx((a - b).mean())
    lo, hi = _reference(a - b)
    assert d["ci"] == pytest.approx([lo, hi], abs=1e-12)
    assert d["over"] == f"over {N} items and 1 seed"
    cell = f"{(a - b).mean():+.4f} [{lo:+.4f}, {hi:+.4f}]"
    assert "| **DiLoCo − DP** | " in md and cell in md
    expected = "no significant difference between DiLoCo and DP" if lo <= 0 <= hi else "is better"
    assert expected in ft["verdicts"]["diloco"]["finetuned"]["text"]
    text = ft["verdicts"]["diloco"]["finetuned"]["text"]
    assert f"**Parity, exact match, fine-tuned:** {text}: DiLoCo − DP = {cell} over {N} items and 1 seed." in md
    # Each method's scores: pretrained → fine-tuned, change.
    sc = ft["methods"]["diloco"]["scores"]["exact_match"]
    pre = _eval(run, "diloco")["pretrained"]["per_item"]["exact_match"]
    assert sc["pretrained"] == pytest.approx(np.mean(pre)) and sc["pretrained_over"] == f"over {N} items"
    assert sc["finetuned"] == pytest.approx(a.mean()) and sc["change"] == pytest.approx(a.mean() - sc["pretrained"])
    assert f"| Decoupled DiLoCo | {sc['pretrained']:.4f} [" in md
    assert f"| {sc['change']:+.4f} | seed 0: {a.mean():.4f} |" in md
    # NLL: lower is better, so a negative difference favours DiLoCo.
    assert "#### response NLL (nats/token): lower is better" in md
    assert "#### exact match (primary): higher is better" in md
    # Task, recipe, pretraining tasks, runs and figure.
    assert (
        "**Task:** speakers (text): name the character who speaks a line of a held-out play; 160 training items, "
        f"{N} test items; primary metric: exact match."
    ) in md
    assert "majority speaker of the play: 0.1800" in md
    assert "| mode | lora | lora |" in md and "| trainable parameters | 4,096 | 4,096 |" in md
    assert "| seeds | 0 | 0 |" in md and "| learning rate | 0.001 | 0.001 |" in md
    assert "| heldout_ppl: bits per byte | 2.3300 → 2.4100 (+0.08) | 2.3300 → 2.4100 (+0.08) |" in md
    assert "Example order: the same for every method at each seed" in md
    assert ft["plots"]["loss"] == "finetune_loss.png" and "![fine-tuning loss](finetune_loss.png)" in md
    assert (lay.report / "finetune_loss.png").stat().st_size > 0
    on_disk = json.loads((lay.report / "report.json").read_text())
    assert on_disk == report and on_disk["finetune"]["differences"]["diloco"]["metrics"]["exact_match"]["finetuned"][
        "ci"
    ] == pytest.approx([lo, hi])

    # Without the post-training files the report is what it was (no section, no figure).
    import shutil

    shutil.rmtree(run / FT)
    shutil.rmtree(run / "eval" / FT)
    report = build_report(run)
    assert report["finetune"] is None and not (lay.report / "finetune_loss.png").exists()
    assert _without_timestamp(lay.report_md.read_text()) == _without_timestamp(before[1])


def test_post_training_two_seeds(tmp_path: Path):
    run = _make_run(tmp_path)
    _write_finetune(run, seeds=(0, 1))
    report = build_report(run)
    md = squash(RunLayout(run).report_md.read_text())
    ft = report["finetune"]
    sc = ft["methods"]["dp"]["scores"]["exact_match"]
    per_seed = [np.mean(r["per_item"]["exact_match"]) for r in _eval(run, "dp")["finetuned"]]
    assert [p["value"] for p in sc["finetuned_per_seed"]] == pytest.approx(per_seed)
    assert sc["finetuned"] == pytest.approx(np.mean(per_seed)) and sc["finetuned_over"] == f"over {N} items and 2 seeds"
    assert "(mean of 2 seeds) | " in md and f"seed 0: {per_seed[0]:.4f}; seed 1: {per_seed[1]:.4f}" in md
    a = np.array([r["per_item"]["response_nll"] for r in _eval(run, "diloco")["finetuned"]])
    b = np.array([r["per_item"]["response_nll"] for r in _eval(run, "dp")["finetuned"]])
    d = ft["differences"]["diloco"]["metrics"]["response_nll"]["finetuned"]
    assert d["difference"] == pytest.approx((a - b).mean()) and d["levels"] == "seeds and items"
    assert d["ci"] == pytest.approx(_reference(a - b), abs=1e-12)
    assert f"fine-tuned over {N} items and 2 seeds, pretrained over {N} items." in md
    assert "| seeds | 0, 1 | 0, 1 |" in md


def test_one_method_and_an_image_task(tmp_path: Path):
    run = _make_run(tmp_path)
    _write_finetune(run, methods=("diloco",), modality="image")
    path = RunLayout(run).summary(FT, "diloco")
    _write(path, {**json.loads(path.read_text()), "interrupted": True})
    report = build_report(run)
    md = squash(RunLayout(run).report_md.read_text())
    ft = report["finetune"]
    assert list(ft["methods"]) == ["diloco"] and ft["differences"] == {} and ft["verdicts"] == {}
    assert "DiLoCo − DP" not in md and "**Parity" not in md
    assert "#### accuracy (primary): higher is better" in md and "| Decoupled DiLoCo |" in md
    assert ft["pretrain_tasks"] == [] and "Pretraining tasks before" not in md  # vision: none
    assert ft["methods"]["diloco"]["interrupted"] is True
    assert "- Decoupled DiLoCo fine-tuning: **interrupted**" in md
    assert (RunLayout(run).report / "finetune_loss.png").stat().st_size > 0
