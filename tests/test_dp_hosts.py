"""The DP baseline as a job of several hosts (``dp.hosts``): JAX processes joined by
``jax.distributed`` (gloo on CPU), started as Prefect tasks, that train the one-process model and
come back from a host's death by restarting every host from the last checkpoint."""

import json
import shutil
import threading
import time

import psutil
import pytest

from configs.schema import ExperimentConfig
from run.layout import RunLayout
from run.metrics import read_jsonl
from training.dp_job import HostFiles


def _hosts(run_dir) -> list[psutil.Process]:
    """The DP host processes of ``run_dir`` alive now."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "training.dp_job" in cmd and str(run_dir) in cmd:
            out.append(p)
    return out


def _kill_by_hand(run_dir, generation: int, past_step: int) -> threading.Thread:
    """A watcher that SIGKILLs host 0 of ``generation`` once host 0 has passed ``past_step`` (as a
    person would, with kill -9)."""

    def watch():
        files, deadline = HostFiles(run_dir, generation), time.monotonic() + 180
        while time.monotonic() < deadline:
            if files.plan.exists() and files.step() > past_step:
                for p in _hosts(run_dir):
                    if p.info["cmdline"][-3:] == ["0", "--generation", str(generation)]:
                        p.kill()
                        return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.slow
@pytest.mark.process
def test_two_hosts_train_the_one_process_model_through_a_scheduled_kill_and_a_kill_by_hand(
    small_cfg, small_data, tmp_path, prefect_harness
):
    """The tiny DP job (32 steps) on one process, then on 2 host processes (6 of the 12 rows of every
    step each): host 1 is SIGKILLed by a scheduled dp_fail before step 17 and the restarted job's
    host 0 by hand past step 22. Each death takes the whole job down; every host restarts from the last
    checkpoint (every 10 steps), recomputes the steps since on the same batches, and the held-out
    curve and final model are the one-process run's within float32 summation order. The lost time
    is measured: down from each death to its restore, then the recomputation until the job is back
    where it died."""
    from flows.pretrain import pretrain_dp
    from training.dp import train_dp

    train = {**small_cfg.train.model_dump(), "token_budget": 12288, "eval_every_tokens": 3072}  # 32 steps
    base = {**small_cfg.model_dump(), "diloco": {**small_cfg.diloco.model_dump(), "enabled": False}, "train": train}
    one = ExperimentConfig.model_validate({**base, "dp": {**small_cfg.dp.model_dump(), "workers": 2}})
    two = ExperimentConfig.model_validate(
        {
            **base,
            "dp": {**small_cfg.dp.model_dump(), "workers": 2, "hosts": 2, "checkpoint_every_steps": 10},
            "chaos": {"events": [{"kind": "dp_fail", "host": 1, "at_step": 17, "restart_delay_s": 0.5}]},
        }
    )
    runs = {name: tmp_path / name for name in ("one", "two")}
    for rd in runs.values():
        shutil.copytree(small_data, rd)
    alone = train_dp(one, runs["one"])
    by_hand = _kill_by_hand(runs["two"], generation=1, past_step=22)
    summary = pretrain_dp(two, str(runs["two"]))
    by_hand.join(timeout=5)

    curves = {n: read_jsonl(RunLayout(rd).metrics("pretrain", "dp", "eval")) for n, rd in runs.items()}
    assert [r["tokens"] for r in curves["two"]] == [r["tokens"] for r in curves["one"]]
    assert [r["val/loss"] for r in curves["two"]] == pytest.approx([r["val/loss"] for r in curves["one"]], rel=1e-5)
    assert summary["final_val_loss"] == pytest.approx(alone["final_val_loss"], rel=1e-5)
    assert summary["steps"] == alone["steps"] == two.dp_steps and summary["budget"]["status"] == "complete"
    assert summary["hyperparameters"]["hosts"] == 2 and summary["hyperparameters"]["devices"] == 2

    events = read_jsonl(RunLayout(runs["two"]).metrics("pretrain", "dp", "events"))
    fails = [e for e in events if e["event"] == "failure"]
    restores = [e for e in events if e["event"] == "restore"]
    # the scheduled kill: host 1's own note (SIGKILLed at once after writing it); then the hand's
    assert fails[0] == {**fails[0], "host": 1, "index": 0, "how": "sigkill", "step": 16, "generation": 0}
    assert fails[1]["host"] == 0 and fails[1]["index"] is None and "killed by signal 9" in fails[1]["reason"]
    assert fails[1]["generation"] == 1 and fails[1]["step"] > 22
    assert [(r["generation"], r["step"]) for r in restores] == [(1, 10), (2, fails[1]["step"] // 10 * 10)]
    for f, r in zip(fails, restores, strict=True):
        assert r["lost_steps"] == f["step"] - r["step"] and r["down_s"] == pytest.approx(r["t"] - f["t"])
    assert restores[0]["down_s"] >= 0.5  # at least the scheduled restart delay, plus the hosts' start
    assert summary["chaos"] == {**summary["chaos"], "failures": 2, "lost_steps": sum(r["lost_steps"] for r in restores)}
    assert [r["recompute_s"] > 0 for r in summary["restarts"]] == [True, True]
    # the logs hold each step once: the recomputed ones were logged the first time round
    steps = [r["step"] for r in read_jsonl(RunLayout(runs["two"]).metrics("pretrain", "dp", "train"))]
    assert steps == sorted(set(steps))
    saved = json.loads(RunLayout(runs["two"]).summary("pretrain", "dp").read_text())
    assert saved["restarts"] == summary["restarts"]
    assert _hosts(runs["two"]) == []  # every host process ended
