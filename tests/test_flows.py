"""End-to-end flow tests on the tiny config (real Prefect flows and tasks, real data: the committed
small corpus, ``tests/data/shakespeare_small.jsonl``).

``test_pipeline_end_to_end`` is the fast tier's one whole pipeline (data → both methods → lm-eval →
post-training → report); the fault tests are ``slow``.
"""

import json
import shutil
import statistics

import numpy as np
import pytest

from diloco.exchange.fsspec import FsspecExchange
from reports.artifacts import artifact_key, run_slug
from run.layout import RunLayout
from run.metrics import read_jsonl


def _copy(data_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(data_dir, dst)
    return dst


def test_pipeline_end_to_end(prefect_harness, small_cfg, small_data, tmp_path):
    from flows.pipeline import pipeline

    run_dir = _copy(small_data, tmp_path)
    layout = RunLayout(run_dir)
    out = pipeline(config=small_cfg, run_dir=str(run_dir))
    assert out == str(run_dir)
    report = layout.report_md.read_text()
    assert "Decoupled DiLoCo" in report and "Data-parallel" in report
    page = layout.report_html.read_text()  # the same report, one file: every figure inlined
    pngs = list(layout.report.glob("*.png"))
    assert pngs and page.count('src="data:image/png;base64,') == len(pngs) and "<table>" in page
    # the header says what both methods trained on and in
    assert "\n- backend: cpu: 1 × cpu (jax " in report
    assert "\n- precision: params float32 · compute float32 · optimizer state float32\n" in report
    # written by the run's last stage, the saved report says the run completed (a fresh user read
    # "completing" in every finished run's report)
    assert "\n- pipeline status: completed (this report is the run's last stage) (completed stages: " in report
    assert ", finetune, report)\n" in report
    assert layout.methods("pretrain") == ["diloco", "dp"]
    for method in ("diloco", "dp"):
        summary = json.loads(layout.summary("pretrain", method).read_text())
        assert summary["tokens"] == small_cfg.dp_steps * small_cfg.tokens_per_dp_step
        curve = read_jsonl(layout.metrics("pretrain", method, "eval"))
        assert curve[-1]["val/loss"] < curve[0]["val/loss"] - 0.2  # it trained
        assert curve[-1]["val/loss"] <= min(c["val/loss"] for c in curve) + 0.05  # and did not blow up late
        metrics = json.loads(layout.eval_result("pretrain", method).read_text())
        assert 0.0 <= metrics["heldout_nextline/acc"] <= 1.0
        assert metrics["heldout_ppl/byte_perplexity"] > 1.0
        assert layout.checkpoints("pretrain", method).is_dir()
    _check_tracking(small_cfg, layout)
    _check_finetune(small_cfg, layout)
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    assert len(merges) >= 3
    assert all(abs(sum(m["weights"]) - 1) < 1e-4 for m in merges)
    ledger = json.loads(layout.summary("pretrain", "diloco").read_text())["ledger"]
    assert sum(v["processed"] for v in ledger.values()) == small_cfg.dp_steps * small_cfg.tokens_per_dp_step
    P = small_cfg.diloco.fragments
    for v in ledger.values():  # every token accounted for (±P from averaging over fragments)
        assert v["processed"] == v["submitted"] + v["not_submitted"]
        assert abs(v["submitted"] - (v["merged"] + v["recomputed"] + v["dropped"] + v["pending"])) <= P
        assert v["submitted"] <= v["processed"]


def _check_tracking(cfg, layout):
    """TensorBoard, as its own event reader sees the run: the curves of every method and learner are
    the JSONL files' numbers (one fan-out), the merges' scalars one point per merge, and the run's
    settings with the report's figures in RUN/tensorboard (the HParams tab)."""
    from tests.test_tracking import _events
    from training.optimizers import lr_schedule

    for method in ("diloco", "dp"):
        events = _events(layout.tensorboard("pretrain", method))
        curve = read_jsonl(layout.metrics("pretrain", method, "eval"))
        assert events["val/loss"] == [(r["tokens"], pytest.approx(r["val/loss"], rel=1e-6)) for r in curve]
    dp = _events(layout.tensorboard("pretrain", "dp"))
    train = read_jsonl(layout.metrics("pretrain", "dp", "train"))
    assert [s for s, _ in dp["train/loss"]] == [r["tokens"] for r in train]
    assert {"train/grad_norm", "train/lr", "throughput/tokens_per_s"} <= set(dp)
    assert all(v > 0 for _, v in dp["train/grad_norm"])
    lr = lr_schedule(cfg.dp.inner, cfg.dp_steps)  # each logged rate is the schedule's at that step's update
    assert [v for _, v in dp["train/lr"]] == [pytest.approx(float(lr(r["step"] - 1)), rel=1e-6) for r in train]
    diloco = _events(layout.tensorboard("pretrain", "diloco"))
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    assert [s for s, _ in diloco["merge/quorum"]] == list(range(1, len(merges) + 1)) == [m["merge"] for m in merges]
    # learners per merge: the minimum quorum K or more, fewer only in the flush after the learners ended
    assert [v for _, v in diloco["merge/quorum"]] == [len(m["contributors"]) for m in merges]
    assert max(v for _, v in diloco["merge/quorum"]) <= cfg.diloco.learners
    assert {"merge/staleness_max", "merge/grace_s", "merge/bytes_in"} <= set(diloco)
    progress = _events(layout.tensorboard("pretrain", "diloco") / "progress")
    assert progress["learners/alive"][-1][1] == 0.0  # the final view: every learner done
    assert 0 < progress["resilience/goodput"][-1][1] <= 1
    steps = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    for m in range(cfg.diloco.learners):
        mine = [r for r in steps if r.get("event") == "step" and r["learner"] == m]
        learner = _events(layout.tensorboard("pretrain", "diloco") / f"learner-{m}")
        assert learner["train/loss"] == [(r["tokens"], pytest.approx(r["train/loss"], rel=1e-6)) for r in mine]
    report = json.loads(layout.report_json.read_text())["verdict"]
    hp = _events(layout.run_tensorboard)
    assert hp["final/test_loss/diloco"] == [(0, pytest.approx(report["loss"]["diloco"]["mean"], rel=1e-6))]


def _check_finetune(cfg, layout):
    """The pipeline's post-training stage: both pretrained models fine-tuned by one recipe (the same
    examples in the same order with the same seed), scored before and after, in the report; then
    the finetune flow alone on one checkpoint given by path, with LoRA."""
    from data.finetune import load_finetune_rows
    from flows.finetune import finetune
    from training.finetune import batch_order, order_digest

    ft = cfg.finetune
    assert "finetune" in json.loads(layout.status.read_text())["completed_stages"]
    n_rows = len(load_finetune_rows(layout.finetune_data, "train")["ids"])
    summaries = {m: json.loads(layout.summary("finetune", m).read_text()) for m in ("diloco", "dp")}
    logs = {m: read_jsonl(layout.metrics("finetune", m, "train")) for m in ("diloco", "dp")}
    for m, summary in summaries.items():
        assert summary["source_checkpoint"].endswith(f"pretrain/{m}/checkpoints")
        (run,) = summary["runs"]
        assert run["seed"] == ft.seeds[0] and run["steps"] == ft.steps
        # the order both saw is the recipe's, a function of the data, the batch size and the seed only
        assert run["order_sha256"] == order_digest(batch_order(n_rows, ft.batch_size, ft.steps, ft.seeds[0]))
        assert layout.checkpoints("finetune", m).is_dir()
        result = json.loads(layout.eval_result("finetune", m).read_text())
        assert result["task"]["name"] == "speakers" and result["task"]["test_items"] == len(
            result["pretrained"]["per_item"]["exact_match"]
        )
        before, after = result["pretrained"]["metrics"], result["finetuned"][0]["metrics"]
        assert after["response_nll"] < before["response_nll"] - 0.3  # it learnt the task's responses (0.46 nats here)
        assert set(result["pretrain_tasks"]["finetuned"]) >= {"heldout_ppl/bits_per_byte", "heldout_nextline/acc"}
    assert [r["examples"] for r in logs["diloco"]] == [r["examples"] for r in logs["dp"]]
    report = layout.report_md.read_text()
    assert "## Post-training" in report and "**DiLoCo − DP**" in report
    assert (layout.report / "finetune_loss.png").is_file()
    # alone: the whole stage again with LoRA (one recipe per run directory: every method), then one
    # more checkpoint given by path under that recipe
    lora = {"finetune.mode": "lora", "finetune.lora_rank": 2}
    assert finetune(run_dir=str(layout.root), overrides=lora, replace=True) == str(layout.root)
    redone = {m: json.loads(layout.summary("finetune", m).read_text()) for m in ("diloco", "dp")}
    for m, summary in redone.items():
        assert summary["recipe"]["mode"] == "lora" and summary["trainable_params"] < summary["frozen_params"] / 5
        assert summary["runs"][0]["order_sha256"] == summaries[m]["runs"][0]["order_sha256"]
    out = finetune(checkpoint=str(layout.checkpoints("pretrain", "dp")), name="dp-again", overrides=lora)
    assert out == str(layout.root)
    again = json.loads(layout.summary("finetune", "dp-again").read_text())
    assert again["runs"][0]["final_val_loss"] == redone["dp"]["runs"][0]["final_val_loss"]  # deterministic
    report = json.loads((layout.report / "report.json").read_text())["finetune"]
    assert set(report["methods"]) == {"diloco", "dp", "dp-again"}
    assert json.loads(layout.status.read_text())["completed_stages"][-2:] == ["finetune", "report"]


@pytest.mark.slow
def test_injected_failure_learner_rejoins(prefect_harness, small_cfg, small_data, tmp_path):
    """Learner 1 raises at step 20; merges go on while it waits for its retry; it rejoins from its
    last resume point (step 15: one every 5 steps, unless skipped) and is merged again later. With the adaptive
    grace window (Eq. 3): every merge says the window it used, the fixed 0.05 s while the step
    times are measured, then a measured one, at most one inner step."""
    from configs.schema import ExperimentConfig
    from flows.pretrain import pretrain_diloco

    run_dir = _copy(small_data, tmp_path)
    layout = RunLayout(run_dir)
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {
                **small_cfg.diloco.model_dump(),
                "retry_delay_s": 2.0,
                "grace_s": 0.05,
                "resume_every_steps": 5,
                "grace": "adaptive",
            },
            # a budget that outlasts the retry (the other two used 98,304 tokens 3 s after the failure)
            "train": {**small_cfg.train.model_dump(), "token_budget": 196608, "eval_every_tokens": 196608},
            "chaos": {"events": [{"kind": "fail", "learner": 1, "at_step": 20}]},
        }
    )
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=1.0)
    assert summary["tokens"] == cfg.dp_steps * cfg.tokens_per_dp_step
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    fail = next(e for e in events if e["event"] == "failure" and e["learner"] == 1)
    restart = next(e for e in events if e["event"] == "start" and e["learner"] == 1 and e["attempt"] == 2)
    assert "InjectedFailure" in fail["reason"] and fail["step"] == 19  # the last step it completed
    # It resumes at its last resume point: step 15 (one every 5 steps), unless that one was skipped
    # because the one before was still being written (a loaded machine); the log says which.
    saved = [
        e["step"]
        for e in events
        if e["event"] == "resume_point" and e["learner"] == 1 and e["attempt"] == 1 and e["saved"]
    ]
    assert saved and saved[-1] <= 15 and restart["resumed"] and restart["step"] == saved[-1]
    assert restart["t"] - fail["t"] >= 1.5
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    during = [m for m in merges if fail["t"] < m["merged_at_s"] < restart["t"]]
    assert during, "merges must go on while learner 1 is down"
    for m in during:  # learner 1 can only appear with work sent before it failed
        assert all(s < fail["step"] + 1 for c, s in zip(m["contributors"], m["local_steps"]) if c == 1)
    assert any(1 not in m["contributors"] for m in during)
    after = [m for m in merges if m["merged_at_s"] > restart["t"] and 1 in m["contributors"]]
    assert after, "the restarted learner's submissions must be merged again"
    assert summary["ledger"]["1"]["attempts"] == 2
    assert np.isfinite(summary["final_val_loss"])
    windows = [m["grace_s"] for m in merges if "grace_s" in m]  # (the final flush's merges have none)
    assert len(windows) >= len(merges) - cfg.diloco.fragments
    measured = [m for m in merges if "grace_cap_s" in m]  # once the step time is measured
    assert measured and all(0.0 <= m["grace_s"] <= m["grace_cap_s"] for m in measured)  # at most one step
    per_step = []  # seconds per inner step between a learner's logged steps
    for m in range(cfg.diloco.learners):
        steps = [e for e in events if e["event"] == "step" and e["learner"] == m]
        per_step += [
            (b["t"] - a["t"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:]) if b["step"] > a["step"]
        ]
    # the estimate is a step time (a moving median of the submissions'), not a wait or a stall
    assert statistics.median(m["grace_cap_s"] for m in measured) <= 2 * max(per_step)
    # the syncer saw learner 1 go down and come back (liveness from heartbeats), the others never down
    seen = [(e["alive"], e.get("reason")) for e in events if e["event"] == "liveness" and e["learner"] == 1]
    assert seen[:3] == [(True, None), (False, "down"), (True, None)], seen
    assert not any(
        e["event"] == "liveness" and not e["alive"] and e.get("reason") != "done"
        for e in events
        if e.get("learner") in (0, 2)
    )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:  # the live view's last version: every learner done
        (art,) = client.read_latest_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key("diloco-learners", run_slug(run_dir))])
            )
        )
    rows = json.loads(art.data) if isinstance(art.data, str) else art.data
    assert [r["learner"] for r in rows] == [0, 1, 2] and {r["state"] for r in rows} == {"done"}
    assert rows[1]["attempt"] == 2 and sum(r["tokens"] for r in rows) == summary["tokens"]
    assert f"{summary['merges']} merges" in art.description


