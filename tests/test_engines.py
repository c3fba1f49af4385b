"""Learners and the syncer as separate processes on Ray and Dask (prefect-ray, prefect-dask), through
the fsspec exchange in the run directory; a learner's process killed with SIGKILL is run again by
the engine in a new process, resumes at its saved step and is merged again."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from run.layout import RunLayout
from run.metrics import read_jsonl
from training.common import token_budget


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _cfg(small_cfg, engine: str, **chaos):
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
            "train": {**small_cfg.train.model_dump(), **chaos.pop("train", {})},
            "runtime": {"engine": engine},
            "chaos": chaos,
        }
    )


def _ledger_balanced(summary) -> None:
    for m, row in summary["ledger"].items():
        assert row["processed"] == row["not_submitted"] + row["submitted"], m
        assert row["submitted"] == row["merged"] + row["recomputed"] + row["dropped"] + row["pending"], m


# `ray.init` starts its daemons with subprocess (fork, then exec at once), which JAX warns about
@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_ray_learners_and_syncer_in_their_own_processes(prefect_harness, small_cfg, small_data, tmp_path):
    from flows.pretrain import pretrain_diloco

    run_dir = _copy(small_data, tmp_path)
    layout = RunLayout(run_dir)
    cfg = _cfg(small_cfg, "ray", train={"token_budget": 16384, "eval_every_tokens": 16384})
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=2.0)
    assert summary["tokens"] == token_budget(cfg) and summary["merges"] > 0 and np.isfinite(summary["final_val_loss"])
    beats = [layout.exchange("pretrain", "diloco") / "learners" / f"l{m:03d}.json" for m in range(2)]
    pids = {__import__("json").loads(b.read_text())["pid"] for b in beats}
    assert len(pids) == 2 and os.getpid() not in pids  # each learner in a process of its own
    _ledger_balanced(summary)
    assert not list((layout.exchange("pretrain", "diloco") / "inbox").iterdir())  # all merged, collected


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
def test_dask_learner_and_syncer_killed_with_sigkill_rejoin_in_new_processes(
    prefect_harness, small_cfg, small_data, tmp_path
):
    """Learner 1's process is SIGKILLed at local step 30: Dask runs the task again in a new worker
    process, which resumes at the last resume point (every 5 steps) and is merged again; merges go
    on while it is down, and the ledger balances. The steps it trains again (from its resume point
    to the kill: with H = 4 and P = 2 it had sent fragment 1 at step 26 and fragment 0 at 28, both
    merged) are not merged a second time: no (learner, fragment, local step) appears twice in
    merges.jsonl, and the ledger counts the re-trained tokens as recomputed (goodput counts their
    seconds as lost work). The syncer's process is SIGKILLed too, after its
    6th merge is journaled and before it is published: Dask runs it again in a new process, which
    takes office (generation 2), replays the journal and goes on; every fragment's versions run
    1, 2, … with no gap and no repeat."""
    from flows.pretrain import pretrain_diloco

    run_dir = _copy(small_data, tmp_path)
    layout = RunLayout(run_dir)
    cfg = _cfg(
        small_cfg,
        "dask",
        events=[
            {"kind": "kill", "learner": 1, "at_step": 30},
            {"kind": "syncer_fail", "at_merge": 6, "how": "sigkill"},
        ],
        train={"token_budget": 32768, "eval_every_tokens": 32768},
    )
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=2.0)
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    starts = [e for e in events if e["event"] == "start" and e["learner"] == 1]
    kill = next(e for e in events if e["event"] == "kill")
    assert kill["learner"] == 1 and kill["step"] == 29 and "SIGKILL" in kill["reason"]
    assert [s["attempt"] for s in starts] == [1, 2]
    restart = starts[1]
    assert restart["pid"] != starts[0]["pid"]  # a new process
    # The last resume point written before the kill, or the one before it if the kill cut that
    # write off. (A point is skipped while the previous one is still being written: see the log.)
    saved = [
        e["step"]
        for e in events
        if e["event"] == "resume_point" and e["learner"] == 1 and e["attempt"] == 1 and e["saved"]
    ]
    assert saved and restart["resumed"] and restart["step"] in saved[-2:]
    assert not any(e["event"] == "failure" and e["learner"] == 1 for e in events)  # a crash: nothing recorded
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    assert any(kill["t"] < m["merged_at_s"] < restart["t"] for m in merges), "merges go on while it is down"
    rejoined = any(m["merged_at_s"] > restart["t"] and 1 in m["contributors"] for m in merges)
    merged = [
        (c, m["fragment"], s, a) for m in merges for c, s, a in zip(m["contributors"], m["local_steps"], m["attempts"])
    ]
    assert len({x[:3] for x in merged}) == len(merged), "a (learner, fragment, local step) merged twice"
    high = {p: max((s for c, q, s, a in merged if (c, q, a) == (1, p, 1)), default=0) for p in range(2)}
    redone = {p: max(h - restart["step"], 0) for p, h in high.items()}  # steps trained again after their merge
    assert sum(redone.values()) > 0, (high, restart["step"])  # attempt 1 had merged sends past the resume point
    assert not any(c == 1 and a == 2 and s <= high[p] for c, p, s, a in merged)
    # merged again, unless the budget ran out before the new process trained a sync period past the steps
    # already merged (on a loaded machine its start can outlast the rest of the budget: learner 0 spends it)
    last = max(e["step"] for e in events if e["event"] == "stop" and e["learner"] == 1 and e["attempt"] == 2)
    assert rejoined or last < max(high.values()) + cfg.diloco.sync_every, ("merged again", last, high)
    tps, P = cfg.tokens_per_learner_step, cfg.diloco.fragments
    assert 0 < summary["ledger"]["1"]["recomputed"] <= sum(redone.values()) * tps / P + P
    assert summary["ledger"]["0"]["recomputed"] == 0
    from reports.resilience import diloco_resilience

    row = next(r for r in diloco_resilience(events, merges)["learners"] if r["learner"] == 1)
    assert [x["lost_steps"] for x in row["lost"]] == [kill["step"] - restart["step"]] and row["lost_work_s"] > 0
    beat = __import__("json").loads((layout.exchange("pretrain", "diloco") / "learners" / "l001.json").read_text())
    assert beat["attempt"] == 2 and beat["status"] == "done"
    assert summary["ledger"]["1"]["attempts"] == 2 and summary["tokens"] == token_budget(cfg)
    _ledger_balanced(summary)
    assert np.isfinite(summary["final_val_loss"])

    syncer_kill = next(e for e in events if e["event"] == "syncer-kill")
    resumed = next(e for e in events if e["event"] == "syncer-resumed")
    assert syncer_kill["merges"] == 6 and syncer_kill["generation"] == 1 and "SIGKILL" in syncer_kill["reason"]
    assert resumed["generation"] == 2 and resumed["attempt"] == 2 and resumed["pid"] != syncer_kill["pid"]
    assert resumed["republished"] == 1 and resumed["merges"] >= 6  # the journaled, unpublished merge
    assert not any(e["event"] == "syncer-failure" for e in events)  # a crash: nothing recorded
    versions = []
    for p in range(cfg.diloco.fragments):
        logged = [m["version"] for m in merges if m["fragment"] == p]
        assert sorted(logged) == list(range(1, len(logged) + 1))  # contiguous, none twice
        versions.append(len(logged))
    assert summary["merges"] == len(merges) == sum(versions)


def test_ray_learner_gpu_requests(small_cfg):
    """Each Ray learner asks for its devices' worth of GPUs when the cluster has them for all M
    (Ray then hands learners disjoint GPUs), none on a CPU cluster; an explicit request the cluster
    cannot meet is refused naming the field; the request is Ray's only."""
    from pydantic import ValidationError

    from configs.schema import ExperimentConfig
    from flows.engines import learner_gpus

    def cfg(**runtime):
        return ExperimentConfig.model_validate(
            {
                **small_cfg.model_dump(),
                "diloco": {**small_cfg.diloco.model_dump(), "learners": 4, "batch_size": 8},
                "runtime": {"engine": "ray", **runtime},
            }
        )

    assert learner_gpus(cfg(), 0) == 0 and learner_gpus(cfg(), 3) == 0 and learner_gpus(cfg(), 4) == 1
    assert learner_gpus(cfg(devices_per_learner=2), 8) == 2 and learner_gpus(cfg(devices_per_learner=2), 6) == 0
    assert learner_gpus(cfg(learner_gpus=0), 8) == 0 and learner_gpus(cfg(learner_gpus=2), 8) == 2
    with pytest.raises(
        ValueError, match=r"runtime.learner_gpus 1 × diloco.learners 4 needs 4 GPUs; the Ray cluster has 2"
    ):
        learner_gpus(cfg(learner_gpus=1), 2)
    with pytest.raises(ValidationError, match="runtime.learner_gpus is a Ray resource request"):
        cfg(engine="dask", learner_gpus=1)


