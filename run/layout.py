"""The one owner of the run directory's layout: every path of a run, by stage and method.

A run directory holds one pipeline run (``docs/contracts.md``)::

    RUN/config.json, status.json          the resolved config; the run's state (run.directory)
    RUN/data/                             prepared data (data/ package): manifest, tokenizer, splits
    RUN/pretrain/chaos.json               the chaos schedule both pretraining methods replayed
    RUN/<stage>/<method>/                 one trained model: stage ∈ pretrain, finetune;
        summary.json                      method ∈ diloco, dp, ...
        checkpoints/<step>/               Orbax steps (training.checkpoint)
        metrics/<name>.jsonl              eval, train, merges, learners, events (flat JSON lines)
        tensorboard/, tensorboard/learner-<m>/   the same metrics as TensorBoard event files (run.tracking)
        learners/<m>/resume/              a DiLoCo learner's resume point (Orbax)
        resume/                           DP's rollback checkpoints under chaos (Orbax)
        exchange/                         a DiLoCo run's durable exchange (diloco.exchange.fsspec)
        syncer/state/<step>/              its syncer's checkpoints (Orbax; diloco.syncer_journal)
        seeds/<s>/checkpoints/<step>/     fine-tuning: the checkpoints of the seeds after the first
        adapters/<step>/, seeds/<s>/adapters/<step>/   LoRA fine-tuning: the adapters alone (Orbax)
    RUN/finetune/data/                    the fine-tuning task's items (data.finetune)
    RUN/eval/<stage>/<method>.json        evaluation of that model (+ eval/<stage>/<method>/ outputs)
    RUN/report/                           report.md, report.html (self-contained), report.json, figures
    RUN/tensorboard/                      the run's settings and final figures (TensorBoard HParams)
    RUN/wandb/                            Weights & Biases runs, when tracking.wandb is on
    RUN/cache/xla/                        JAX's persistent compilation cache (runtime.compilation_cache)

A run of several seeds (``seeds: [...]``) holds its data and its report (over seeds) at the top,
and one whole run directory per seed, laid out as above, its ``data/`` hard links to the top's::

    RUN/seeds/seed-<s>/                   seed s's run: config.json (seed s), status.json, pretrain/, ...

Every writer and reader asks this module for its paths; the report discovers which stages and
methods a run holds with :meth:`RunLayout.methods` (a method exists once its folder holds a
``summary.json`` or an ``eval`` metrics file). Roots may be local paths or fsspec URLs
(``memory://…``, ``s3://…``): paths are ``upath.UPath`` objects, plain ``pathlib.Path`` subclasses
for local roots. No Prefect and no JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from upath import UPath

STAGES = ("pretrain", "finetune")
METHOD_ORDER = ("diloco", "dp")  # report order; other methods follow, sorted by name
METRICS = ("eval", "train", "merges", "learners", "events")
RESULT_ENTRIES = (*STAGES, "eval", "report", "seeds", "status.json")  # a folder holding any of these is a run
REUSABLE_ENTRIES = ("data", "config.json")
REPORT_JSON = "report.json"  # a report's record, beside report.md (RunLayout.report_json)
SWEEP_RECORD = "sweep.json"  # what makes a folder a sweep (SweepLayout.record)
STUDY_RECORD = "tune.json"  # what makes a folder a study (StudyLayout.record)
HELDOUT_FILE = "heldout_{split}.jsonl"  # in RUN/data/: a held-out split's documents as text (RunLayout.heldout)
PAIRS_FILE = "pairs_{split}.jsonl"  # in RUN/finetune/data/: the fine-tuning task's pairs (RunLayout.finetune_pairs)


def _check_name(kind: str, name: str, allowed: tuple[str, ...] | None = None) -> None:
    if allowed is not None and name not in allowed:
        raise ValueError(f"unknown {kind} {name!r}; one of {', '.join(allowed)}")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{kind} name {name!r} must be a plain folder name")


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run directory. ``root``: a local path or an fsspec URL.

    Methods return ``UPath`` objects and create nothing; writers create parents as they write.
    ``ValueError`` for an unknown stage, a metrics name outside :data:`METRICS`, or a method or
    learner name that is not a plain folder name.
    """

    root: UPath

    def __init__(self, root: str | Path | UPath):
        object.__setattr__(self, "root", root if isinstance(root, UPath) else UPath(root))

    # -- the run as a whole ----------------------------------------------------------------------
    @property
    def config(self) -> UPath:
        return self.root / "config.json"

    @property
    def status(self) -> UPath:
        return self.root / "status.json"

    @property
    def data(self) -> UPath:
        """The prepared data folder (its contents belong to the ``data`` package)."""
        return self.root / "data"

    @property
    def manifest(self) -> UPath:
        return self.data / "manifest.json"

    @property
    def report(self) -> UPath:
        return self.root / "report"

    @property
    def report_md(self) -> UPath:
        return self.report / "report.md"

    @property
    def report_html(self) -> UPath:
        """The report as one self-contained HTML file (figures inlined), beside report.md."""
        return self.report / "report.html"

    @property
    def report_json(self) -> UPath:
        return self.report / REPORT_JSON

    @property
    def chaos_schedule(self) -> UPath:
        """The pretraining chaos schedule both methods replayed (``configs.chaos.ChaosSchedule`` JSON)."""
        return self.root / "pretrain" / "chaos.json"

    def seed_run(self, seed: int) -> UPath:
        """The run directory of one seed of a run of several seeds."""
        return self.root / "seeds" / f"seed-{int(seed)}"

    # -- one trained model: a stage and a method --------------------------------------------------
    def stage_dir(self, stage: str) -> UPath:
        """The folder of every method of ``stage`` (``RUN/<stage>/``)."""
        _check_name("stage", stage, STAGES)
        return self.root / stage

    def method_dir(self, stage: str, method: str) -> UPath:
        _check_name("stage", stage, STAGES)
        _check_name("method", method)
        if stage == "finetune" and method == "data":
            raise ValueError("method name 'data' is taken by the fine-tuning task's items; pick another")
        return self.root / stage / method

    def summary(self, stage: str, method: str) -> UPath:
        return self.method_dir(stage, method) / "summary.json"

    def checkpoints(self, stage: str, method: str, seed_dir: int | None = None) -> UPath:
        """``<stage>/<method>/checkpoints``, or with ``seed_dir`` a further fine-tuning seed's
        ``<stage>/<method>/seeds/<seed>/checkpoints``."""
        if seed_dir is None:
            return self.method_dir(stage, method) / "checkpoints"
        if not isinstance(seed_dir, int) or seed_dir < 0:
            raise ValueError(f"seed must be an int ≥ 0, got {seed_dir!r}")
        return self.method_dir(stage, method) / "seeds" / str(seed_dir) / "checkpoints"

    def adapters(self, stage: str, method: str, seed_dir: int | None = None) -> UPath:
        """A LoRA fine-tuning's adapter-only checkpoint (Orbax steps; ``training.finetune``):
        ``<stage>/<method>/adapters``, or with ``seed_dir`` ``<stage>/<method>/seeds/<seed>/adapters``,
        beside the merged model's :meth:`checkpoints`."""
        return self.checkpoints(stage, method, seed_dir).parent / "adapters"

    @property
    def finetune_data(self) -> UPath:
        """The fine-tuning task's prepared items (their contents belong to ``data.finetune``)."""
        return self.root / "finetune" / "data"

    def heldout(self, split: str) -> UPath:
        """A held-out split's documents as text (``data.text``): ``RUN/data/heldout_<split>.jsonl``,
        split ∈ val, test, finetune."""
        return self.data / HELDOUT_FILE.format(split=split)

    def finetune_pairs(self, split: str) -> UPath:
        """The fine-tuning task's prompt/response pairs (``data.finetune``):
        ``RUN/finetune/data/pairs_<split>.jsonl``, split ∈ train, test."""
        return self.finetune_data / PAIRS_FILE.format(split=split)

    def metrics(self, stage: str, method: str, name: str) -> UPath:
        """``eval`` (held-out loss over tokens), ``train`` (training loss), ``merges`` and
        ``learners`` (DiLoCo's syncer merges and learner events), ``events`` (DP's chaos events:
        failures, restores, checkpoints, slowdowns)."""
        _check_name("metrics file", name, METRICS)
        return self.method_dir(stage, method) / "metrics" / f"{name}.jsonl"

    def tensorboard(self, stage: str, method: str) -> UPath:
        """A method's TensorBoard event files (``run.tracking``); a DiLoCo learner's in ``learner-<m>/`` below."""
        return self.method_dir(stage, method) / "tensorboard"

    @property
    def run_tensorboard(self) -> UPath:
        """The run's settings and final figures for TensorBoard's HParams tab (``run.tracking.write_hparams``)."""
        return self.root / "tensorboard"

    @property
    def wandb(self) -> UPath:
        """The run's Weights & Biases folder (``wandb.init(dir=...)``: offline runs in ``wandb/offline-run-*``)."""
        return self.root / "wandb"

    @property
    def compile_cache(self) -> UPath:
        """JAX's persistent compilation cache of the run (``runtime.compilation_cache: run``); a seed's
        run (``RUN/seeds/seed-<s>``) shares its parent run's, since every seed compiles the same steps."""
        root = self.root
        if root.parent.name == "seeds" and root.name.startswith("seed-"):
            root = root.parent.parent
        return root / "cache" / "xla"

    def resume_point(self, stage: str, method: str, learner: int) -> UPath:
        """Learner ``learner``'s resume point (an Orbax checkpoint folder)."""
        if not isinstance(learner, int) or learner < 0:
            raise ValueError(f"learner index must be an int ≥ 0, got {learner!r}")
        return self.method_dir(stage, method) / "learners" / f"{learner:02d}" / "resume"

    def job_resume(self, stage: str, method: str) -> UPath:
        """A synchronous job's (DP's) rollback checkpoints (Orbax: parameters, optimizer state, cursor)."""
        return self.method_dir(stage, method) / "resume"

    def job_hosts(self, stage: str, method: str) -> UPath:
        """A job of several host processes' shared files (DP with ``dp.hosts`` > 1: its config, each
        generation's plan, coordinator address, stop and abort markers and host logs;
        ``training.dp_job.HostFiles``)."""
        return self.method_dir(stage, method) / "hosts"

    def network(self, stage: str, method: str) -> UPath:
        """A stage's emulated datacenters (``network.emulate``, ``flows.datacenters``): its files are
        :class:`NetworkFolder`'s."""
        _check_name("method", method)
        return self.stage_dir(stage) / "network" / method  # (made before the method's own folder)

    def syncer_state(self, stage: str, method: str) -> UPath:
        """A DiLoCo syncer's checkpoints (Orbax steps of its state, ``training.checkpoint.OrbaxSyncerStore``)."""
        return self.method_dir(stage, method) / "syncer" / "state"

    def exchange(self, stage: str, method: str) -> UPath:
        """The durable exchange of a DiLoCo run when it uses one (``diloco.exchange.fsspec``)."""
        return self.method_dir(stage, method) / "exchange"

    def eval_dir(self, stage: str) -> UPath:
        """The evaluations of every method of ``stage`` (``RUN/eval/<stage>/``)."""
        _check_name("stage", stage, STAGES)
        return self.root / "eval" / stage

    def eval_result(self, stage: str, method: str) -> UPath:
        _check_name("method", method)
        return self.eval_dir(stage) / f"{method}.json"

    def eval_outputs(self, stage: str, method: str) -> UPath:
        """Per-task outputs of the evaluation harness (samples, lm-eval's own files)."""
        return self.eval_result(stage, method).with_suffix("")

    # -- discovery ----------------------------------------------------------------------------------
    def holds_results(self, stage: str, method: str) -> list[UPath]:
        """What already exists of ``stage``/``method`` (empty: nothing; a new training may start)."""
        d = self.method_dir(stage, method)
        return [p for p in (d, self.eval_result(stage, method)) if p.exists()]

    def stages(self) -> list[str]:
        """Stages with at least one method, in pipeline order."""
        return [s for s in STAGES if self.methods(s)]

    def methods(self, stage: str) -> list[str]:
        """Methods ``stage`` holds (a folder with ``summary.json`` or ``metrics/eval.jsonl``, or an
        evaluation result), known methods first (:data:`METHOD_ORDER`), then others by name."""
        _check_name("stage", stage, STAGES)
        found: set[str] = set()
        base = self.root / stage
        if base.is_dir():
            for d in base.iterdir():
                if d.is_dir() and ((d / "summary.json").exists() or (d / "metrics" / "eval.jsonl").exists()):
                    found.add(d.name)
        evals = self.root / "eval" / stage
        if evals.is_dir():
            found.update(p.stem for p in evals.iterdir() if p.suffix == ".json")
        return sorted(found, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m))


