"""On clusters started the way users start them (issue 30): ``dask scheduler``/``dask worker``
processes and a two-node Ray cluster (``ray start``), apart from the run, reached through
``runtime.address``, with the exchange on an S3 endpoint (moto's server, credentials in the
environment). A worker or node that dies mid-run has its learner run again elsewhere; the run
completes and the ledger balances. The cluster commands are the ones docs/scale-out.md shows."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from run.layout import RunLayout
from run.metrics import read_jsonl
from tests.clusters import DASK_STEPS, RAY_STEPS, dask_cluster, ray_cluster
from tests.conftest import S3_BUCKET
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
        shown = re.sub(r"\{(\w+)\}", lambda m: {"host": "HOST"}.get(m[1], m[1].upper()), step)
        assert shown in page, f"docs/scale-out.md lacks: {shown}"


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
def test_a_dask_cluster_started_apart_runs_the_learners_and_a_killed_worker_recovers(
    prefect_harness, s3_env, small_cfg, small_data, tmp_path
):
    """``dask scheduler`` and three ``dask worker`` processes (the documented commands), the exchange
    on S3: learner 1's worker process is SIGKILLed at local step 30; its nanny starts a new one and
    the scheduler runs the task again, which resumes at its last resume point; the run completes
    with the whole token budget and a balanced ledger."""
    from prefect.settings import get_current_settings

    from flows.pretrain import pretrain_diloco

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**s3_env, "PREFECT_API_URL": get_current_settings().api.url}
    url = f"s3://{S3_BUCKET}/dask-{uuid.uuid4().hex}"
    with dask_cluster(3, env, logs) as cluster:
        cfg = _cfg(small_cfg, "dask", cluster["address"], url, events=[{"kind": "kill", "learner": 1, "at_step": 30}])
        summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=2.0)
        worker_pids = {c.pid for w in cluster["workers"] for c in __import__("psutil").Process(w.pid).children(True)}
    events = read_jsonl(RunLayout(run_dir).metrics("pretrain", "diloco", "learners"))
    starts = [e for e in events if e["event"] == "start"]
    assert {e["pid"] for e in starts} & worker_pids  # the learners ran in the cluster's worker processes
    assert [s["attempt"] for s in starts if s["learner"] == 1] == [1, 2]
    restart = [s for s in starts if s["learner"] == 1][1]
    assert restart["resumed"] and restart["pid"] != starts[0]["pid"]
    assert summary["tokens"] == token_budget(cfg) and summary["ledger"]["1"]["attempts"] == 2
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])
    _s3_exchange_checked(url, run_dir)
