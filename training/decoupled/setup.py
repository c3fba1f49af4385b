"""Setting a Decoupled DiLoCo run up from plain inputs: the exchange, the syncer side and each learner's attempt.

``prepare_diloco(cfg, run_dir)`` (the process that runs the flow) builds Θ₀ and the fragments and
creates the run's exchange holding version 0 of every fragment: in process memory, registered under
the run directory (``runtime.exchange`` memory), or as durable objects at an fsspec URL (fsspec).
``open_syncer(cfg, run_dir, attempt)`` (the syncer task's process, which may be another one) opens
that exchange, takes office as its syncer (fencing out any earlier one) and builds the syncer from
Θ₀ (``training.decoupled.syncer`` runs it); with the fsspec exchange a restarted syncer then resumes
from its checkpoint and journal (``diloco.syncer_journal``).
``learner_attempt(cfg, run_dir, m, attempt)`` takes only plain, serialisable inputs and rebuilds
everything a learner needs from them, in any process: the model spec and compiled step (shared by
the learners of one process on the same devices: ``runtime.devices_per_learner`` of them,
``training.mesh.learner_devices``), its shard and data cursor, its resume point and the exchange
handle. ``setup_diloco`` = prepare + open in one process. Each of these entry points splits the
config once (:class:`~training.decoupled.plan.DiLoCoPlan`); what they call reads the plan, or the one
section it needs. What this process keeps between calls (compiled steps, turns, exchange handles) is
one :class:`ProcessCache`, ``CACHE``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from configs.runtime import RuntimeConfig
from configs.schema import ExperimentConfig, validate_against_model
from data.cursor import batch_at
from data.prepare import load_rows
from diloco.exchange import InMemoryExchange, open_exchange, register_exchange
from diloco.exchange.fsspec import FsspecExchange
from diloco.faults import LearnerFaults
from diloco.fragments import balanced_fragments
from diloco.learner import LearnerSetup, run_learner
from diloco.pacing import FairTurns, HostTurns
from diloco.receipt import receipt_rule
from diloco.syncer import Syncer
from diloco.syncer_journal import SyncerJournal
from diloco.tensors import embedding_names, tensor_bytes, to_numpy
from diloco.wire import WireFormat
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter, read_jsonl
from run.records import StateEvent
from training.checkpoint import OrbaxResumeStore, OrbaxSyncerStore
from training.common import compilation_cache_dir, ensure_fresh, model_spec, save_chaos_schedule
from training.decoupled import METHOD, STAGE
from training.decoupled.plan import DiLoCoPlan
from training.decoupled.syncer import DiLoCoRun, syncer_settings
from training.evaluation import heldout_metrics, val_batches
from training.mesh import learner_devices, single_default
from training.optimizers import lr_schedule, make_inner_tx
from training.step import Trainer
from training.tracking import method_tracker


def run_key(run_dir: str | Path) -> str:
    """A run directory as this process keys it: absolute."""
    return str(Path(run_dir).absolute())


class ProcessCache:
    """What this process keeps for the DiLoCo runs it serves, shared by its threads (the flow, the
    syncer, the learners) under one lock; each entry is made once, threads asking at once wait for it:

    * ``trainers``: the compiled learner step (:func:`learner_trainer`), by (``repr(plan)``, run
      directory, device slice as ``(platform, id)`` pairs or None for the default device);
    * ``turns``: the first-come turns of the run's learner threads (:func:`learner_turns`; None:
      unpaced), by (run directory, accelerator slice or None: every CPU learner shares one set);
    * ``exchanges``: the handle on a run's fsspec exchange that its learners in this process share
      (:func:`open_run_exchange`; the syncer opens its own), by URL.

    Run directories are keyed absolute (:func:`run_key`). Nothing is ever cleared: an entry lives as
    long as the process, which serves one run (a test or benchmark process may serve several, one
    entry each). The in-process exchange is registered apart, in ``diloco.exchange``, by :func:`run_key`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trainers: dict[tuple, Trainer] = {}
        self.turns: dict[tuple, FairTurns | None] = {}
        self.exchanges: dict[str, FsspecExchange] = {}

    def get(self, table: dict, key: Hashable, make: Callable[[], Any]) -> Any:
        """``table[key]`` (``table``: one of the three above), made by ``make()`` the first time."""
        with self.lock:
            if key not in table:
                table[key] = make()
            return table[key]


