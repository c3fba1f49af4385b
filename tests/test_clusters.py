"""On clusters started the way users start them (issue 30): ``dask scheduler``/``dask worker``
processes and a two-node Ray cluster (``ray start``), apart from the run, reached through
``runtime.address``; the Dask run's exchange on an S3 endpoint (moto's server, credentials in the
environment), the Ray run's in the shared run directory. A worker or node that dies mid-run has
its learner run again elsewhere; the run completes and the ledger balances. The cluster commands
are the ones docs/scale-out.md shows."""

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
    cfg = _config(run_dir)
    assert summary["tokens"] == cfg.budget_tokens  # the whole budget
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])
    return summary, read_jsonl(layout.metrics("pretrain", "diloco", "learners"))


def _config(run_dir: Path):
    """The run's config as it ran (``config.json`` in its run directory)."""
    from configs.schema import ExperimentConfig

    return ExperimentConfig.model_validate(json.loads((run_dir / "config.json").read_text()))


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
    its last resume point; the run spends the whole budget with a balanced ledger. The syncer's
    process is SIGKILLed too, after its 6th merge is journaled and before it is published: the task
    runs again in a new process, which takes office (generation 2), replays the journal and goes on.
    (The merge accounting of both kills: :func:`_kills_accounted`.)"""
    import psutil
    from prefect.settings import get_current_settings

    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    env = {**s3_env, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/dask-{uuid.uuid4().hex}"
    with dask_cluster(3, env, logs) as cluster:
        sets = {"runtime.engine": "dask", "runtime.address": cluster["address"], "runtime.exchange_url": url,
                "chaos.events": "[{kind: kill, learner: 1, at_step: 30}, "
                                "{kind: syncer_fail, at_merge: 6, how: sigkill}]"}  # fmt: skip
        run = ddiloco_run(run_dir, sets, env)
        summary, events = finished(run, run_dir, s3_env["AWS_SECRET_ACCESS_KEY"])
        worker_pids = {c.pid for w in cluster["workers"] for c in psutil.Process(w.pid).children(True)}
    starts = [e for e in events if e["event"] == "start"]
    assert {e["pid"] for e in starts} & worker_pids  # the learners ran in the cluster's worker processes
    merges = read_jsonl(RunLayout(run_dir).metrics("pretrain", "diloco", "merges"))
    _kills_accounted(_config(run_dir), summary, events, merges)
    _s3_exchange_checked(url, run_dir)


def _kills_accounted(cfg, summary: dict, events: list[dict], merges: list[dict]) -> None:
    """Learner 1 killed at local step 30 and the syncer after its 6th journaled merge, as the Dask
    test runs them. The learner: a new process resumes at its last resume point (or the one before,
    if the kill cut that write off); merges go on while it is down; the steps it trains again (from
    its resume point to the kill: with H = 4 and P = 2 it had sent fragment 1 at step 26 and
    fragment 0 at 28) are not merged a second time: no (learner, fragment, local step) appears twice
    in merges.jsonl, and the ledger counts the re-trained tokens as recomputed (goodput counts their
    seconds as lost work). The syncer: its new process takes office (generation 2) and publishes the
    journaled, unpublished merge; every fragment's versions run 1, 2, … with no gap and no repeat."""
    starts = [e for e in events if e["event"] == "start" and e["learner"] == 1]
    kill = next(e for e in events if e["event"] == "kill")
    assert kill["learner"] == 1 and kill["step"] == 29 and "SIGKILL" in kill["reason"]
    assert [s["attempt"] for s in starts] == [1, 2]
    restart = starts[1]
    assert restart["pid"] != starts[0]["pid"]  # a new process
    # (a point is skipped while the previous one is still being written: see the learner's log)
    saved = [
        e["step"]
        for e in events
        if e["event"] == "resume_point" and e["learner"] == 1 and e["attempt"] == 1 and e["saved"]
    ]
    assert saved and restart["resumed"] and restart["step"] in saved[-2:]
    assert not any(e["event"] == "failure" and e["learner"] == 1 for e in events)  # a crash: nothing recorded
    assert any(kill["t"] < m["merged_at_s"] < restart["t"] for m in merges), "merges go on while it is down"
    merged = [
        (c, m["fragment"], s, a) for m in merges for c, s, a in zip(m["contributors"], m["local_steps"], m["attempts"])
    ]
    assert len({x[:3] for x in merged}) == len(merged), "a (learner, fragment, local step) merged twice"
    high = {
        p: max((s for c, q, s, a in merged if (c, q, a) == (1, p, 1)), default=0) for p in range(cfg.diloco.fragments)
    }
    redone = {p: max(h - restart["step"], 0) for p, h in high.items()}  # steps trained again after their merge
    assert sum(redone.values()) > 0, (high, restart["step"])  # attempt 1 had merged sends past the resume point
    assert not any(c == 1 and a == 2 and s <= high[p] for c, p, s, a in merged)
    # merged again, unless the budget ran out before the new process trained a sync period past the
    # steps already merged (on a loaded machine its start can outlast the rest of the budget)
    rejoined = any(m["merged_at_s"] > restart["t"] and 1 in m["contributors"] for m in merges)
    last = max(e["step"] for e in events if e["event"] == "stop" and e["learner"] == 1 and e["attempt"] == 2)
    assert rejoined or last < max(high.values()) + cfg.diloco.sync_every, ("merged again", last, high)
    tps, fragments = cfg.tokens_per_learner_step, cfg.diloco.fragments
    assert 0 < summary["ledger"]["1"]["recomputed"] <= sum(redone.values()) * tps / fragments + fragments
    assert summary["ledger"]["0"]["recomputed"] == 0 and summary["ledger"]["1"]["attempts"] == 2
    from reports.resilience import diloco_resilience

    row = next(r for r in diloco_resilience(events, merges)["learners"] if r["learner"] == 1)
    assert [x["lost_steps"] for x in row["lost"]] == [kill["step"] - restart["step"]] and row["lost_work_s"] > 0

    syncer_kill = next(e for e in events if e["event"] == "syncer-kill")
    resumed = next(e for e in events if e["event"] == "syncer-resumed")
    assert syncer_kill["merges"] == 6 and syncer_kill["generation"] == 1 and "SIGKILL" in syncer_kill["reason"]
    assert resumed["generation"] == 2 and resumed["attempt"] == 2 and resumed["pid"] != syncer_kill["pid"]
    assert resumed["republished"] == 1 and resumed["merges"] >= 6  # the journaled, unpublished merge
    assert not any(e["event"] == "syncer-failure" for e in events)  # a crash: nothing recorded
    versions = [[m["version"] for m in merges if m["fragment"] == p] for p in range(fragments)]
    assert all(sorted(v) == list(range(1, len(v) + 1)) for v in versions), versions  # contiguous, none twice
    assert summary["merges"] == len(merges) == sum(map(len, versions))


