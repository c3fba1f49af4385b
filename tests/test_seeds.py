"""Seeds: a run of several seeds (``seeds: [...]``), its report over seeds, and the verdict's statistics."""

import json
import math
import os

import numpy as np
import pytest

from run.layout import RunLayout


def test_seeds_config_is_checked_and_expanded():
    from pydantic import ValidationError

    from configs.schema import ExperimentConfig

    cfg = ExperimentConfig(seeds=[3, 1])
    assert cfg.run_seeds == [3, 1] and ExperimentConfig(seed=7).run_seeds == [7]
    one = cfg.for_seed(1)
    assert one.seed == 1 and one.seeds is None and one.run_seeds == [1]
    with pytest.raises(ValidationError, match="repeats a seed"):
        ExperimentConfig(seeds=[2, 2])
    with pytest.raises(ValidationError, match="seeds"):
        ExperimentConfig(seeds=[])


def test_mean_interval_is_students_t():
    from reports.verdict import mean_interval

    m = mean_interval([1.0, 2.0, 3.0])
    # t_{0.975, 2} = 4.3027; sd = 1; h = 4.3027 / sqrt(3)
    assert m["mean"] == pytest.approx(2.0) and m["n"] == 3
    assert m["ci"] == pytest.approx([2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)], rel=1e-5)
    assert mean_interval([5.0]) == {"mean": 5.0, "ci": None, "n": 1, "sd": None}
    assert mean_interval([None, float("nan")])["mean"] is None


def test_published_gap_from_the_fits():
    from reports.verdict import published_gap_pct

    # the issue's reading of arXiv 2503.09799's fits: M = 4 about +3.3 % at our ~1.1M parameters
    assert published_gap_pct(4, 1.127e6) == pytest.approx(3.24, abs=0.01)
    assert published_gap_pct(1, 35e6) == pytest.approx(-0.09, abs=0.2)  # the study's 35M: M = 1 about −0.1 %
    assert published_gap_pct(8, 35e6) == pytest.approx(3.9, abs=0.6)
    assert published_gap_pct(3, 1e6) is None and published_gap_pct(4, None) is None


def test_bootstrap_over_pretraining_seeds_keeps_pairing_and_two_level_numbers():
    from reports.finetune import paired_bootstrap_difference, two_level_bootstrap

    rng = np.random.default_rng(1)
    a = rng.random((3, 2, 40))
    d = paired_bootstrap_difference(a, a + 0.1)  # the same models shifted: a paired difference of exactly −0.1
    assert d["difference"] == pytest.approx(-0.1) and d["ci"] == pytest.approx([-0.1, -0.1])
    assert d["pretrain_seeds"] == 3 and d["seeds"] == 2 and "3 pretraining seeds" in d["over"]
    # a [1, S, N] array resamples like its [S, N] slice (a pretraining level of one is not resampled)
    assert two_level_bootstrap(a[:1])["ci"] == two_level_bootstrap(a[0])["ci"]
    wide = two_level_bootstrap(a + np.array([0.0, 0.5, 1.0])[:, None, None])  # pretraining seeds that differ
    assert wide["ci"][1] - wide["ci"][0] > two_level_bootstrap(a)["ci"][1] - two_level_bootstrap(a)["ci"][0]


@pytest.fixture(scope="module")
def two_seed_run(prefect_harness, small_cfg, small_data, tmp_path_factory):
    """A pipeline run of seeds [0, 1] on the small corpus (both methods, lm-eval, post-training)."""
    from configs.schema import ExperimentConfig
    from flows.pipeline import pipeline

    cfg = ExperimentConfig.model_validate({**small_cfg.model_dump(), "seeds": [0, 1]})
    run_dir = tmp_path_factory.mktemp("seeds") / "run"
    assert pipeline(config=cfg, run_dir=str(run_dir)) == str(run_dir)
    return cfg, run_dir