# -- folders that hold runs -------------------------------------------------------------------------
@dataclass(frozen=True)
class DPCacheLayout:
    """A DP cache (``dp_cache``: a sweep's or a study's ``dp/``): one trained DP per settings digest,
    and its evaluation per DP result and ``eval`` section (``flows.pipeline``)::

        CACHE/<dp_digest>/                 a copy (hard links) of a run's ``pretrain/dp/``
        CACHE/<dp_digest>.lock             held while one run trains that DP
        CACHE/eval/<dp_eval_digest>/       dp.json (its evaluation), dp/ (the harness's outputs)
        CACHE/eval/<dp_eval_digest>.lock   held while one run evaluates it
    """

    root: Path

    def trained(self, digest: str) -> Path:
        return Path(self.root) / digest

    def trained_summary(self, digest: str) -> Path:
        return self.trained(digest) / "summary.json"

    def lock(self, digest: str) -> Path:
        return Path(self.root) / f"{digest}.lock"

    def evaluation(self, digest: str) -> Path:
        return Path(self.root) / "eval" / digest

    def evaluation_result(self, digest: str) -> Path:
        return self.evaluation(digest) / "dp.json"

    def evaluation_outputs(self, digest: str) -> Path:
        return self.evaluation(digest) / "dp"

    def evaluation_lock(self, digest: str) -> Path:
        return Path(self.root) / "eval" / f"{digest}.lock"


