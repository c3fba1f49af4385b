"""The task runner of ``runtime.engine``: threads of the flow's process, or processes of Ray or Dask.

* ``threads``: Prefect's ``ThreadPoolTaskRunner``, sized for every learner, the syncer and the flow's
  own waits at once; learners share the process (and its devices) and exchange fragments in memory.
* ``ray``: prefect-ray's ``RayTaskRunner``: without ``runtime.address`` a local Ray instance with one
  logical CPU per task (no dashboard); with one, the tasks join that cluster.
* ``dask``: prefect-dask's ``DaskTaskRunner``: without an address a ``distributed.LocalCluster`` of one
  single-threaded worker process per task; with one, the tasks go to that scheduler.

On the process engines every task runs in a worker process that imports the project: workers must
see the same code, the run directory and the exchange (``runtime.exchange_url``).

Crashes. Prefect's retries re-run a task that *raised*; a worker process that *dies* (SIGKILL, out of
memory, a lost node) is re-run by the engine itself (Ray's ``max_retries``, Dask's
``distributed.scheduler.allowed-failures``) with Prefect's run count still 1 (Prefect 3.9.1,
prefect-ray 0.6.0, prefect-dask 0.3.7). Both are set to the same retries; the learner counts its
attempts from the exchange's heartbeats.

A hard stop. A killed ``ddiloco`` leaves no local cluster running: local Dask workers exit when the
pipe from the flow's process closes (tests/test_run_control.py) and a local Ray instance's processes
get kernel fate-sharing, but its dashboard and runtime-env agents outlive it (Ray 2.60), so every
command-line run starts a reaper (``flows.server.start_reaper``). A cluster at ``runtime.address`` is
not the run's and keeps running.

The Prefect API. Workers report their task runs to the flow's Prefect API: :func:`engine_session`
hands them the URL of Prefect's temporary server when no ``PREFECT_API_URL`` is set. On a cluster,
run a Prefect server the workers can reach and set ``PREFECT_API_URL`` everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator

from prefect.settings import get_current_settings
from prefect.task_runners import ThreadPoolTaskRunner

from configs.methods import DiLoCoConfig
from configs.runtime import RuntimeConfig
from configs.schema import ExperimentConfig

# Environment the worker processes inherit from the flow's process (JAX and Prefect settings).
_FORWARD_PREFIXES = ("PREFECT_", "XLA_", "JAX_", "TF_CPP_", "HF_", "TQDM_")


def forwarded_env() -> dict[str, str]:
    """The flow process's variables a worker process needs: JAX/XLA flags, Prefect's API and settings."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARD_PREFIXES)}


def share_accelerators(rt: RuntimeConfig) -> None:
    """On a process engine, JAX in each process allocates GPU memory as it needs it
    (``XLA_PYTHON_CLIENT_PREALLOCATE=false``; JAX's default takes 75 % of a GPU per process), in this
    process's environment, which the workers inherit; call it before JAX starts. A value set is kept."""
    if rt.engine != "threads":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def crash_retries(d: DiLoCoConfig, role: str | None = None) -> int:
    """How many times the engine re-runs a task whose process died: the ``role``'s retries, or the larger
    of the learner's and the syncer's for the whole cluster (``role`` None: Dask's one setting)."""
    retries = {"learner": d.learner_retries, "syncer": d.syncer_retries}
    return retries.get(role, max(retries.values()))


