"""On clusters started the way users start them (issue 30): ``dask scheduler``/``dask worker``
processes and a two-node Ray cluster (``ray start``), apart from the run, reached through
``runtime.address``, with the exchange on an S3 endpoint (moto's server, credentials in the
environment). A worker or node that dies mid-run has its learner run again elsewhere; the run
completes and the ledger balances. The cluster commands are the ones docs/scale-out.md shows."""

from __future__ import annotations

import json
import os
import re
import shutil
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


def _cfg(small_cfg, engine: str, address: str, exchange_url: str, **chaos):
    from configs.schema import ExperimentConfig

    return ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {
                **small_cfg.diloco.model_dump(),
                "learners": 2,
                "quorum": 1,
                "fragments": 2,
                "grace_s": 0.05,
                "resume_every_steps": 5,
                "learner_retries": 2,
            },
            "train": {**small_cfg.train.model_dump(), "token_budget": 32768, "eval_every_tokens": 32768},
            "runtime": {"engine": engine, "address": address, "exchange_url": exchange_url},
            "chaos": chaos,
        }
    )


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
    processes, then ``ddiloco run`` (the whole pipeline, tiny config) with ``runtime.address`` and the
    exchange on S3, ``PREFECT_API_URL`` and the credentials in every process's environment. Learner
    1's worker process is SIGKILLed at local step 30: its nanny starts a new one and the scheduler runs
    the task again, which resumes at its last resume point; the run spends the whole budget with a
    balanced ledger and writes its report."""
    import subprocess
    import sys

    import psutil
    from prefect.settings import get_current_settings

    logs = tmp_path / "logs"
    logs.mkdir()
    run_dir = tmp_path / "run"
    env = {**s3_env, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/dask-{uuid.uuid4().hex}"
    with dask_cluster(3, env, logs) as cluster:
        sets = {
            **SMALL_DATA,
            "diloco.learners": 2, "diloco.quorum": 1, "diloco.fragments": 2, "diloco.grace_s": 0.05,
            "diloco.resume_every_steps": 5, "diloco.learner_retries": 2, "train.token_budget": 32768,
            "runtime.engine": "dask", "runtime.address": cluster["address"], "runtime.exchange_url": url,
            "chaos.events": "[{kind: kill, learner: 1, at_step: 30}]",
        }  # fmt: skip
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--run-dir", str(run_dir), *args]
        done = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
        )  # fmt: skip
        worker_pids = {c.pid for w in cluster["workers"] for c in psutil.Process(w.pid).children(True)}
    assert done.returncode == 0, done.stderr[-3000:]
    layout = RunLayout(run_dir)
    summary = json.loads((layout.root / "pretrain" / "diloco" / "summary.json").read_text())
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    starts = [e for e in events if e["event"] == "start"]
    assert {e["pid"] for e in starts} & worker_pids  # the learners ran in the cluster's worker processes
    assert [s["attempt"] for s in starts if s["learner"] == 1] == [1, 2]
    restart = [s for s in starts if s["learner"] == 1][1]
    assert restart["resumed"] and restart["pid"] != starts[0]["pid"]
    from configs.schema import ExperimentConfig

    cfg = ExperimentConfig.model_validate(json.loads((run_dir / "config.json").read_text()))
    assert summary["tokens"] == token_budget(cfg) and summary["ledger"]["1"]["attempts"] == 2
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])
    assert (layout.root / "report" / "report.md").is_file()
    _s3_exchange_checked(url, run_dir)
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr  # credentials never logged
    for f in run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".jsonl", ".md", ".html", ".yaml", ".log", ".txt"):
            assert s3_env["AWS_SECRET_ACCESS_KEY"] not in f.read_text(errors="replace"), f


def _kill_when_trained(path: Path, cluster: dict, steps: int, timeout_s: float, out: dict) -> None:
    """Watch the run's ``learners.jsonl``: once a learner whose first attempt runs on the second Ray
    node has saved a resume point at ``steps`` or later, SIGKILL that node's raylet (the node is
    lost: its worker processes end with it). Records ``learner`` and ``t`` (the kill, Unix time) in
    ``out``."""
    import os
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
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_a_two_node_ray_cluster_started_apart_loses_a_node_and_the_run_completes(
    prefect_harness, s3_env, small_cfg, small_data, tmp_path, monkeypatch
):
    """A Ray head and a second node started with ``ray start`` (token authentication on, as Ray
    starts it), the exchange on S3, the run through ``runtime.address``: the learners are placed on
    both nodes; the second node is lost mid-run (its raylet SIGKILLed) and its learner runs again on
    the head, resuming at its last resume point; the run spends the whole budget and the ledger
    balances."""
    import secrets
    import threading

    from prefect.settings import get_current_settings

    from flows.pretrain import pretrain_diloco

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    logs = tmp_path / "logs"
    logs.mkdir()
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for k, v in token.items():  # (the driver: this process)
        monkeypatch.setenv(k, v)
    env = {**s3_env, **token, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/ray-{uuid.uuid4().hex}"
    killed: dict = {}
    # head: the syncer, a learner and room for the lost node's learner; the second node: a learner
    with ray_cluster((3, 2), env, logs) as cluster:
        cfg = _cfg(small_cfg, "ray", cluster["address"], url)
        path = RunLayout(run_dir).metrics("pretrain", "diloco", "learners")
        watcher = threading.Thread(target=_kill_when_trained, args=(path, cluster, 15, 300, killed), daemon=True)
        watcher.start()
        summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=2.0)
        watcher.join(1)
    assert not processes_named(cluster["marker"])  # both nodes' processes are gone
    events = read_jsonl(path)
    starts = [e for e in events if e["event"] == "start"]
    first = {e["learner"]: e["node"] for e in starts if e["attempt"] == 1}
    assert set(first.values()) == {cluster["head"], cluster["node"]}, first  # one learner on each node
    assert killed, "the second node was never lost (no learner of it reached a resume point at step 15)"
    again = [e for e in starts if e["learner"] == killed["learner"]]
    assert [e["attempt"] for e in again] == [1, 2] and again[1]["node"] == cluster["head"]
    assert again[1]["resumed"] and again[1]["step"] >= 15
    assert summary["tokens"] == token_budget(cfg) and summary["ledger"][str(killed["learner"])]["attempts"] == 2
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])
    _s3_exchange_checked(url, run_dir)