@dataclass(frozen=True)
class _FolderOfRuns:
    """What a sweep folder and a study folder share: their DP cache and their report folder."""

    root: Path

    @property
    def dp_cache(self) -> Path:
        return Path(self.root) / "dp"

    @property
    def report(self) -> Path:
        return Path(self.root) / "report"


@dataclass(frozen=True)
class SweepLayout(_FolderOfRuns):
    """Paths of a sweep folder (``flows.sweep``)::

    SWEEP/sweep.json                 the sweep's record (cells, their status, wall time)
    SWEEP/cells/<cell>/              one run directory per cell (:class:`RunLayout`)
    SWEEP/attempts/<cell>-<n>/       a cell's earlier attempt, moved aside by a re-run
    SWEEP/dp/                        the DP cache shared by the cells (:class:`DPCacheLayout`)
    SWEEP/report/                    comparison.md, .json, .csv, figures (reports.compare)
    """

    root: Path

    @property
    def record(self) -> Path:
        return Path(self.root) / SWEEP_RECORD

    def cell(self, name: str) -> Path:
        _check_name("cell", name)
        return Path(self.root) / "cells" / name

    @property
    def attempts(self) -> Path:
        return Path(self.root) / "attempts"

    @property
    def comparison_md(self) -> Path:
        return self.report / "comparison.md"


