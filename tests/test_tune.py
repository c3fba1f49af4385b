"""Tuning studies: the spec's refusals, and a 2-trial study per method on the small corpus that resumes."""

import json

import pytest
from pydantic import ValidationError

from tests.conftest import SMALL_DATA

SPACE = {
    "dp": {"dp.inner.lr": {"low": 0.003, "high": 0.03, "log": True}},
    "diloco": {"diloco.outer_lr": {"low": 0.4, "high": 1.0}},
}


def test_a_study_spec_refuses_unequal_or_unsafe_searches():
    from configs.tune import TuneSpec

    with pytest.raises(ValidationError, match="space.diloco: no search space"):
        TuneSpec(space={"dp": SPACE["dp"]})
    with pytest.raises(ValidationError, match="sets seed itself"):
        TuneSpec(space=SPACE, overrides={"seed": 3})
    with pytest.raises(ValidationError, match="sets dp.enabled itself"):
        TuneSpec(space={**SPACE, "dp": {"dp.enabled": {"choices": [True, False]}}})
    with pytest.raises(ValidationError, match="high .* must be above low"):
        TuneSpec(space={**SPACE, "dp": {"dp.inner.lr": {"low": 0.1, "high": 0.01}}})
    with pytest.raises(ValidationError, match="log range needs low > 0"):
        TuneSpec(space={**SPACE, "dp": {"dp.inner.lr": {"low": 0.0, "high": 0.01, "log": True}}})
    with pytest.raises(ValidationError, match="single values"):
        TuneSpec(space={**SPACE, "dp": {"dp.inner": {"choices": [{"lr": 0.1}]}}})
    spec = TuneSpec(space={**SPACE, "diloco": {"diloco.sync_every": {"low": 2, "high": 8, "step": 2}}})
    assert spec.space["diloco"]["diloco.sync_every"].is_int


def test_variants_get_a_diloco_study_each_and_one_dp(tmp_path):
    from configs.tune import TuneSpec
    from flows.preflight import tune_preflight

    spec = TuneSpec(space=SPACE, variants=[{"diloco.learners": 2, "diloco.quorum": 1}, {"diloco.learners": 3}])
    assert [a[0] for a in spec.arms()] == ["dp", "diloco-learners-2_quorum-1", "diloco-learners-3"]
    raw = spec.trial_config("diloco", {"diloco.outer_lr": 0.5}, variant={"diloco.learners": 2})
    assert raw["diloco"]["learners"] == 2 and raw["diloco"]["outer_lr"] == 0.5 and raw["dp"]["enabled"] is False
    final = spec.final_config({"dp.inner.lr": 0.01}, {"diloco.outer_lr": 0.5}, variant={"diloco.learners": 2})
    assert final["seeds"] == [0, 1, 2] and final["dp"]["inner"]["lr"] == 0.01 and final["diloco"]["learners"] == 2
    with pytest.raises(ValidationError, match="changes DiLoCo only"):
        TuneSpec(space=SPACE, variants=[{"dp.batch_size": 8}])
    bad = TuneSpec(
        base="tiny",
        overrides=SMALL_DATA,
        study_root=str(tmp_path),
        space=SPACE,
        variants=[{"diloco.learners": 2, "diloco.quorum": 3}],
    )
    with pytest.raises(ValueError, match="diloco-learners-2_quorum-3"):
        tune_preflight(bad)


def test_preflight_names_the_searched_value_that_cannot_run(tmp_path):
    from configs.tune import TuneSpec
    from flows.preflight import tune_preflight

    spec = TuneSpec(
        base="tiny",
        overrides=SMALL_DATA,
        study_root=str(tmp_path),
        space={**SPACE, "diloco": {"diloco.quorum": {"choices": [1, 9]}}},
    )
    with pytest.raises(ValueError, match=r"space\.diloco\.diloco\.quorum = 9: .*quorum"):
        tune_preflight(spec)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.fixture(scope="module")
def study(prefect_harness, tmp_path_factory):
    """A study of 2 trials per method on the small corpus, then the tuned comparison over seeds 0, 1."""
    from configs.tune import TuneSpec
    from flows.tune import tune

    spec = TuneSpec(
        name="t",
        base="tiny",
        overrides={**SMALL_DATA, "finetune.enabled": False},
        trial_overrides={"eval.enabled": False},
        trials=2,
        seeds=[0, 1],
        space=SPACE,
        study_root=str(tmp_path_factory.mktemp("studies")),
    )
    out = tune(spec=spec)
    return spec, out