def test_process_engines_let_jax_allocate_gpu_memory_as_needed(small_cfg, monkeypatch):
    """Several learner processes on one GPU: each JAX grows its memory instead of taking 75 % of the
    GPU at start (its default); a value the user set is kept; the thread engine is left alone."""
    from flows.engines import forwarded_env, share_accelerators

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    share_accelerators(small_cfg)  # threads
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ

    def on(engine):
        return small_cfg.model_copy(update={"runtime": small_cfg.runtime.model_copy(update={"engine": engine})})

    share_accelerators(on("dask"))
    assert forwarded_env()["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # what the workers inherit
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    share_accelerators(on("ray"))
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_a_ray_start_that_times_out_on_a_busy_host_is_waited_for_and_leaves_nothing(monkeypatch, caplog):
    """Ray waits a fixed 30 s for a new node to register; on a busy host its start can take longer
    (a CI run failed so). Here the start's node lookup fails once and Ray's clock jumps past the 30 s,
    so ``ray.init`` gives up: ``start_local_ray`` keeps that node's processes, connects to the node
    once it has registered (no second start), and a task runs on it; after the block nothing the
    start left is running."""
    import time
    import types

    import psutil
    import ray
    import ray._private.node as ray_node
    import ray._private.services as services

    from flows.engines import start_local_ray

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    first: list[psutil.Process] = []
    real_get_node = services.get_node
    offset = [0.0]

    def get_node(*args, **kwargs):
        if not first:  # the start's lookup: remember its processes, then Ray's wait runs out
            first.extend(p for p in me.children(recursive=True) if p.pid not in before)
            offset[0] = 100.0  # past Ray's 30-s wait
            raise RuntimeError("not registered (test)")
        return real_get_node(*args, **kwargs)

    monkeypatch.setattr(services, "get_node", get_node)
    monkeypatch.setattr(
        ray_node, "time", types.SimpleNamespace(sleep=time.sleep, monotonic=lambda: time.monotonic() + offset[0])
    )
    with start_local_ray({"num_cpus": 1, "include_dashboard": False, "log_to_driver": False}):
        assert ray.is_initialized() and ray.get(ray.remote(lambda: 6 * 7).remote()) == 42
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        assert first and all(p.is_running() for p in first)  # the same node: nothing was started again
        assert {p.name() for p in first if "gcs" in p.name() or "raylet" in p.name()} >= {"gcs_server", "raylet"}
    assert not ray.is_initialized() and "RAY_GCS_SERVER_PORT" not in os.environ
    assert "did not register within Ray's 30 s" in caplog.text
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.name() for p in alive]