def _kill_when_trained(path: Path, cluster: dict, steps: int, timeout_s: float, out: dict) -> None:
    """Watch the run's ``learners.jsonl``: once a learner whose first attempt runs on the second Ray
    node has saved a resume point at ``steps`` or later, SIGKILL that node's raylet and every process
    under it (its workers and agents: the node is lost, as when its machine fails). Records
    ``learner`` and ``t`` (the kill, Unix time) in ``out``."""
    import contextlib
    import signal
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_jsonl(path) if path.exists() else []
        on_node = {e["learner"] for e in events if e["event"] == "start" and e.get("node") == cluster["node"]}
        saved = [e for e in events if e["event"] == "resume_point" and e["learner"] in on_node and e["step"] >= steps]
        if saved:
            out.update(learner=saved[0]["learner"], t=time.time())
            node = psutil.Process(cluster["raylet"])
            for p in [node, *node.children(recursive=True)]:  # the node's processes die at once, as with its machine
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGKILL)
            return
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
def test_a_two_node_ray_cluster_started_apart_loses_a_node_and_the_run_completes(prefect_harness, tmp_path):
    """A Ray head and a second node started with ``ray start`` (token authentication on, as Ray
    starts it: the token in every process's environment, and never in the run's output or files),
    then ``ddiloco run`` with ``runtime.address`` and the exchange in the run directory (the nodes
    share this host's filesystem, as a cluster shares a run directory; the S3 exchange is the Dask
    test's): the learners are placed on both nodes; the second node is lost mid-run (its raylet
    and every process under it SIGKILLed) and its learner runs again on the head while the other
    still trains, resuming at its last resume point; the run spends the whole budget and the
    ledger balances."""
    import secrets
    import threading

    from prefect.settings import get_current_settings

    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # Ray's GCS declares a node dead after health checks fail for about 15 s (3 s apart, 5 misses):
    # here within about 2 s, so the lost learner runs again while the other still trains
    fast = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_timeout_ms": "1000"}  # fmt: skip
    env = {**token, **fast, "PREFECT_API_URL": get_current_settings().api.url}
    killed: dict = {}
    # head: the syncer, a learner and room for the lost node's learner; the second node: a learner
    with ray_cluster((3, 2), env, logs) as cluster:
        run = ddiloco_run(run_dir, {"runtime.engine": "ray", "runtime.address": cluster["address"],
                                    # both learners 8× slower (a sleep: no extra CPU), so that the run
                                    # outlasts the node's loss and the re-run of its learner
                                    "chaos.events": "[{kind: slowdown, learner: 0, factor: 8}, "
                                                    "{kind: slowdown, learner: 1, factor: 8}]"}, env)  # fmt: skip
        # beside it, a run without the cluster's token: one line before any work (Ray itself fails
        # ~50 s into the run)
        tokenless = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}
        (tmp_path / "refused").mkdir()
        refused = ddiloco_run(tmp_path / "refused" / "run",
                              {"runtime.engine": "ray", "runtime.address": cluster["address"]}, tokenless)  # fmt: skip
        assert refused.wait(120) == 2
        said = (tmp_path / "refused" / "ddiloco.log").read_text().strip().splitlines()
        assert len(said) == 1 and "RAY_AUTH_TOKEN" in said[0] and "runtime.address" in said[0], said
        assert not (tmp_path / "refused" / "run").exists()
        path = RunLayout(run_dir).metrics("pretrain", "diloco", "learners")
        watcher = threading.Thread(target=_kill_when_trained, args=(path, cluster, 15, 300, killed), daemon=True)
        watcher.start()
        summary, events = finished(run, run_dir, token["RAY_AUTH_TOKEN"])
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
    # it ran again while the other learner still trained
    other = max(e["t"] for e in events if e["event"] == "stop" and e["learner"] != killed["learner"])
    assert again[1]["t"] < other, (again[1], other)
    assert summary["ledger"][str(killed["learner"])]["attempts"] == 2
    exchange = RunLayout(run_dir).exchange("pretrain", "diloco")
    assert (exchange / "learners_done").exists() and not list((exchange / "inbox").iterdir())  # all merged