@pytest.mark.slow
def test_run_of_two_seeds_trains_each_seed_on_shared_data(two_seed_run):
    cfg, run_dir = two_seed_run
    layout = RunLayout(run_dir)
    status = json.loads(layout.status.read_text())
    assert status["status"] == "completed"
    assert status["completed_stages"] == ["data", "seed-0", "seed-1", "report"]
    losses = {}
    for s in (0, 1):
        sub = RunLayout(layout.seed_run(s))
        assert json.loads(sub.config.read_text())["seed"] == s
        assert json.loads(sub.status.read_text())["status"] == "completed"
        assert os.path.samefile(sub.manifest, layout.manifest)  # sharded once: hard links
        losses[s] = {
            m: json.loads(sub.summary("pretrain", m).read_text())["heldout"]["test"]["loss"] for m in ("diloco", "dp")
        }
        assert sub.report_md.is_file() and (sub.root / "finetune" / "data" / "manifest.json").is_file()
    assert losses[0]["dp"] != losses[1]["dp"]  # another initialisation and data order: another DP
    tests = [
        json.loads((RunLayout(layout.seed_run(s)).finetune_data / "manifest.json").read_text())["test_items"]
        for s in (0, 1)
    ]
    assert tests[0] == tests[1]  # every seed is fine-tuned and scored on the same test items


@pytest.mark.slow
def test_report_over_seeds_leads_with_the_paired_verdict(two_seed_run):
    from reports.verdict import mean_interval

    cfg, run_dir = two_seed_run
    layout = RunLayout(run_dir)
    report = json.loads((layout.report / "report.json").read_text())
    v = report["verdict"]
    assert v["seeds"] == [0, 1] and v["n"] == 2
    per = {r["seed"]: r for r in report["seed_runs"]}
    gaps = [100 * (per[s]["loss"]["diloco"] - per[s]["loss"]["dp"]) / per[s]["loss"]["dp"] for s in (0, 1)]
    want = mean_interval(gaps)  # the paired per-seed gaps
    assert v["gap_pct"]["mean"] == pytest.approx(want["mean"]) and v["gap_pct"]["ci"] == pytest.approx(want["ci"])
    assert v["gap_pct"]["ci"][0] < v["gap_pct"]["mean"] < v["gap_pct"]["ci"][1]
    assert per[0]["gap_pct"] == pytest.approx(gaps[0])
    post = v["post"]
    assert post["pretrain_seeds"] == 2 and post["ci"] is not None and post["metric"] == "exact_match"
    pre = report["stages"]["pretrain"]
    assert pre["methods"]["dp"]["test_loss"] == pytest.approx(np.mean([per[s]["loss"]["dp"] for s in (0, 1)]))
    md = layout.report_md.read_text()
    assert md.index("## Verdict") < md.index("## Each seed") < md.index("## Setup")
    assert "Over 2 seeds" in md and "(paired)" in md and "seeds/seed-1/report/report.md" in md


@pytest.mark.slow
def test_sweep_comparison_reads_a_run_of_seeds(two_seed_run, tmp_path):
    from reports.compare import build_comparison

    _, run_dir = two_seed_run
    comp = build_comparison([run_dir], tmp_path / "cmp")
    row = comp["rows"][0]
    report = json.loads((RunLayout(run_dir).report / "report.json").read_text())
    assert row["dp/test_loss"] == pytest.approx(report["stages"]["pretrain"]["methods"]["dp"]["test_loss"])
    gap = report["verdict"]["gap_pct"]
    assert row["diloco/loss_gap_pct"] == pytest.approx(gap["mean"]) and row["diloco/seeds"] == 2
    assert [row["diloco/loss_gap_pct_ci_low"], row["diloco/loss_gap_pct_ci_high"]] == pytest.approx(gap["ci"])
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"{gap['mean']:+.2f} [{gap['ci'][0]:+.2f}, {gap['ci'][1]:+.2f}]" in md  # the gap beside its interval