@dataclass(frozen=True)
class StudyLayout(_FolderOfRuns):
    """Paths of a tuning study's folder (``flows.tune``)::

    STUDY/tune.json                  the study's record (spec, best settings, tuned comparison)
    STUDY/optuna.log                 Optuna's journal storage of every study of it
    STUDY/trials/<study>-<n>/        trial n's run directory (:class:`RunLayout`)
    STUDY/tuned/<name>/              the comparison of the best settings over seeds
    STUDY/attempts/tuned-<name>-<n>/ an earlier tuned comparison, moved aside
    STUDY/dp/                        the DP cache of its trials and comparison
    STUDY/report/                    study.md, study.json, figures (reports.study)
    """

    root: Path

    @property
    def record(self) -> Path:
        return Path(self.root) / STUDY_RECORD

    @property
    def journal(self) -> Path:
        return Path(self.root) / "optuna.log"

    def trial(self, study: str, number: int) -> Path:
        _check_name("study", study)
        return Path(self.root) / "trials" / f"{study}-{int(number)}"

    def tuned(self, name: str) -> Path:
        _check_name("tuned comparison", name)
        return Path(self.root) / "tuned" / name

    @property
    def tuned_runs(self) -> list[Path]:
        """The tuned comparisons present, by name."""
        return sorted(p for p in (Path(self.root) / "tuned").glob("*/"))

    def attempt(self, name: str, n: int) -> Path:
        return Path(self.root) / "attempts" / f"tuned-{name}-{int(n)}"

    @property
    def study_md(self) -> Path:
        return self.report / "study.md"

    @property
    def study_json(self) -> Path:
        return self.report / "study.json"