CACHE = ProcessCache()


def _absolute(url: str) -> str:
    """A local path without a protocol (relative, or with ``~``) made absolute in this process; any
    other URL as it is."""
    url = url.rstrip("/")
    if "://" not in url and "::" not in url and not url.startswith(("file:", "local:")):
        return str(Path(url).expanduser().absolute())
    return url


def with_absolute_exchange(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with ``runtime.exchange_url`` made absolute (:func:`_absolute`) in the calling process:
    the flow does it once, before any task starts, so worker processes started in another folder (a
    Ray or Dask cluster) open the same exchange."""
    url = cfg.runtime.exchange_url
    if not url or _absolute(url) == url:
        return cfg
    return cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"exchange_url": _absolute(url)})})


def exchange_url(runtime: RuntimeConfig, run_dir: str | Path) -> str:
    """Where the run's fsspec exchange lives: ``runtime.exchange_url``/<run directory name>, or
    ``pretrain/diloco/exchange`` inside the run directory. The flow passes its tasks a config whose
    URL is already absolute (:func:`with_absolute_exchange`) and an absolute run directory."""
    if runtime.exchange_url:
        return f"{_absolute(runtime.exchange_url)}/{Path(run_dir).absolute().name}"
    return str(RunLayout(Path(run_dir).absolute()).exchange(STAGE, METHOD))


def open_run_exchange(runtime: RuntimeConfig, run_dir: str | Path):
    """This process's handle on the run's exchange (``runtime.exchange``; one per run and process,
    shared by its threads).

    Raises ``LookupError`` (memory: the run was set up in another process) or ``FileNotFoundError``
    (fsspec: nothing created at the URL yet)."""
    if runtime.exchange_kind == "memory":
        return open_exchange(run_key(run_dir))
    url = exchange_url(runtime, run_dir)
    return CACHE.get(CACHE.exchanges, url, lambda: FsspecExchange.open(url, poll_s=runtime.exchange_poll_s))


def learner_trainer(plan: DiLoCoPlan, run_dir: str | Path, devices: Sequence[jax.Device] | None = None) -> Trainer:
    """One compiled learner step per run, process and device slice, shared by the learners on that
    slice (no recompiles); learners on other devices get their own.

    ``devices``: the slice (``training.mesh.learner_devices``); None, or just the default device,
    is the default device (the syncer's side: Θ₀, fragments, held-out evaluation)."""
    placed = None if single_default(devices) else tuple(devices)
    key = (repr(plan), run_key(run_dir), None if placed is None else tuple((d.platform, d.id) for d in placed))

    def make() -> Trainer:
        tx = make_inner_tx(plan.diloco.inner, plan.learner_steps)
        spec = model_spec(plan.model, plan.data, plan.runtime, run_dir)
        return Trainer(spec, tx, plan.learner_microbatches, seed=plan.seed, devices=placed, precision=plan.precision)

    return CACHE.get(CACHE.trainers, key, make)


def host_turns_dir(run_dir: str | Path) -> Path:
    """The folder in which the learner processes of one run on this host take turns
    (:class:`~diloco.pacing.HostTurns`): under the host's temporary folder, so learners on other
    hosts never pace against these."""
    digest = hashlib.sha1(run_key(run_dir).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "ddiloco-turns" / digest


def learner_turns(
    plan: DiLoCoPlan, run_dir: str | Path, devices: Sequence[jax.Device] | None = None
) -> FairTurns | HostTurns | None:
    """The turns learner steps take on this host (``diloco.compute_slots``; None when 0): between
    the threads of this process on the thread engine, between the learner processes of this host
    on Ray and Dask and in emulated datacenters (none for a Ray learner with GPUs of its own).

    Threads: ``devices`` is the learner's slice (``training.mesh.learner_devices``). On accelerators
    the learners of one slice take turns and those of different slices never wait for each other
    (learner m on GPU m computes while learner m' computes on GPU m'); on CPU every learner takes
    turns with every other (CPU devices, even several, are the same cores)."""
    slots = plan.diloco.compute_slots
    if not plan.learner_processes or not slots:
        own = None
        if devices is not None and any(d.platform != "cpu" for d in devices):
            own = tuple((d.platform, d.id) for d in devices)
        return CACHE.get(CACHE.turns, (run_key(run_dir), own), lambda: FairTurns(slots) if slots else None)
    if plan.runtime.engine == "ray" and _ray_gpu_ids():
        return None  # GPUs of its own (runtime.learner_gpus): nothing on this host to take turns on
    return HostTurns(host_turns_dir(run_dir), slots)


def _ray_gpu_ids() -> list:
    """The GPUs Ray reserved for this worker's task ([] outside a Ray worker)."""
    try:
        import ray
    except ImportError:
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


def run_fragments(trainer: Trainer, parts: int) -> list[list[str]]:
    """The run's P = ``parts`` fragments (``diloco.fragments``): derived from the parameter sizes
    alone, so the syncer and every learner attempt, in any process, get the same partition without
    exchanging it."""
    return balanced_fragments(tensor_bytes(trainer.param_shapes), parts)


def initial_fragments(plan: DiLoCoPlan, run_dir: str | Path) -> list[dict[str, np.ndarray]]:
    """Θ₀ split into the run's fragments: per fragment, parameter name → float32 array. Raises
    ``ValueError`` if P exceeds the model's tensors."""
    trainer = learner_trainer(plan, run_dir)
    theta0 = to_numpy(trainer.init_params())
    validate_against_model(plan.diloco, len(theta0))
    return [{k: theta0[k] for k in names} for names in run_fragments(trainer, plan.diloco.fragments)]


def prepare_diloco(cfg: ExperimentConfig, run_dir: str | Path):
    """Create the run's exchange holding Θ₀ (version 0 of every fragment) and the token budget; the
    in-process one is registered for the learners and syncer of this process. Returns it.

    Raises ``FileExistsError`` if ``run_dir`` already holds DiLoCo results (or the fsspec exchange
    URL already holds an exchange), ``ValueError`` if P exceeds the model's tensors or (thread
    engine: the learners run in this process) ``runtime.devices_per_learner`` does not fit this
    process's devices (more than there are, or not a divisor of their number).
    """
    run_dir = Path(run_dir)
    ensure_fresh(run_dir, STAGE, METHOD)
    save_chaos_schedule(cfg.chaos_schedule(), run_dir)
    plan = DiLoCoPlan.of(cfg)
    if not plan.learner_processes:  # the learners run in this process: refused before any starts
        learner_devices(0, plan.runtime.devices_per_learner)
    if plan.runtime.exchange_kind == "memory":
        exchange = initial_exchange(plan, run_dir)
        register_exchange(run_key(run_dir), exchange)
        return exchange
    return FsspecExchange.create(
        exchange_url(plan.runtime, run_dir),
        initial=initial_fragments(plan, run_dir),
        num_learners=plan.diloco.learners,
        token_budget=plan.token_budget,
        # every learner starts with, and is topped up by, one sync period of inner steps' tokens
        grant_tokens=plan.diloco.sync_every * plan.tokens_per_learner_step,
        poll_s=plan.runtime.exchange_poll_s,
    )


def open_syncer(cfg: ExperimentConfig, run_dir: str | Path, attempt: int = 1) -> DiLoCoRun:
    """The syncer side of the run prepared by :func:`prepare_diloco`, in this process: opens the
    exchange, takes office (fencing out any earlier syncer) and builds the syncer from Θ₀.

    With the fsspec exchange the syncer gets its own handle on the exchange (never the one this
    process's learners share: a restarted syncer must not inherit what a failed one drained) and a
    :class:`~diloco.syncer_journal.SyncerJournal` with its checkpoints in
    ``RunLayout.syncer_state``; :func:`run_syncer_to_end` recovers from them first (a fresh run has
    neither and starts exactly as before). ``attempt``: the syncer task's attempt (1, 2, …), raised
    to the exchange's generation (an engine's re-run of a dead worker), which picks its scheduled
    ``syncer_fail`` event of ``chaos.events``.
    """
    run_dir, plan = Path(run_dir), DiLoCoPlan.of(cfg)
    layout, rt = RunLayout(run_dir), plan.runtime
    trainer = learner_trainer(plan, run_dir)
    fragments = run_fragments(trainer, plan.diloco.fragments)
    journal, resumed = None, False
    if rt.exchange_kind == "memory":
        exchange = open_run_exchange(rt, run_dir)
        generation = exchange.take_office()
        theta = {k: v for p in range(len(fragments)) for k, v in exchange.latest(p)[1].items()}
    else:
        exchange = FsspecExchange.open(exchange_url(rt, run_dir), poll_s=rt.exchange_poll_s)
        resumed = exchange.generation() > 0
        generation = exchange.take_office()
        theta = {k: v for p in range(len(fragments)) for k, v in exchange.origin(p).items()}
        journal = SyncerJournal(
            exchange, OrbaxSyncerStore(layout.syncer_state(STAGE, METHOD)), plan.diloco.syncer_checkpoint_every_s
        )
    syncer = Syncer(theta, fragments, syncer_settings(plan.diloco), embedding_names(theta))
    merges_path = layout.metrics(STAGE, METHOD, "merges")
    tracker = method_tracker(cfg, run_dir, STAGE, METHOD)
    logged = {(int(r["fragment"]), int(r["version"])) for r in read_jsonl(merges_path)} if resumed else set()
    return DiLoCoRun(
        plan=plan,
        run_dir=run_dir,
        exchange=exchange,
        syncer=syncer,
        trainer=trainer,
        merges_log=JsonlWriter(merges_path, sink=tracker.sink("merges")),
        learners_log=JsonlWriter(layout.metrics(STAGE, METHOD, "learners")),
        eval_log=JsonlWriter(layout.metrics(STAGE, METHOD, "eval"), sink=tracker.sink("eval")),
        tracker=tracker,
        val=val_batches(load_rows(run_dir, "val"), plan.train.eval_batches, plan.train.eval_batch_size),
        generation=generation,
        # a syncer whose process died is re-run by the engine without counting a Prefect retry: the
        # exchange's generation counts every syncer that took office in this run
        attempt=max(attempt, generation),
        journal=journal,
        resumed=resumed,
        logged_merges=logged,
        merges=len(logged),
    )


def setup_diloco(cfg: ExperimentConfig, run_dir: str | Path) -> DiLoCoRun:
    """:func:`prepare_diloco` and :func:`open_syncer` in this process (the thread engine, tests)."""
    prepare_diloco(cfg, run_dir)
    return open_syncer(cfg, run_dir)


def learner_setup(plan: DiLoCoPlan, run_dir: str | Path, learner: int, attempt: int, log, exchange) -> LearnerSetup:
    """Learner ``learner``'s setup for ``attempt`` on ``exchange`` (:func:`learner_attempt` opens it),
    from plain inputs. Its step runs on
    ``learner_devices(learner, runtime.devices_per_learner)`` (``ValueError`` if those do not fit)."""
    d = plan.diloco
    devices = learner_devices(learner, plan.runtime.devices_per_learner)
    trainer = learner_trainer(plan, run_dir, devices)
    seqs = load_rows(run_dir, f"shard_{learner:02d}")
    return LearnerSetup(
        learner=learner,
        attempt=attempt,
        step=trainer.step,
        init_params=trainer.init_params,
        init_opt=trainer.init_opt,
        next_batch=partial(batch_at, seqs, batch_size=d.batch_size, seed=plan.seed + 1000 * (learner + 1)),
        fragments=run_fragments(trainer, d.fragments),
        period=d.sync_every,
        tokens_per_step=plan.tokens_per_learner_step,
        receipt=receipt_rule(d.receipt, d.mix_alpha),
        exchange=exchange,
        log=log,
        stop=lambda: STOP.is_set() or exchange.stop_requested(),
        resume=OrbaxResumeStore(RunLayout(run_dir).resume_point(STAGE, METHOD, learner)),
        resume_every=d.resume_every_steps,
        faults=LearnerFaults.of(plan.fault_events, learner),
        turns=learner_turns(plan, run_dir, devices),
        overlap_steps=d.overlap_steps,
        wait_timeout_s=d.heartbeat_timeout_s,
        num_learners=d.learners,
        # threads of one process start together; processes seconds apart (the gate's docstring)
        start_wait_s=plan.runtime.start_wait_s if plan.learner_processes else 0.0,
        wire=WireFormat(d.wire.dtype, d.wire.block_size),
        lr=lr_schedule(d.inner, plan.learner_steps),
    )


def warm_compilation_cache(cfg: ExperimentConfig, run_dir: str | Path) -> float:
    """Compile the learner step and the held-out evaluation here, into the run's compilation cache
    (``runtime.compilation_cache``), so that the learner and syncer processes of a process engine
    load them instead of each compiling them at once: the flow calls it right after submitting
    their tasks, while the workers still import. Runs one step on learner 0's first batch and one
    evaluation batch on throw-away copies of Θ₀ (nothing is logged or kept). Returns the seconds
    it took; 0.0 when the cache is off.

    Measured in ``benchmarks/engines.py`` (its ``-uncached`` arms): the saving shows in the training
    seconds, since a learner compiles its step at its first step."""
    if compilation_cache_dir(cfg.runtime, run_dir) is None:
        return 0.0
    t0 = time.perf_counter()
    trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir)
    params = trainer.init_params()
    opt = trainer.init_opt(params)
    batch, _, _ = batch_at(load_rows(run_dir, "shard_00"), 0, 0, batch_size=cfg.diloco.batch_size, seed=cfg.seed)
    val = val_batches(load_rows(run_dir, "val"), 1, cfg.train.eval_batch_size)
    heldout_metrics(trainer.evaluate, params, val)
    _, _, metrics = trainer.step(params, opt, jax.tree.map(jnp.asarray, batch))
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - t0


def learner_attempt(cfg: ExperimentConfig, run_dir: str | Path, learner: int, attempt: int, exchange=None) -> dict:
    """Run one attempt of learner ``learner`` (``diloco.learner.run_learner``) from plain inputs.

    ``exchange``: default, this process's handle on the run's exchange (:func:`open_run_exchange`).
    ``attempt`` is raised past the last attempt the exchange saw start (a process engine re-runs a
    killed learner without counting a Prefect retry). Raises whatever the attempt raised
    (``InjectedFailure`` for a scheduled failure); the task runner retries it, and the retry resumes
    from the saved resume point. An attempt whose set-up raises (e.g. ``ValueError``: its worker
    cannot meet ``runtime.devices_per_learner``) is a failure before its first step: it reports itself
    ``down`` to the exchange and logs a ``failure`` event (``before_start``) first, at the local step
    its earlier attempts reached (0 on a first attempt).
    """
    plan = DiLoCoPlan.of(cfg)
    exchange = exchange if exchange is not None else open_run_exchange(plan.runtime, run_dir)
    began_at = exchange.clock()
    seen = exchange.learners().get(learner, {})
    previous, last_step = seen.get("attempt"), int(seen.get("step") or 0)  # of its earlier attempts
    if previous is not None:
        attempt = max(attempt, int(previous) + 1)
    flops = model_spec(plan.model, plan.data, plan.runtime, run_dir).flops_per_unit
    devices = plan.runtime.devices_per_learner
    tracker = method_tracker(cfg, run_dir, STAGE, METHOD, flops_per_token=flops, devices=devices)
    log = JsonlWriter(RunLayout(run_dir).metrics(STAGE, METHOD, "learners"), sink=tracker.sink("learners"))
    try:
        try:
            setup = learner_setup(plan, run_dir, learner, attempt, log, exchange)
            setup.began_at = began_at
        except BaseException as exc:  # failed before its first step: logged as a failure all the same
            why = {"attempt": attempt, "reason": repr(exc), "step": last_step}
            exchange.heartbeat(learner, status="down", **why, pid=os.getpid())
            t = exchange.clock()
            log({"event": "failure", "learner": learner, **why, "t": t, "before_start": True})
            log(StateEvent(state="down", t=t, learner=learner, attempt=attempt, reason=why["reason"]).line())
            raise
        return run_learner(setup)
    finally:
        log.close()
        tracker.close()


def initial_exchange(plan: DiLoCoPlan, run_dir: str | Path) -> InMemoryExchange:
    """An exchange holding version 0 of every global fragment (Θ₀) and the run's token budget,
    with no syncer behind it: for a learner run on its own (a check of one learner, a test)."""
    initial = initial_fragments(plan, run_dir)
    exchange = InMemoryExchange(len(initial), plan.token_budget)
    for p, params in enumerate(initial):
        exchange.publish(p, 0, params)
    return exchange
