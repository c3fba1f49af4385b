"""The task runner of ``runtime.engine``: threads of the flow's process, or processes of Ray or Dask.

* ``threads``: Prefect's ``ThreadPoolTaskRunner``, sized for every learner, the syncer and the flow's
  own waits at once; learners share the process (and its devices) and exchange fragments in memory.
* ``ray``: prefect-ray's ``RayTaskRunner``. Without ``runtime.address`` a local Ray instance is
  started for the run with one logical CPU per task (the learners and the syncer run at once, however
  few cores the host has); with an address, the tasks join that cluster.
* ``dask``: prefect-dask's ``DaskTaskRunner``. Without an address a ``distributed.LocalCluster`` of
  one single-threaded worker process per task; with one, the tasks go to that scheduler.

On the process engines every task runs in a worker process of its own and imports the project
there: the workers must see the same code and the run directory (a shared filesystem on a
cluster), and the exchange (``runtime.exchange_url``) must be reachable from all of them. The
environment the workers need (``XLA_FLAGS``, Prefect's API URL and settings) is passed on.
"""

from __future__ import annotations

import os

from prefect.task_runners import ThreadPoolTaskRunner

from configs.schema import ExperimentConfig

# Environment the worker processes inherit from the flow's process (JAX and Prefect settings).
_FORWARD_PREFIXES = ("PREFECT_", "XLA_", "JAX_", "TF_CPP_", "HF_", "TQDM_")


def forwarded_env() -> dict[str, str]:
    """The flow process's variables a worker process needs: JAX/XLA flags, Prefect's API and settings."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARD_PREFIXES)}


def engine_slots(config: ExperimentConfig) -> int:
    """Tasks that run at once: every learner and the syncer."""
    return config.diloco.learners + 1


def task_runner_for(config: ExperimentConfig):
    """A Prefect task runner for ``config.runtime.engine`` (see the module docstring).

    Raises ``ImportError`` naming the package if the engine's Prefect integration is missing."""
    rt = config.runtime
    if rt.engine == "threads":
        return ThreadPoolTaskRunner(max_workers=rt.max_workers or config.diloco.learners + 2)
    slots = engine_slots(config)
    if rt.engine == "ray":
        from prefect_ray import RayTaskRunner

        init = {"runtime_env": {"env_vars": forwarded_env()}}
        if rt.address is None:
            init.update(num_cpus=slots, include_dashboard=False, log_to_driver=False,
                        configure_logging=True, logging_level="warning")
        return RayTaskRunner(address=rt.address, init_kwargs=init)
    from prefect_dask import DaskTaskRunner

    if rt.address is not None:
        return DaskTaskRunner(address=rt.address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": slots, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None, "env": forwarded_env()})
