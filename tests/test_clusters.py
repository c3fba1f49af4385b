"""On clusters started the way users start them (issue 30): ``dask scheduler``/``dask worker``
processes and a two-node Ray cluster (``ray start``), apart from the run, reached through
``runtime.address``, with the exchange on an S3 endpoint (moto's server, credentials in the
environment). A worker or node that dies mid-run has its learner run again elsewhere; the run
completes and the ledger balances. The cluster commands are the ones docs/scale-out.md shows."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from run.layout import RunLayout
from run.metrics import read_jsonl
from tests.clusters import DASK_STEPS, RAY_STEPS, dask_cluster, processes_named, ray_cluster
from tests.conftest import S3_BUCKET, SMALL_DATA
from training.common import token_budget

ROOT = Path(__file__).resolve().parents[1]


# The run both cluster tests make: the tiny config on the small corpus, two learners, DiLoCo alone
# (no DP, lm-eval or fine-tuning: the cluster is what is under test, and the suite's time is short).
RUN_SETS = {
    **SMALL_DATA,
    "diloco.learners": 2, "diloco.quorum": 1, "diloco.fragments": 2, "diloco.grace_s": 0.05,
    "diloco.resume_every_steps": 5, "diloco.learner_retries": 2,
    "train.token_budget": 32768, "train.eval_every_tokens": 32768,
    "dp.enabled": False, "eval.enabled": False, "finetune.enabled": False,
}  # fmt: skip


def ddiloco_run(run_dir: Path, sets: dict, env: dict[str, str]):
    """``ddiloco run configs/tiny.yaml --run-dir RUN_DIR --set …`` (:data:`RUN_SETS` and ``sets``) in a
    process of its own, with ``env`` added to its environment (as a user's shell has it): the Popen,
    its output in ``run_dir``'s sibling ``ddiloco.log``."""
    import subprocess
    import sys

    args = [a for k, v in {**RUN_SETS, **sets}.items() for a in ("--set", f"{k}={v}")]
    log = open(run_dir.parent / "ddiloco.log", "wb")  # noqa: SIM115 - the process writes it
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--run-dir", str(run_dir), *args],
        cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def finished(proc, run_dir: Path, secret: str, timeout_s: float = 600) -> tuple[dict, list[dict]]:
    """Wait for :func:`ddiloco_run`'s process: it exits 0 and no file it wrote (its output, the run
    directory's text files) holds ``secret``; returns the DiLoCo summary and ``learners.jsonl``."""
    code = proc.wait(timeout_s)
    out = (run_dir.parent / "ddiloco.log").read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert secret not in out  # credentials never logged
    for f in run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".jsonl", ".md", ".html", ".yaml", ".log", ".txt"):
            assert secret not in f.read_text(errors="replace"), f
    layout = RunLayout(run_dir)
    summary = json.loads((layout.root / "pretrain" / "diloco" / "summary.json").read_text())
    from configs.schema import ExperimentConfig

    cfg = ExperimentConfig.model_validate(json.loads((run_dir / "config.json").read_text()))
    assert summary["tokens"] == token_budget(cfg)  # the whole budget
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])
    return summary, read_jsonl(layout.metrics("pretrain", "diloco", "learners"))


def _ledger_balanced(summary) -> None:
    for m, row in summary["ledger"].items():
        assert row["processed"] == row["not_submitted"] + row["submitted"], m
        assert row["submitted"] == row["merged"] + row["recomputed"] + row["dropped"] + row["pending"], m


