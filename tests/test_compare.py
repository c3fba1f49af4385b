"""``ddiloco compare`` and :func:`reports.compare.build_comparison` on small synthetic run directories.

Each run directory holds a real resolved config (``configs/tiny.yaml`` or ``configs/vit.yaml`` with
overrides, as ``ddiloco run`` writes it), a ``status.json`` and a ``report/report.json`` holding
only the keys the comparison reads (its docstring lists them), with numbers chosen here, so every
cell of the table can be checked against what was written. No training; a few seconds.
"""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from configs.load import load_config
from flows.cli import app
from reports.compare import build_comparison
from reports.read import ReportInputError
from tests.conftest import squash

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def make_run(
    path: Path,
    overrides: dict | None = None,
    *,
    config: str = "tiny",
    losses=(4.3, 4.1),
    status: str = "completed",
    unit: str = "tokens",
    accuracy=None,
    finetune: dict | None = None,
    report: bool = True,
    drop: tuple[str, ...] = (),
) -> Path:
    """A run directory: config.json (the resolved config; top-level sections in ``drop`` removed,
    like a config of an older schema), status.json and report/report.json (schema 3) with DiLoCo
    and DP final held-out losses ``losses`` (None: the method did not run)."""
    cfg = load_config(ROOT / "configs" / f"{config}.yaml", overrides).model_dump(mode="json")
    for key in drop:
        cfg.pop(key)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "status.json").write_text(
        json.dumps(
            {
                "status": status,
                "completed_stages": ["data"],
                "reason": None if status == "completed" else "SIGTERM received",
            }
        )
    )
    if not report:
        return path
    methods = {}
    for i, (m, loss) in enumerate(zip(("diloco", "dp"), losses)):
        if loss is None:
            methods[m] = {"status": "not run", "final_val_loss": None, "eval": {}, "bytes": {"status": "not run"}}
            continue
        methods[m] = {
            "status": "ok",
            "final_val_loss": loss,
            "wall_s": 100.0 + 10 * i,
            "tokens": 24576,
            "tokens_per_s": 245.76 - i,
            "goodput": None,
            "bytes": {"total": 1000 * (i + 1), "sent": 500},
            "eval": {} if accuracy is None else {"test/accuracy": accuracy[i]},
        }
    dl, dp = losses
    gap = (
        {"status": "ok", "gap_pct": 100 * (dl - dp) / dp, "baseline": "dp"}
        if dl is not None and dp is not None
        else {"status": "not run"}
    )
    rep = {
        "schema": 3,
        "stages": {"pretrain": {"unit": unit, "methods": methods, "loss_gaps": {"diloco": gap}}},
        "finetune": finetune,
    }
    (path / "report").mkdir()
    (path / "report" / "report.json").write_text(json.dumps(rep))
    return path


FINETUNE = {  # DiLoCo 0.27, DP 0.40 exact match after fine-tuning; DiLoCo − DP −0.13 [−0.17, −0.09]
    "task": {"name": "speakers"},
    "primary": "exact_match",
    "methods": {
        "diloco": {"scores": {"exact_match": {"finetuned": 0.27}}},
        "dp": {"scores": {"exact_match": {"finetuned": 0.40}}},
    },
    "differences": {
        "diloco": {
            "baseline": "dp",
            "metrics": {
                "exact_match": {
                    "finetuned": {
                        "status": "ok",
                        "difference": -0.13,
                        "ci": [-0.17, -0.09],
                        "verdict": {
                            "status": "better",
                            "better": "dp",
                            "text": "DP is better (the 95 % interval excludes 0)",
                        },
                    }
                }
            },
        }
    },
}


def sweep(tmp_path: Path) -> tuple[list[Path], dict]:
    """Learners {2, 3} × quorum {1, 2}; each run its own name (ignored as an axis). DiLoCo's loss
    4.0 + 0.1·M − 0.01·K, DP's 4.0."""
    runs, losses = [], {}
    for m in (2, 3):
        for k in (1, 2):
            name = f"M{m}K{k}"
            losses[name] = (4.0 + 0.1 * m - 0.01 * k, 4.0)
            runs.append(
                make_run(
                    tmp_path / name,
                    {"name": name, "diloco.learners": m, "diloco.fragments": 2, "diloco.quorum": k},
                    losses=losses[name],
                )
            )
    return runs, losses


