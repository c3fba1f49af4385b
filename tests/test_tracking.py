"""Experiment tracking (run/tracking.py, training/tracking.py): metric records → TensorBoard event
files (read back with TensorBoard's own event reader) and W&B offline runs; the config section and
its refusal. The whole pipeline's events are checked in tests/test_flows.py."""

import json
from pathlib import Path

import pytest

from run.metrics import JsonlWriter, read_jsonl
from run.tracking import METHOD_KEY, Tracker, scalars, write_hparams


def _events(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of one TensorBoard run folder, as TensorBoard reads it: tag → [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


MERGE = {
    "fragment": 1,
    "version": 4,
    "contributors": [0, 2, 3],
    "weights": [0.3, 0.3, 0.4],
    "tokens": [1024, 1024, 2048],
    "stale": [0, 1, 2],
    "quorum_at_s": 10.0,
    "merged_at_s": 12.5,
    "grace_s": 3.0,
    "bytes_in": 3000,
    "fragment_bytes": 1000,
    "bytes_out": 4000,
    "outer_grad_norm": 0.25,
    "merge": 7,
}


def test_records_become_scalars_on_the_tokens_axis_with_merges_on_their_ordinal():
    key, step, v = scalars("train", {"step": 3, "tokens": 1536, "train/loss": 4.5, "train/lr": 1e-3, "t": 2.0})
    assert (key, step, v) == (METHOD_KEY, 1536, {"train/loss": 4.5, "train/lr": 1e-3})
    key, step, v = scalars("eval", {"method": "diloco", "tokens": 4096, "merges": 12, "val/loss": 4.1, "wall_s": 9})
    assert (key, step, v) == (METHOD_KEY, 4096, {"val/loss": 4.1, "syncer/merges": 12.0})
    key, step, v = scalars("learners", {"event": "step", "learner": 2, "step": 10, "tokens": 640, "train/loss": 5.0})
    assert (key, step, v) == ("learner-2", 640, {"train/loss": 5.0})
    key, step, v = scalars("merges", MERGE)
    assert (key, step) == (METHOD_KEY, 7)
    assert v["merge/quorum"] == 3 and v["merge/tokens"] == 4096
    assert v["merge/wait_s"] == 2.5 and v["merge/grace_s"] == 3.0
    assert v["merge/staleness_max"] == 2 and v["merge/staleness_mean"] == 1.0
    assert v["merge/bytes_in"] == 3000 and v["merge/bytes_out"] == 4000 and v["merge/outer_grad_norm"] == 0.25
    # fine-tuning: one writer per seed, on optimizer steps (no tokens)
    finetune = {"seed": 1, "step": 20, "examples": 160, "val/loss": 2.0}
    assert scalars("eval", finetune) == ("seed-1", 20, {"val/loss": 2.0})
    # nothing to plot: other learner events, a refused merge, NaN, strings
    assert scalars("learners", {"event": "failure", "learner": 1, "step": 4, "t": 3.0}) is None
    assert scalars("merges", {"event": "merge-refused", "fragment": 0, "tokens": [1]}) is None
    assert scalars("train", {"step": 1, "tokens": 10, "train/loss": float("nan"), "note/x": "a"}) is None


def test_the_jsonl_writer_feeds_tensorboard_the_same_numbers(tmp_path):
    tb = tmp_path / "tensorboard"
    tracker = Tracker(tb, flops_per_token=6e6, peak_flops=1e12)
    log = JsonlWriter(tmp_path / "train.jsonl", sink=tracker.sink("train"))
    learners = JsonlWriter(tmp_path / "learners.jsonl", sink=tracker.sink("learners"))
    merges = JsonlWriter(tmp_path / "merges.jsonl", sink=tracker.sink("merges"))
    for i in range(1, 5):  # 512 tokens per second
        log({"step": i, "tokens": 512 * i, "train/loss": 5.0 - 0.5 * i, "train/grad_norm": 1.0 / i, "t": float(i)})
        learners({"event": "step", "learner": 1, "step": i, "tokens": 100 * i, "train/loss": 6.0 - i, "t": 2.0 * i})
    learners({"event": "rejoin", "learner": 1, "attempt": 2, "t": 9.0})
    merges(MERGE)
    for w in (log, learners, merges):
        w.close()
    tracker.close()
    method, learner = _events(tb), _events(tb / "learner-1")
    assert method["train/loss"] == [(512 * i, 5.0 - 0.5 * i) for i in range(1, 5)]
    assert [s for s, _ in method["train/grad_norm"]] == [512, 1024, 1536, 2048]
    # tokens/s between records, and MFU = tokens/s × FLOPs per token ÷ peak FLOP/s
    assert method["throughput/tokens_per_s"] == [(1024, 512.0), (1536, 512.0), (2048, 512.0)]
    assert method["throughput/mfu"][0][1] == pytest.approx(512 * 6e6 / 1e12)
    assert method["merge/quorum"] == [(7, 3.0)]
    assert learner["train/loss"] == [(100 * i, 6.0 - i) for i in range(1, 5)]
    assert learner["throughput/tokens_per_s"][0] == (200, 50.0)
    # the JSONL files hold the records as written, sink or not
    assert [r["train/loss"] for r in read_jsonl(tmp_path / "train.jsonl")] == [4.5, 4.0, 3.5, 3.0]


def test_a_failing_backend_is_switched_off_and_the_metrics_file_still_written(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the event folder should be")
    tracker = Tracker(blocker / "tensorboard")
    log = JsonlWriter(tmp_path / "train.jsonl", sink=tracker.sink("train"))
    for i in range(3):
        log({"step": i, "tokens": i + 1, "train/loss": 1.0})
    log.close()
    tracker.close()
    assert len(read_jsonl(tmp_path / "train.jsonl")) == 3
    warnings = [r.getMessage() for r in caplog.records if "tracking: tensorboard switched off" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


def test_hparams_are_written_for_the_hparams_tab(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    write_hparams(tmp_path, {"diloco.sync_every": 8, "name": "tiny", "model.d_model": 32}, {"final/gap_pct": 1.5})
    (events,) = tmp_path.glob("events.out.tfevents*")
    hparams, scalars_seen = {}, {}
    for event in EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "hparams":
                data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    hparams = {k: v for k, v in data.session_start_info.hparams.items()}
            elif value.metadata.plugin_data.plugin_name == "scalars":  # the loader reads scalars as tensors
                scalars_seen[value.tag] = float(tensor_util.make_ndarray(value.tensor))
    assert hparams["diloco.sync_every"].number_value == 8 and hparams["name"].string_value == "tiny"
    assert scalars_seen == {"final/gap_pct": 1.5}


def test_wandb_offline_runs_hold_the_logged_metrics(tmp_path):
    wandb = pytest.importorskip("wandb", reason="wandb is a dev dependency: `make setup` installs it")
    tracker = Tracker(
        None,
        {"project": "test", "group": "run-1", "name": "run-1/pretrain-dp", "dir": str(tmp_path), "mode": "offline"},
    )
    for i in range(1, 4):
        tracker.write("train", {"step": i, "tokens": 64 * i, "train/loss": 3.0 / i, "t": float(i)})
    tracker.write("learners", {"event": "step", "learner": 0, "step": 1, "tokens": 32, "train/loss": 9.5, "t": 1.0})
    tracker.close()
    wandb.teardown()  # what the process's exit does: W&B's service writes out what it still holds
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # the method and learner 0, grouped by the run
    for run in runs:
        (data,) = run.glob("run-*.wandb")
        blob = data.read_bytes()
        assert b"train/loss" in blob and b"tokens" in blob and b"run-1" in blob


def test_the_tracking_section_is_validated_and_wandb_refused_when_missing(monkeypatch):
    from pydantic import ValidationError

    from configs.load import CONFIG_DIR, load_config
    from flows.preflight import check_installed

    with pytest.raises(ValidationError, match="wandb_mode"):
        load_config(CONFIG_DIR / "tiny.yaml", overrides={"tracking.wandb_mode": "sometimes"})
    cfg = load_config(CONFIG_DIR / "tiny.yaml", overrides={"tracking.wandb": True})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"tracking\.wandb.*uv sync --extra wandb"):
        check_installed(cfg)
    check_installed(load_config(CONFIG_DIR / "tiny.yaml"))  # off: nothing to check


def test_report_figures_are_the_verdicts():
    from training.tracking import flat_settings, report_figures

    report = json.loads(
        json.dumps(
            {
                "verdict": {
                    "loss": {"diloco": {"mean": 4.2}, "dp": {"mean": 4.1}},
                    "gap_pct": {"mean": 2.4},
                    "bytes_per_token": {"diloco": 400.0, "dp": 2000.0},
                    "goodput": 0.99,
                    "uptime": None,
                    "post": {"scores": {"diloco": 0.5, "dp": 0.25}},
                }
            }
        )
    )
    assert report_figures(report) == {
        "final/test_loss/diloco": 4.2,
        "final/test_loss/dp": 4.1,
        "final/gap_pct": 2.4,
        "final/bytes_per_token/diloco": 400.0,
        "final/bytes_per_token/dp": 2000.0,
        "final/goodput": 0.99,
        "final/post/diloco": 0.5,
        "final/post/dp": 0.25,
    }
    from configs.load import CONFIG_DIR, load_config

    flat = flat_settings(load_config(CONFIG_DIR / "tiny.yaml").model_dump(mode="json"))
    assert flat["diloco.sync_every"] == 4 and flat["tracking.tensorboard"] is True and "seeds" not in flat