@dataclass(frozen=True)
class GoodputLayout:
    """Paths of a goodput study's folder (``flows.goodput``, ``sim.outputs``)::

    OUT/config.json                  the study's GoodputConfig
    OUT/goodput.json                 everything (its presence: the folder holds a goodput run)
    OUT/goodput.md                   the tables against the paper's Table 1
    OUT/goodput.png                  goodput against chips
    """

    root: Path

    @property
    def config(self) -> Path:
        return Path(self.root) / "config.json"

    @property
    def result(self) -> Path:
        return Path(self.root) / "goodput.json"

    @property
    def markdown(self) -> Path:
        return Path(self.root) / "goodput.md"

    @property
    def figure(self) -> Path:
        return Path(self.root) / "goodput.png"


@dataclass(frozen=True)
class NetworkFolder:
    """A stage's emulated datacenters (``RunLayout.network``; ``flows.datacenters``)::

    NET/network.json                 what was emulated and the bytes each link carried
    NET/datacenters.json             the namespaces and addresses (``run.netem.Datacenters``)
    NET/config.json                  DiLoCo's stage config (its exchange URL on the hub's S3 server)
    NET/store.log                    that S3 server's output
    NET/learner-<m>-attempt-<a>.json, .log   a learner process's summary and output
    """

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    record = property(lambda self: self.root / "network.json")
    datacenters = property(lambda self: self.root / "datacenters.json")
    config = property(lambda self: self.root / "config.json")
    store_log = property(lambda self: self.root / "store.log")

    def attempt(self, learner: int, attempt: int, suffix: str) -> Path:
        """Learner ``learner``'s attempt ``attempt``: ``suffix`` ``.json`` its summary, ``.log`` its output."""
        return self.root / f"learner-{learner}-attempt-{attempt}{suffix}"


@dataclass(frozen=True)
class HostsFolder:
    """The shared files of a job of host processes (DP with ``dp.hosts`` > 1; ``RunLayout.job_hosts``,
    ``training.dp_job``) and of its generation ``generation``::

    HOSTS/config.json, progress.json   the job's config; host 0's last step
    HOSTS/gen-<g>/plan.json            the generation's plan (``training.dp.Generation``)
    HOSTS/gen-<g>/coordinator          ``HOST:PORT`` of host 0
    HOSTS/gen-<g>/stop, abort          ``{"at_step": S}``; the launcher ends the generation
    HOSTS/gen-<g>/failed-<r>.json      host r's scheduled failure
    HOSTS/gen-<g>/summary.json, host-<r>.log   host 0's summary; host r's output
    """

    root: Path
    generation: int = 0

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    config = property(lambda self: self.root / "config.json")
    progress = property(lambda self: self.root / "progress.json")
    gen = property(lambda self: self.root / f"gen-{self.generation}")
    plan = property(lambda self: self.gen / "plan.json")
    coordinator = property(lambda self: self.gen / "coordinator")
    stop = property(lambda self: self.gen / "stop")
    abort = property(lambda self: self.gen / "abort")
    summary = property(lambda self: self.gen / "summary.json")

    def failed(self, rank: int) -> Path:
        return self.gen / f"failed-{rank}.json"

    def log(self, rank: int) -> Path:
        return self.gen / f"host-{rank}.log"