def task_runner_for(config: ExperimentConfig):
    """A Prefect task runner for ``config.runtime.engine``, entered inside :func:`engine_session`. Raises
    ``ImportError`` naming the package if the engine's Prefect integration is missing."""
    rt = config.runtime
    if rt.engine == "threads":
        return ThreadPoolTaskRunner(max_workers=rt.max_workers or config.engine_slots + 1)
    slots = config.engine_slots
    if rt.engine == "ray":
        from prefect_ray import RayTaskRunner

        # a local instance is started by engine_session (start_local_ray) and only used here
        return RayTaskRunner(address=rt.address, init_kwargs=ray_init_kwargs(rt, slots))
    import dask
    from prefect_dask import DaskTaskRunner

    # distributed sets its loggers to INFO when imported (dask's logging config): ~120 lines a run
    for name in ("distributed", *[n for n in logging.root.manager.loggerDict if n.startswith("distributed.")]):
        logging.getLogger(name).setLevel(logging.WARNING)

    # Dask's nannies set MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's dynamic mmap threshold: XLA's
    # CPU buffers are then mapped afresh at every step (a 1024² matmul took 18.7 ms instead of 8.4 ms)
    malloc = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
    dask.config.set({"distributed.scheduler.allowed-failures": crash_retries(config.diloco), malloc: None})
    if rt.address is not None:
        return DaskTaskRunner(address=rt.address)
    # memory_limit 0: no nanny restarts on a per-worker memory share (JAX holds its buffers);
    # preload: run.control's dask_setup in every worker process (a terminal's Ctrl-C must not kill them)
    cluster = {"n_workers": slots, "threads_per_worker": 1, "processes": True, "dashboard_address": None}
    cluster |= {"memory_limit": 0, "env": forwarded_env(), "preload": ["run.control"]}
    return DaskTaskRunner(cluster_kwargs=cluster)


def ray_init_kwargs(rt: RuntimeConfig, slots: int) -> dict:
    """``ray.init`` arguments: a local instance gets ``slots`` logical CPUs and no dashboard (its workers
    inherit this environment); on an existing cluster the workers get :func:`forwarded_env`."""
    init: dict = {"log_to_driver": False, "logging_level": "ERROR"}
    if rt.address is None:
        init.update(num_cpus=slots, include_dashboard=False)
    else:
        init["runtime_env"] = {"env_vars": forwarded_env()}
    return init


# Ray waits a fixed 30 s for a new node's raylet to register (ray/_private/node.py, Ray 2.60), which
# busy cores exceed (45 s beside a training job); starting again takes as long, so the node that is
# still starting is waited for instead.
RAY_REGISTER_WAIT_S = 180.0
_RAY_START_TIMEOUT = "timed out during startup"
# ray.init's arguments that also apply when connecting to a running instance
_RAY_CONNECT_KWARGS = ("log_to_driver", "logging_level", "logging_format", "namespace", "runtime_env")


@contextlib.contextmanager
def start_local_ray(init_kwargs: dict, wait_s: float = RAY_REGISTER_WAIT_S) -> Iterator[None]:
    """A local Ray instance for the duration of the block, shut down after it.

    When Ray gives up on its own node (see ``RAY_REGISTER_WAIT_S``), this keeps its processes, waits up
    to ``wait_s`` s more for it to register and connects to it (at the GCS port set through
    ``RAY_GCS_SERVER_PORT``); its processes are ended when the block ends. Any other error, or a node
    that never registers, is raised as Ray raised it, after ending every process the start left."""
    import psutil
    import ray

    from run.s3_server import free_port

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    adopted: list[psutil.Process] = []

    def leftovers() -> list[psutil.Process]:
        return [p for p in me.children(recursive=True) if p.pid not in before]

    def end(procs: list[psutil.Process]) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)

    port = free_port("")
    saved = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    try:
        with warnings.catch_warnings():
            # Ray's daemons fork then exec at once: JAX's fork warning does not apply (tests/test_engines.py)
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            try:
                ray.init(**init_kwargs)
            except Exception as e:
                if _RAY_START_TIMEOUT not in str(e):
                    end(leftovers())
                    raise
                msg = "Ray's local node did not register within Ray's 30 s (a busy host); waiting up to %.0f s more"
                logging.getLogger(__name__).warning(msg, wait_s)
                address, deadline = f"{ray.util.get_node_ip_address()}:{port}", time.monotonic() + wait_s
                while True:  # each try waits for the node to register itself
                    try:
                        ray.init(address=address, **{k: v for k, v in init_kwargs.items() if k in _RAY_CONNECT_KWARGS})
                        break
                    except Exception:
                        with contextlib.suppress(Exception):
                            ray.shutdown()
                        if time.monotonic() > deadline:
                            end(leftovers())
                            raise
                        time.sleep(1.0)
                adopted = leftovers()
    finally:
        if saved is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = saved
    try:
        yield
    finally:
        ray.shutdown()
        end(adopted)