def test_a_sweep_table_holds_what_the_runs_wrote(tmp_path):
    runs, losses = sweep(tmp_path)
    out = tmp_path / "cmp"
    c = build_comparison(runs, out, title="Learners × quorum")
    assert c["axes"] == ["diloco.learners", "diloco.quorum"]  # exactly the keys that differ (name is ignored)
    assert c["axes_detected"] and c["methods"] == ["diloco", "dp"] and c["plot_axis"] == "diloco.learners"
    assert [r["label"] for r in c["rows"]] == ["M2K1", "M2K2", "M3K1", "M3K2"]
    for row in c["rows"]:
        dl, dp = losses[row["label"]]
        assert (row["diloco.learners"], row["diloco.quorum"]) == (int(row["label"][1]), int(row["label"][3]))
        assert row["diloco/final_val_loss"] == dl and row["dp/final_val_loss"] == dp
        assert row["diloco/loss_gap_pct"] == pytest.approx(100 * (dl - dp) / dp)
        assert (row["diloco/wall_s"], row["dp/wall_s"]) == (100.0, 110.0)
        assert (row["diloco/tokens"], row["diloco/tokens_per_s"]) == (24576, 245.76)
        assert (row["diloco/bytes_total"], row["dp/bytes_total"]) == (1000, 2000)
        assert row["status"] == "completed" and row["unit"] == "tokens"
    keys = [col["key"] for col in c["columns"]]
    assert "diloco/goodput" not in keys and "diloco/test_accuracy" not in keys and "post/metric" not in keys
    # the files: the dict as JSON, the table as CSV, the plots, the markdown
    assert json.loads((out / "comparison.json").read_text()) == c
    with open(out / "comparison.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["label"] for r in table] == ["M2K1", "M2K2", "M3K1", "M3K2"] and list(table[0]) == keys
    assert float(table[0]["diloco/final_val_loss"]) == losses["M2K1"][0] and table[0]["diloco.learners"] == "2"
    assert c["plots"] == {"loss": "loss_vs_diloco.learners.png", "gap": "gap_vs_diloco.learners.png"}
    for name in c["plots"].values():
        assert (out / name).read_bytes()[:8] == PNG
    md = squash((out / "comparison.md").read_text())
    assert md.startswith("# Learners × quorum")
    assert "| M3K2 | 3 | 2 | completed | tokens | 4.2800 | 4.0000 | +7.00 |" in md
    assert "![loss](loss_vs_diloco.learners.png)" in md and str(runs[0]) in md
    assert "Not completed" not in md


def test_given_axes_labels_vision_and_post_training(tmp_path):
    text = make_run(tmp_path / "text", finetune=FINETUNE)
    vision = make_run(tmp_path / "vision", config="vit", losses=(0.36, 0.22), unit="images", accuracy=(0.975, 0.978))
    c = build_comparison(
        [text, vision], tmp_path / "cmp", axes=["model.kind", "train.token_budget"], labels=["lm", "vit"]
    )
    assert c["axes"] == ["model.kind", "train.token_budget"] and not c["axes_detected"]
    lm, vit = c["rows"]
    assert (lm["label"], lm["model.kind"], lm["unit"], vit["model.kind"], vit["unit"]) == (
        "lm",
        "dense_lm",
        "tokens",
        "vit",
        "images",
    )
    assert (vit["diloco/test_accuracy"], vit["dp/test_accuracy"], lm["diloco/test_accuracy"]) == (0.975, 0.978, None)
    assert (lm["post/task"], lm["post/metric"], lm["diloco/post_score"], lm["dp/post_score"]) == (
        "speakers",
        "exact_match",
        0.27,
        0.40,
    )
    assert (lm["diloco/post_diff"], lm["diloco/post_diff_ci_low"], lm["diloco/post_diff_ci_high"]) == (
        -0.13,
        -0.17,
        -0.09,
    )
    assert lm["diloco/post_verdict"] == "DP better" and vit["diloco/post_verdict"] is None
    headers = [col["header"] for col in c["columns"]]
    assert "DiLoCo validation loss (nats/token or image)" in headers and "DiLoCo tokens or images" in headers
    md = squash((tmp_path / "cmp" / "comparison.md").read_text())
    assert (
        "| lm | dense_lm | 24576 | speakers | exact_match | 0.2700 | 0.4000 | -0.1300 [-0.1700, -0.0900] | DP better |"
        in md
    )
    assert "| vit | vit | 100000 | — | — | — | — | — | — |" in md
    assert c["plot_axis"] is None and c["plots"]["loss"] == "loss_per_run.png"  # kind and budget change together


def test_identical_configs_and_an_unfinished_run_are_bars_and_notes(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", status="interrupted", losses=(4.5, None))
    old = make_run(tmp_path / "old", drop=("finetune",))  # a config written before the finetune section
    c = build_comparison([a, b, old], tmp_path / "cmp")
    assert c["axes"] == [] and c["plot_axis"] is None
    assert c["partial_keys"] == ["`finetune.*` (not in old)"]
    assert c["plots"] == {"loss": "loss_per_run.png", "gap": "gap_per_run.png"}
    assert (tmp_path / "cmp" / "loss_per_run.png").read_bytes()[:8] == PNG
    row = c["rows"][1]
    assert (row["status"], row["diloco/final_val_loss"], row["dp/final_val_loss"], row["diloco/loss_gap_pct"]) == (
        "interrupted",
        4.5,
        None,
        None,
    )
    assert c["notes"] == [
        "b: interrupted (SIGTERM received); completed stages: data",
        "b: DP has no final held-out loss (not run or not finished)",
    ]
    md = squash((tmp_path / "cmp" / "comparison.md").read_text())
    assert "## Not completed" in md and "- b: interrupted (SIGTERM received)" in md
    assert "| b | interrupted | tokens | 4.5000 | — | — |" in md


def test_function_refusals_name_the_path(tmp_path):
    good = make_run(tmp_path / "good")
    bad = make_run(tmp_path / "bad")
    (bad / "report" / "report.json").write_text("{not json")
    with pytest.raises(ReportInputError, match=r"bad/report/report.json: corrupt JSON"):
        build_comparison([good, bad], tmp_path / "cmp")
    (bad / "report" / "report.json").write_text(json.dumps({"schema": 2}))
    with pytest.raises(
        ReportInputError,
        match=r"report schema 2, a comparison reads schema 3; rebuild it with "
        r"`ddiloco report .*bad`",
    ):
        build_comparison([good, bad], tmp_path / "cmp")
    with pytest.raises(ReportInputError, match="is given twice"):
        build_comparison([good, str(good) + "/"], tmp_path / "cmp")
    with pytest.raises(ValueError, match="no run directories given"):
        build_comparison([], tmp_path / "cmp")
    with pytest.raises(ValueError, match="2 labels for 1 run directories"):
        build_comparison([good], tmp_path / "cmp", labels=["a", "b"])
    with pytest.raises(ReportInputError, match="inside the run directory"):
        build_comparison([good], good / "cmp")
    assert not (tmp_path / "cmp").exists() and not (good / "cmp").exists()


# -- the command -----------------------------------------------------------------------------------
def compare_cli(*args):
    result = CliRunner().invoke(app, ["compare", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_cli_writes_the_comparison(tmp_path, monkeypatch):
    runs, _ = sweep(tmp_path)
    code, out, err = compare_cli(*runs, "--out", tmp_path / "cmp", "--axis", "diloco.quorum", "--title", "Q")
    assert code == 0, err
    assert out.strip() == f"Comparison: {tmp_path / 'cmp' / 'comparison.md'}"
    c = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert (c["axes"], c["plot_axis"], c["title"]) == (["diloco.quorum"], "diloco.quorum", "Q")
    assert (tmp_path / "cmp" / "loss_vs_diloco.quorum.png").is_file()
    monkeypatch.chdir(tmp_path)  # the default --out: runs/compare-<UTC time> under the working directory
    code, out, err = compare_cli(*runs[:2])
    assert code == 0, err
    [made] = (tmp_path / "runs").glob("compare-*/comparison.md")
    assert out.strip() == f"Comparison: {made}"


@pytest.mark.parametrize(
    "case", ["not a run dir", "no report", "nonexistent", "no args", "unknown axis", "out not empty", "out is a file"]
)
def test_cli_refusals_are_one_line_and_write_nothing(tmp_path, case):
    good = make_run(tmp_path / "good")
    out = tmp_path / "out"
    args = [good, "--out", out]
    if case == "not a run dir":
        (tmp_path / "plain").mkdir()
        args, expect = [good, tmp_path / "plain", "--out", out], "is not a run directory (no config.json)"
    elif case == "no report":
        args = [good, make_run(tmp_path / "bare", report=False), "--out", out]
        expect = f"has no report/report.json; build it with `ddiloco report {tmp_path / 'bare'}`"
    elif case == "nonexistent":
        args, expect = [good, tmp_path / "missing", "--out", out], f"{tmp_path / 'missing'}: does not exist"
    elif case == "no args":
        args, expect = [], "no run directories given"
    elif case == "unknown axis":
        args, expect = (
            [*args, "--axis", "diloco.lerners"],
            "axis 'diloco.lerners' is not a key of the runs' config.json",
        )
    elif case == "out not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        expect = "exists and is not empty"
    else:
        out.write_text("a file")
        expect = "exists and is not a directory"
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    code, stdout, err = compare_cli(*args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
    assert stdout == ""
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before  # nothing written


# -- Prefect artifacts (Prefect's two functions stood in for: no server) -------------------------------
def test_comparison_artifacts(tmp_path, monkeypatch):
    from reports.artifacts import publish_comparison_artifacts

    c = build_comparison([make_run(tmp_path / "a"), make_run(tmp_path / "b", {"diloco.quorum": 1})], tmp_path / "cmp")
    made, in_run = [], {"now": False}
    arts = types.ModuleType("prefect.artifacts")
    arts.create_markdown_artifact = lambda markdown, key, description: made.append(("md", key, markdown))
    arts.create_table_artifact = lambda table, key, description: made.append(("table", key, table))
    ctx = types.ModuleType("prefect.context")
    ctx.FlowRunContext = type("F", (), {"get": staticmethod(lambda: object() if in_run["now"] else None)})
    ctx.TaskRunContext = type("T", (), {"get": staticmethod(lambda: None)})
    monkeypatch.setitem(sys.modules, "prefect.artifacts", arts)
    monkeypatch.setitem(sys.modules, "prefect.context", ctx)
    assert publish_comparison_artifacts(c, "Sweep 1") is False and made == []  # outside a run: skipped
    in_run["now"] = True
    assert publish_comparison_artifacts(c, "Sweep 1") is True
    (k1, key1, md), (k2, key2, table) = made
    assert (k1, key1, k2, key2) == ("md", "compare-sweep-1", "table", "compare-table-sweep-1")
    # its figures inlined (the UI draws them wherever it runs), none left as a relative link
    pngs = list((tmp_path / "cmp").glob("*.png"))
    assert pngs and md.count("](data:image/png;base64,") == len(pngs) and "png)" not in md
    assert [r["run"] for r in table] == ["a", "b"] and table[0]["DiLoCo validation loss (nats/token)"] == "4.3000"


def test_the_runs_table_holds_each_runs_figures_once(tmp_path):
    from reports.table import runs_table, shown, wide

    reports = {
        name: json.loads((make_run(tmp_path / name, finetune=ft, losses=losses) / "report" / "report.json").read_text())
        for name, ft, losses in (("a", FINETUNE, (4.3, 4.1)), ("b", None, (4.2, None)))
    }
    t = runs_table(reports)
    assert list(zip(t.run, t.stage, t.method)) == [(r, "pretrain", m) for r in "ab" for m in ("diloco", "dp")]
    a = t[t.run == "a"].set_index("method")
    assert a.loc["diloco", "val_loss"] == 4.3 and a.loc["dp", "loss"] == 4.1  # no whole split, no test split
    assert (
        a.loc["diloco", "loss_gap_pct"] == pytest.approx(100 * (4.3 - 4.1) / 4.1)
        and a.loc["dp", "loss_gap_pct"] is None
    )
    assert (a.loc["dp", "tokens"], a.loc["dp", "wall_s"], a.loc["dp", "bytes_total"]) == (24576, 110.0, 2000)
    assert (a.loc["dp", "post_score"], a.loc["diloco", "post_diff"]) == (0.40, -0.13)
    assert (a.loc["diloco", "post_diff_ci_low"], a.loc["diloco", "post_verdict"]) == (-0.17, "DP better")
    w = wide(t, ["val_loss", "post_score"], ["diloco", "dp"], ["b", "a"])
    assert w.to_dict("index") == {
        "b": {"diloco/val_loss": 4.2, "dp/val_loss": None, "diloco/post_score": None, "dp/post_score": None},
        "a": {"diloco/val_loss": 4.3, "dp/val_loss": 4.1, "diloco/post_score": 0.27, "dp/post_score": 0.40},
    }
    f = shown("tokens_per_s", "diloco", "image", "images")
    assert (f.header, f.unit, f.fmt) == ("DiLoCo images/s", "images/s", "{:,.0f}")