@pytest.mark.slow
def test_a_study_tunes_each_method_alone_and_compares_the_best_over_seeds(study):
    from configs.tune import METHODS

    spec, out = study
    study_dir = spec.study_dir()
    assert out == str(study_dir)
    record = json.loads((study_dir / "tune.json").read_text())
    for m in METHODS:
        r = record["methods"][m]
        assert r["completed"] == 2
        done = [t for t in r["trials"] if t["state"] == "COMPLETE"]
        assert r["best"]["value"] == min(t["value"] for t in done)
        base = {"dp": {"dp.inner.lr": 0.003}, "diloco": {"diloco.outer_lr": 0.8}}[m]  # tiny's own settings
        assert r["trials"][0]["params"] == pytest.approx(base)  # tried first: tuning never ends worse
        for t in done:
            rd = study_dir / "trials" / f"{m}-{t['number']}"
            cfg = json.loads((rd / "config.json").read_text())
            other = "diloco" if m == "dp" else "dp"
            assert not (rd / "pretrain" / other).exists()  # a trial trains its method alone
            summary = json.loads((rd / "pretrain" / m / "summary.json").read_text())
            assert t["value"] == pytest.approx(summary["heldout"]["val"]["loss"])  # selection reads validation
            key, value = next(iter(t["params"].items()))
            section, *rest = key.split(".")
            node = cfg[section]
            for k in rest:
                node = node[k] if isinstance(node, dict) else node
            assert node == pytest.approx(value)
    tuned = study_dir / "tuned" / "diloco"
    cfg = json.loads((tuned / "config.json").read_text())
    assert cfg["seeds"] == [0, 1]
    assert cfg["dp"]["inner"]["lr"] == pytest.approx(record["methods"]["dp"]["best"]["params"]["dp.inner.lr"])
    assert cfg["diloco"]["outer_lr"] == pytest.approx(record["methods"]["diloco"]["best"]["params"]["diloco.outer_lr"])
    report = json.loads((tuned / "report" / "report.json").read_text())
    assert report["verdict"]["n"] == 2
    md = (study_dir / "report" / "study.md").read_text()
    assert "## Verdict" in md and "## Best settings" in md and "## DP trials" in md
    assert (study_dir / "report" / "study_history.png").stat().st_size > 0


@pytest.mark.slow
def test_running_a_study_again_resumes_it(study):
    from flows.tune import tune

    spec, _ = study
    before = json.loads((spec.study_dir() / "tune.json").read_text())
    more = spec.model_copy(update={"trials": 3, "compare": False})
    tune(spec=more)
    after = json.loads((spec.study_dir() / "tune.json").read_text())
    for m in ("dp", "diloco"):
        assert after["methods"][m]["completed"] == 3  # one more trial each, the first two kept
        assert after["methods"][m]["trials"][:2] == before["methods"][m]["trials"][:2]
        params = [json.dumps(t["params"], sort_keys=True) for t in after["methods"][m]["trials"]]
        assert len(set(params)) == 3  # the resumed sampler does not repeat the first draws
    other = spec.model_copy(update={"seeds": [5]})
    with pytest.raises(ValueError, match="another spec"):
        tune(spec=other)


def test_the_base_settings_are_enqueued_once_however_often_a_study_resumes():
    """A study stopped before its base trial ran, and resumed twice, holds one waiting base trial (on
    the old code each resume enqueued it again: the m_ladder study ran its M = 8 base settings three
    times); once that trial completed it is not enqueued again."""
    import optuna

    from flows.tune import _enqueue_once

    study = optuna.create_study()
    base = {"diloco.inner.lr": 0.0047, "diloco.sync_every": 8}
    assert [_enqueue_once(study, base) for _ in range(3)] == [True, False, False]
    assert len(study.trials) == 1
    trial = study.ask()
    assert trial.params == {} and trial.system_attrs["fixed_params"] == base
    study.tell(trial, 1.0)
    assert not _enqueue_once(study, base) and len(study.trials) == 1
    assert _enqueue_once(study, {**base, "diloco.sync_every": 4})


def test_the_cli_names_an_experiment_config_given_as_a_study(tmp_path):
    from tests.test_refusals import cli, one_line_refusal

    for given in ("configs/tiny.yaml", "tiny"):
        line = one_line_refusal(*cli("tune", given))
        assert "is an experiment config, not a study file" in line and f"ddiloco run {given}" in line
    line = one_line_refusal(*cli("run", "tiny", "--set", "seeds=[]"))
    assert "seeds is empty" in line and "[0, 1, 2]" in line
    line = one_line_refusal(*cli("run", "tiny", "--set", "seeds=3"))
    assert "seeds: Input should be a valid list (got 3; write a YAML list, e.g. [3] or [0, 1, 2])" in line
    line = one_line_refusal(*cli("tune", "tune_tiny", "--trials", "0", "--study-root", tmp_path))
    assert "invalid study tune_tiny: trials: Input should be greater than 0 (trials per method" in line
    assert line.endswith(") (from --trials 0)")
    assert not any(tmp_path.iterdir())