def learner_gpus(rt: RuntimeConfig, m: int, cluster_gpus: float) -> int:
    """GPUs each of ``m`` learner tasks asks Ray for, on a cluster with ``cluster_gpus`` GPUs in all:
    ``runtime.learner_gpus``, or when unset ``runtime.devices_per_learner`` if the cluster holds that
    many for every learner, else 0. Raises ``ValueError`` naming the field when an explicit request
    cannot be met (Ray would leave the tasks pending for ever)."""
    if rt.learner_gpus is None:
        return rt.devices_per_learner if cluster_gpus >= m * rt.devices_per_learner else 0
    if rt.learner_gpus * m > cluster_gpus:
        raise ValueError(
            f"runtime.learner_gpus {rt.learner_gpus} × diloco.learners {m} needs "
            f"{rt.learner_gpus * m} GPUs; the Ray cluster has {cluster_gpus:g}: lower "
            "runtime.learner_gpus (0: CPU), or unset it to decide from the cluster"
        )
    return rt.learner_gpus


@contextlib.contextmanager
def task_options(rt: RuntimeConfig, d: DiLoCoConfig, role: str) -> Iterator[None]:
    """Per-task engine options for ``role`` (learner, syncer or dp-host) around ``runner.submit``, inside the
    runner: on Ray one logical CPU, ``crash_retries`` re-runs after a worker death and, for a learner,
    its GPUs (:func:`learner_gpus`) and ``SPREAD`` placement; nothing on the other engines."""
    if rt.engine != "ray":
        yield
        return
    import ray
    from prefect_ray.context import remote_options

    cluster = ray.cluster_resources().get("GPU", 0)
    gpus = learner_gpus(rt, d.learners, cluster) if role == "learner" else 0
    # learners spread over the nodes (best effort): a lost node takes as few learners as it can
    spread = {"scheduling_strategy": "SPREAD"} if role in ("learner", "dp-host") else {}
    # a DP host's task is never re-run by Ray: its job restarts every host (flows.dp_hosts)
    retries = 0 if role == "dp-host" else crash_retries(d, role)
    with remote_options(num_cpus=1, num_gpus=gpus, max_retries=retries, **spread):
        yield


@contextlib.contextmanager
def engine_session(rt: RuntimeConfig, slots: int) -> Iterator[None]:
    """Around a process engine's use: workers get the Prefect API URL of Prefect's temporary server when no
    ``PREFECT_API_URL`` is set, and Ray without ``runtime.address`` a local instance of ``slots`` CPUs
    (:func:`start_local_ray`), shut down when the block ends. Nothing happens for the thread engine."""
    if rt.engine == "threads":
        yield
        return
    share_accelerators(rt)  # (the workers start from here)
    # the run's own Ray instance (RayTaskRunner uses it and leaves its shutdown to us)
    local = rt.engine == "ray" and rt.address is None
    cluster = start_local_ray(ray_init_kwargs(rt, slots)) if local else contextlib.nullcontext()
    api = contextlib.nullcontext()
    if not get_current_settings().api.url:  # the process's temporary server (a singleton), started if need be
        from prefect.server.api.server import SubprocessASGIServer

        from flows.server import api_for_workers

        server = SubprocessASGIServer()
        server.start()
        api = api_for_workers(server.api_url)
    with api, cluster:
        yield
