"""How a run ends: a stop signal stops it cleanly, and a run that lost most of its work fails.

Both are real pipeline runs on the tiny config (a subprocess for the signal, the session's Prefect
harness for the failed run).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.pretrain import work_lost

ROOT = Path(__file__).resolve().parents[1]


def test_work_lost_thresholds():
    ledger = {"0": {"processed": 1000, "dropped": 30, "drop_reasons": {"stale": 30}},
              "1": {"processed": 1000, "dropped": 90, "drop_reasons": {"stale": 40, "non-finite": 50}}}
    lost = work_lost(ledger, warn_above=0.05, fail_above=0.5)
    assert lost["processed_tokens"] == 2000 and lost["dropped_tokens"] == 120
    assert lost["dropped_fraction"] == pytest.approx(0.06)
    assert lost["reasons"] == {"stale": 70, "non-finite": 50}
    assert lost["status"] == "warning"
    assert work_lost(ledger, 0.1, 0.5)["status"] == "ok"
    assert work_lost(ledger, 0.01, 0.05)["status"] == "failed"
    assert work_lost({"0": {"processed": 0, "dropped": 0}}, 0.05, 0.5)["dropped_fraction"] == 0.0


def test_a_run_that_mostly_failed_fails(prefect_harness, tiny_cfg, tiny_data, tmp_path):
    """Learners that diverge (inner lr 50) have most submissions dropped as non-finite: the run
    writes its report, says so at the top, records ``failed`` and ends Failed (exit 1 in the CLI)."""
    import shutil

    from prefect.exceptions import FailedRun

    from flows.pipeline import pipeline

    rd = tmp_path / "run"
    shutil.copytree(tiny_data, rd)
    with pytest.raises(FailedRun, match=r"the syncer dropped \d+\.\d % .*non-finite.*max_dropped_fraction = 0.5"):
        pipeline(config_file="tiny", run_dir=str(rd),
                 overrides={"diloco.inner.lr": 50.0, "dp.enabled": False, "eval.enabled": False})
    status = json.loads((rd / "status.json").read_text())
    assert status["status"] == "failed" and status["completed_stages"] == ["data", "pretrain-diloco", "report"]
    lost = json.loads((rd / "pretrain" / "diloco" / "summary.json").read_text())["work_lost"]
    assert lost["status"] == "failed" and lost["dropped_fraction"] > 0.5
    assert lost["reasons"]["non-finite"] > 0.5 * lost["processed_tokens"]  # (a few may go as superseded)
    head = (rd / "report" / "report.md").read_text().split("\n## ")[0]  # above the first section
    failed = next(ln for ln in head.splitlines() if ln.startswith("**Failed:"))
    warning = next(ln for ln in head.splitlines() if ln.startswith("**Warning:"))
    assert "max_dropped_fraction = 0.5" in failed
    assert "non-finite" in warning and "max_dropped_fraction = 0.5" in warning


def test_sigterm_stops_a_run_cleanly(tmp_path):
    """SIGTERM during DiLoCo training: learners stop at the next step, the syncer saves its state, the
    report of what was done is written, status.json says ``interrupted``, and the exit is 143."""
    rd = tmp_path / "R"
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "tiny", "--run-dir", str(rd),
                                 "--set", "train.token_budget=98304"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"})
    try:
        deadline = time.monotonic() + 240
        while "diloco: tokens" not in log.read_text():  # training has started
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 143, text[-3000:]
    assert "SIGTERM received: stopping at the next step boundary" in text
    assert "Traceback" not in text, text[-3000:]
    status = json.loads((rd / "status.json").read_text())
    assert status["status"] == "interrupted" and status["reason"] == "SIGTERM received"
    assert status["completed_stages"] == ["data", "report"]  # DiLoCo stopped part-way; DP never started
    summary = json.loads((rd / "pretrain" / "diloco" / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["tokens"] < 98304
    assert any((rd / "checkpoints" / "diloco").iterdir())  # the syncer saved Θ and its outer state
    assert not (rd / "pretrain" / "dp").exists()
    assert (rd / "report" / "report.md").is_file()
    assert took < 60, f"stopping took {took:.1f} s"