def _s3_exchange_checked(url: str, run_dir: Path) -> None:
    """The run's exchange lived on the S3 endpoint (nothing of it in the run directory), every
    submission was merged and collected, and both learners' heartbeats say done."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    root = f"{url.removeprefix('s3://')}/{run_dir.name}"
    assert fs.exists(f"{root}/meta.json") and fs.exists(f"{root}/learners_done")
    assert not fs.ls(f"{root}/inbox", refresh=True) if fs.exists(f"{root}/inbox") else True
    for m in range(2):
        assert json.loads(fs.cat_file(f"{root}/learners/l{m:03d}.json"))["status"] == "done"
    assert not RunLayout(run_dir).exchange("pretrain", "diloco").exists()


def test_the_docs_show_the_cluster_steps_the_tests_run():
    """Every command the cluster tests start is in docs/scale-out.md as written there."""
    page = " ".join((ROOT / "docs" / "scale-out.md").read_text().split())
    for step in (*DASK_STEPS.values(), *RAY_STEPS.values()):
        shown = re.sub(r"\{(\w+)\}", lambda m: m[1].upper(), step)  # {host} → HOST, {port} → PORT, …
        assert shown in page, f"docs/scale-out.md lacks: {shown}"


def test_what_a_cluster_test_started_is_killed_when_the_test_process_dies_however_it_dies(tmp_path):
    """Ray's daemons detach from ``ray start``: a test process SIGKILLed mid-test leaves them to the
    reaper, which kills every process naming the cluster's folder once the test process is gone."""
    import subprocess
    import sys
    import time

    marker = str(tmp_path / f"cluster-{uuid.uuid4().hex}")
    code = (
        "import subprocess, sys, time; from tests.clusters import start_reaper; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], "
        "start_new_session=True); "
        "start_reaper(sys.argv[1]); print('ready', flush=True); time.sleep(600)"
    )
    test = subprocess.Popen([sys.executable, "-c", code, marker], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert test.stdout.readline().strip() == "ready"
    assert len(processes_named(marker)) == 3  # the test, its detached "daemon" and the reaper name it
    test.kill()  # SIGKILL: no finally block runs
    test.wait()
    deadline = time.monotonic() + 30
    while processes_named(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_named(marker)


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
def test_a_dask_cluster_started_apart_runs_the_learners_and_a_killed_worker_recovers(prefect_harness, s3_env, tmp_path):
    """The documented steps as a user takes them: ``dask scheduler`` and three ``dask worker``
    processes, then ``ddiloco run`` with ``runtime.address`` and the exchange on S3, ``PREFECT_API_URL``
    and the credentials in every process's environment. Learner 1's worker process is SIGKILLed at
    local step 30: its nanny starts a new one and the scheduler runs the task again, which resumes at
    its last resume point; the run spends the whole budget with a balanced ledger."""
    import psutil
    from prefect.settings import get_current_settings

    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    env = {**s3_env, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/dask-{uuid.uuid4().hex}"
    with dask_cluster(3, env, logs) as cluster:
        sets = {"runtime.engine": "dask", "runtime.address": cluster["address"], "runtime.exchange_url": url,
                "chaos.events": "[{kind: kill, learner: 1, at_step: 30}]"}  # fmt: skip
        run = ddiloco_run(run_dir, sets, env)
        summary, events = finished(run, run_dir, s3_env["AWS_SECRET_ACCESS_KEY"])
        worker_pids = {c.pid for w in cluster["workers"] for c in psutil.Process(w.pid).children(True)}
    starts = [e for e in events if e["event"] == "start"]
    assert {e["pid"] for e in starts} & worker_pids  # the learners ran in the cluster's worker processes
    assert [s["attempt"] for s in starts if s["learner"] == 1] == [1, 2]
    restart = [s for s in starts if s["learner"] == 1][1]
    assert restart["resumed"] and restart["pid"] != starts[0]["pid"]
    assert summary["ledger"]["1"]["attempts"] == 2
    _s3_exchange_checked(url, run_dir)


def _kill_when_trained(path: Path, cluster: dict, steps: int, timeout_s: float, out: dict) -> None:
    """Watch the run's ``learners.jsonl``: once a learner whose first attempt runs on the second Ray
    node has saved a resume point at ``steps`` or later, SIGKILL that node's raylet (the node is
    lost: its worker processes end with it). Records ``learner`` and ``t`` (the kill, Unix time) in
    ``out``."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_jsonl(path) if path.exists() else []
        on_node = {e["learner"] for e in events if e["event"] == "start" and e.get("node") == cluster["node"]}
        saved = [e for e in events if e["event"] == "resume_point" and e["learner"] in on_node and e["step"] >= steps]
        if saved:
            out.update(learner=saved[0]["learner"], t=time.time())
            os.kill(cluster["raylet"], signal.SIGKILL)
            return
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
def test_a_two_node_ray_cluster_started_apart_loses_a_node_and_the_run_completes(prefect_harness, s3_env, tmp_path):
    """A Ray head and a second node started with ``ray start`` (token authentication on, as Ray
    starts it: the token in every process's environment), then ``ddiloco run`` with
    ``runtime.address`` and the exchange on S3: the learners are placed on both nodes; the second
    node is lost mid-run (its raylet SIGKILLed) and its learner runs again on the head, resuming at
    its last resume point; the run spends the whole budget and the ledger balances."""
    import secrets
    import threading

    from prefect.settings import get_current_settings

    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**s3_env, **token, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/ray-{uuid.uuid4().hex}"
    killed: dict = {}
    # head: the syncer, a learner and room for the lost node's learner; the second node: a learner
    with ray_cluster((3, 2), env, logs) as cluster:
        # without the cluster's token: one line before any work (Ray itself fails ~50 s into the run)
        tokenless = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}
        refused = ddiloco_run(tmp_path / "no-token", {"runtime.engine": "ray", "runtime.address": cluster["address"]},
                              tokenless)  # fmt: skip
        assert refused.wait(120) == 2
        said = (tmp_path / "ddiloco.log").read_text().strip().splitlines()
        assert len(said) == 1 and "RAY_AUTH_TOKEN" in said[0] and "runtime.address" in said[0], said
        assert not (tmp_path / "no-token").exists()
        run = ddiloco_run(run_dir, {"runtime.engine": "ray", "runtime.address": cluster["address"],
                                    "runtime.exchange_url": url}, env)  # fmt: skip
        path = RunLayout(run_dir).metrics("pretrain", "diloco", "learners")
        watcher = threading.Thread(target=_kill_when_trained, args=(path, cluster, 15, 300, killed), daemon=True)
        watcher.start()
        summary, events = finished(run, run_dir, s3_env["AWS_SECRET_ACCESS_KEY"])
        watcher.join(1)
    assert not processes_named(*cluster["markers"])  # both nodes' processes are gone
    starts = [e for e in events if e["event"] == "start"]
    first = {e["learner"]: e["node"] for e in starts if e["attempt"] == 1}
    assert set(first.values()) == {cluster["head"], cluster["node"]}, first  # one learner on each node
    assert killed, "the second node was never lost (no learner of it reached a resume point at step 15)"
    again = [e for e in starts if e["learner"] == killed["learner"]]
    assert [e["attempt"] for e in again] == [1, 2] and again[1]["node"] == cluster["head"]
    # resumed at the resume point it had saved (step 15 or later), or at the one before it (5 steps
    # earlier) when the node died while that point was still being written
    assert again[1]["resumed"] and again[1]["step"] >= 15 - 5
    assert summary["ledger"][str(killed["learner"])]["attempts"] == 2
    _s3_exchange_checked(url, run_dir)
