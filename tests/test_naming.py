"""Flow-run and task-run names (flows/naming.py, tasks/finetune.py): what the Prefect UI lists. The
browser test (tests/test_ui_browser.py) sees them on a real run: the pipeline named as its run
directory, pretrain-diloco-<run>, learner-<m>, syncer, report."""

import re

import pytest

from configs.load import CONFIG_DIR, load_config
from flows import naming
from tasks.finetune import finetune_task_name


@pytest.fixture
def params(monkeypatch):
    given = {}
    monkeypatch.setattr(naming, "_params", lambda: given)
    return given


STAMP = r"\d{8}-\d{6}"


def test_flow_runs_are_named_after_what_they_run(params):
    tiny = load_config(CONFIG_DIR / "tiny.yaml")
    params.update(config=tiny)
    assert re.fullmatch(rf"tiny-{STAMP}", naming.pipeline_run_name())
    params.update(config_file="configs/moe.yaml")
    assert naming.pipeline_run_name().startswith("moe-")
    params.update(overrides={"name": "m8"})
    assert naming.pipeline_run_name().startswith("m8-")
    params.clear()
    params.update(config=tiny.model_dump(mode="json"), run_dir="runs/tiny-20261203-120000")
    assert naming.pretrain_run_name("dp")() == "pretrain-dp-tiny-20261203-120000"
    assert naming.finetune_run_name() == "finetune-tiny-20261203-120000"
    assert naming.pipeline_run_name() == "tiny-20261203-120000"  # (ddiloco run gives its directory)
    params.clear()
    params.update(spec={"name": "size-ladder"})
    assert naming.sweep_run_name() == "sweep-size-ladder" and naming.tune_run_name() == "tune-size-ladder"
    params.update(sweep_file="nightly", study_file="configs/studies/m_ladder.yaml")
    assert naming.sweep_run_name() == "sweep-nightly" and naming.tune_run_name() == "tune-m_ladder"
    params.clear()  # nothing to go by: the flow's kind and the time, never an error
    assert re.fullmatch(rf"pipeline-{STAMP}", naming.pipeline_run_name())


def test_finetune_task_runs_name_the_method_and_seeds():
    cfg = load_config(CONFIG_DIR / "tiny.yaml")
    assert finetune_task_name({"cfg": cfg, "method": "dp"}) == f"finetune-dp-seed{cfg.finetune.seeds[0]}"
    three = load_config(CONFIG_DIR / "tiny.yaml", overrides={"finetune.seeds": [0, 1, 2]})
    assert finetune_task_name({"cfg": three, "method": "diloco"}) == "finetune-diloco-seeds0-1-2"
