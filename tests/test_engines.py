"""The process engines' settings, and a local Ray instance's start on a busy host. (Runs on Ray and
Dask: tests/test_clusters.py, on clusters started apart: learners on two Ray nodes, one node lost;
learner and syncer processes SIGKILLed on Dask, run again in new processes and merged again; a
local cluster's start, training and hard stop: tests/test_run_control.py.)"""

from __future__ import annotations

import os

import pytest


def test_a_local_dask_cluster_reruns_a_task_whose_process_died(small_cfg):
    """The settings that make a SIGKILLed learner or syncer run again on the local Dask cluster (the
    kill itself is exercised on a cluster started apart: tests/test_clusters.py): the scheduler
    re-runs a task whose worker died up to the larger of the learners' and the syncer's retries, one
    single-threaded worker process per task, no memory limit (no nanny restart on JAX's buffers)
    and glibc's trim threshold left alone in the workers."""
    import dask

    from configs.schema import ExperimentConfig
    from flows.engines import task_runner_for

    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {**small_cfg.diloco.model_dump(), "learners": 2, "learner_retries": 2, "syncer_retries": 5},
            "runtime": {"engine": "dask"},
        }
    )
    with dask.config.set({}):  # (task_runner_for sets Dask's global config: restored after)
        runner = task_runner_for(cfg)
        assert dask.config.get("distributed.scheduler.allowed-failures") == 5
        assert dask.config.get("distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_") is None
    kw = runner.cluster_kwargs
    assert (kw["n_workers"], kw["threads_per_worker"], kw["processes"], kw["memory_limit"]) == (3, 1, True, 0)


def test_ray_learner_gpu_requests(small_cfg):
    """Each Ray learner asks for its devices' worth of GPUs when the cluster has them for all M
    (Ray then hands learners disjoint GPUs), none on a CPU cluster; an explicit request the cluster
    cannot meet is refused naming the field; the request is Ray's only."""
    from pydantic import ValidationError

    from configs.schema import ExperimentConfig
    from flows.engines import learner_gpus

    def cfg(**runtime):
        c = ExperimentConfig.model_validate(
            {
                **small_cfg.model_dump(),
                "diloco": {**small_cfg.diloco.model_dump(), "learners": 4, "batch_size": 8},
                "runtime": {"engine": "ray", **runtime},
            }
        )
        return c.runtime, c.diloco.learners

    assert learner_gpus(*cfg(), 0) == 0 and learner_gpus(*cfg(), 3) == 0 and learner_gpus(*cfg(), 4) == 1
    assert learner_gpus(*cfg(devices_per_learner=2), 8) == 2 and learner_gpus(*cfg(devices_per_learner=2), 6) == 0
    assert learner_gpus(*cfg(learner_gpus=0), 8) == 0 and learner_gpus(*cfg(learner_gpus=2), 8) == 2
    with pytest.raises(
        ValueError, match=r"runtime.learner_gpus 1 × diloco.learners 4 needs 4 GPUs; the Ray cluster has 2"
    ):
        learner_gpus(*cfg(learner_gpus=1), 2)
    with pytest.raises(ValidationError, match="runtime.learner_gpus is a Ray resource request"):
        cfg(engine="dask", learner_gpus=1)


def test_process_engines_let_jax_allocate_gpu_memory_as_needed(small_cfg, monkeypatch):
    """Several learner processes on one GPU: each JAX grows its memory instead of taking 75 % of the
    GPU at start (its default); a value the user set is kept; the thread engine is left alone."""
    from flows.engines import forwarded_env, share_accelerators

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    share_accelerators(small_cfg.runtime)  # threads
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ

    def on(engine):
        return small_cfg.model_copy(update={"runtime": small_cfg.runtime.model_copy(update={"engine": engine})})

    share_accelerators(on("dask").runtime)
    assert forwarded_env()["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # what the workers inherit
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    share_accelerators(on("ray").runtime)
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