def test_results_are_never_overwritten(tmp_path):
    """Training a method again into a run directory that holds its results is refused up front."""
    from training.common import ensure_fresh

    layout = RunLayout(tmp_path)
    (layout.checkpoints("pretrain", "dp") / "24576").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already holds pretrain dp results"):
        ensure_fresh(tmp_path, "pretrain", "dp")
    ensure_fresh(tmp_path, "pretrain", "diloco")  # the other method is still free to run
    # an evaluation result alone also holds the method's results
    layout.eval_result("pretrain", "diloco").parent.mkdir(parents=True)
    layout.eval_result("pretrain", "diloco").write_text("{}")
    with pytest.raises(FileExistsError, match=r"already holds pretrain diloco results \(eval/pretrain/diloco.json\)"):
        ensure_fresh(tmp_path, "pretrain", "diloco")


@pytest.mark.slow
def test_injected_syncer_failure_resumes_from_checkpoint_and_journal(prefect_harness, small_cfg, small_data, tmp_path):
    """The fsspec exchange on the thread engine; the syncer raises right after merge 4's journal entry,
    before its publish. Prefect retries it; the retry takes office (generation 2), loads its last
    checkpoint, replays the journal, publishes merge 4 and carries on: every fragment's versions
    are published and logged exactly once, 1..n, and the run ends normally."""
    from configs.schema import ExperimentConfig
    from flows.pretrain import pretrain_diloco

    run_dir = _copy(small_data, tmp_path)
    layout = RunLayout(run_dir)
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {
                **small_cfg.diloco.model_dump(),
                "retry_delay_s": 0.2,
                "grace_s": 0.05,
                "syncer_checkpoint_every_s": 0.2,
            },
            "train": {**small_cfg.train.model_dump(), "token_budget": 6144, "eval_every_tokens": 6144},
            "runtime": {"exchange": "fsspec"},
            "chaos": {"events": [{"kind": "syncer_fail", "at_merge": 4}]},
        }
    )
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=1.0)
    assert summary["tokens"] == cfg.dp_steps * cfg.tokens_per_dp_step
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    fail = next(e for e in events if e["event"] == "syncer-failure")
    resumed = next(e for e in events if e["event"] == "syncer-resumed")
    assert "InjectedFailure" in fail["reason"] and fail["merges"] == 4 and fail["generation"] == 1
    assert resumed["generation"] == 2 and resumed["attempt"] == 2 and resumed["republished"] == 1
    assert resumed["merges"] >= 4 and resumed["replayed"] >= 1
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    versions = []
    for p in range(cfg.diloco.fragments):
        logged = [m["version"] for m in merges if m["fragment"] == p]
        assert sorted(logged) == list(range(1, len(logged) + 1))  # contiguous, none twice
        versions.append(len(logged))
    exchange = FsspecExchange.open(str(layout.exchange("pretrain", "diloco")))
    assert exchange.versions() == versions and summary["merges"] == len(merges) == sum(versions)
    assert json.loads(layout.summary("pretrain", "diloco").read_text())["merges"] == sum(versions)
    assert exchange.generation() == 2
    restart_s = resumed["t"] - fail["t"]
    print(
        f"\nsyncer restart: {len(merges)} merges, versions {versions}, failure at t={fail['t']:.2f}s, "
        f"resumed at t={resumed['t']:.2f}s ({restart_s:.2f}s later; recovery itself {resumed['recover_s']:.3f}s, "
        f"checkpoint seq {resumed['checkpoint_seq']}, {resumed['replayed']} entries replayed), "
        f"wall {summary['wall_s']:.1f}s"
    )
    assert np.isfinite(summary["final_val_loss"])
