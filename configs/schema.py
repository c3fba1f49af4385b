"""The experiment config: one nested pydantic model per run, validated before any work starts.

Every YAML file in ``configs/`` loads into :class:`ExperimentConfig`. Unknown keys, wrong types and
inconsistent values (K > M, P larger than the number of parameter tensors, non-positive learning
rates or budgets, unknown sources or model kinds) raise :class:`pydantic.ValidationError` naming the
field. Checks that need the model (P versus tensor count) run in :func:`validate_against_model`,
which the pipeline calls before sharding any data.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    Field,
    ValidationInfo,
    model_validator,
)

from configs.base import _Strict
from configs.chaos import ChaosConfig, ChaosSchedule, draw_schedule, load_schedule
from configs.data import DataConfig, TextDataConfig
from configs.eval import EvalConfig
from configs.faults import LEARNER_FAILURES, DPFailEvent, FaultEvent, KillEvent, SyncerFailEvent
from configs.finetune import FinetuneConfig
from configs.methods import DiLoCoConfig, DPConfig, NetworkConfig, TrainConfig
from configs.model import TEXT_KINDS, VISION_KINDS, DenseLMConfig, ModelConfig
from configs.runtime import PrecisionConfig, RuntimeConfig
from configs.tracking import TrackingConfig


class ExperimentConfig(_Strict):
    """One run of the pipeline: shard → pretrain (DiLoCo, DP) → evaluate → fine-tune → report."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="run name (the run directory's prefix)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="model initialisation and data order seed")
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None,
        description="train, evaluate and fine-tune both methods once per seed (initialisation "
        "and data order, the same seed for both methods; the data split stays data.seed's): the report gives each "
        "figure as a mean with its 95 % interval over seeds and the gap DiLoCo − DP as a paired difference. Unset: "
        "one run with `seed` (no interval)",
    )
    run_root: str = Field("runs", description="local folder holding run directories")
    data: DataConfig = Field(default_factory=TextDataConfig)
    model: ModelConfig = Field(default_factory=DenseLMConfig, description="the model family and its shape")
    diloco: DiLoCoConfig = DiLoCoConfig()
    dp: DPConfig = DPConfig()
    train: TrainConfig = TrainConfig()
    chaos: ChaosConfig = ChaosConfig()
    eval: EvalConfig = EvalConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    precision: PrecisionConfig = PrecisionConfig()
    network: NetworkConfig = NetworkConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_seed(cls, data: Any) -> Any:
        """``seeds: [s]`` is the run of one seed ``seed: s`` (one config, one digest, one layout)."""
        if isinstance(data, dict) and isinstance(data.get("seeds"), list) and len(data["seeds"]) == 1:
            data = {**data, "seed": data["seeds"][0], "seeds": None}
        return data

    @property
    def run_seeds(self) -> list[int]:
        """The seeds the run trains each method with: ``seeds``, or ``[seed]``."""
        return list(self.seeds) if self.seeds else [self.seed]

    def for_seed(self, seed: int) -> ExperimentConfig:
        """This config as one seed's run: ``seed`` set, ``seeds`` unset."""
        return self.model_copy(update={"seed": seed, "seeds": None})

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if not self.diloco.enabled and not self.dp.enabled:
            raise ValueError("diloco.enabled and dp.enabled are both false: nothing would train; enable one")
        if self.seeds is not None and not self.seeds:
            raise ValueError(
                "seeds is empty: give two or more seeds, e.g. seeds: [0, 1, 2], or remove it (one run with seed)"
            )
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeats a seed; list each once")
        kinds = VISION_KINDS if self.data.modality == "image" else TEXT_KINDS
        if self.model.kind not in kinds:
            raise ValueError(
                f"model.kind {self.model.kind} does not take {self.data.modality} data (data.source: "
                f"{self.data.source}); use model.kind {' or '.join(kinds)}, or "
                f"{'text' if self.data.modality == 'image' else 'an image'} data.source"
            )
        ft = self.finetune
        if ft.enabled or ft.source is not None:
            task = self.finetune_task
            image_task = task == "rotation"
            if image_task != (self.data.modality == "image"):
                raise ValueError(
                    f"finetune.source {task} does not fit {self.data.modality} data (data.source: {self.data.source}); "
                    f"use {'rotation' if self.data.modality == 'image' else 'speakers, jsonl or hf'}"
                )
            if task == "speakers" and self.data.finetune_docs < 1:
                raise ValueError(
                    "finetune.source speakers builds its pairs from plays held out of pretraining: set "
                    "data.finetune_docs (e.g. 4), or pick finetune.source jsonl or hf"
                )
            if ft.seq_len is not None and self.data.modality == "text" and ft.seq_len > self.data.seq_len:
                raise ValueError(
                    f"finetune.seq_len ({ft.seq_len}) must be ≤ data.seq_len ({self.data.seq_len}), the "
                    "longest input the model was built for"
                )
            mb = self.train.microbatch_size
            if mb is not None and ft.batch_size % mb:
                raise ValueError(
                    f"train.microbatch_size ({mb}) must divide finetune.batch_size ({ft.batch_size}); "
                    "pick a multiple of it"
                )
            if self.data.modality == "image" and (ft.packing or ft.seq_len is not None):
                raise ValueError("finetune.packing and finetune.seq_len apply to text; remove them")
        self._check_events()
        self._check_schedule()
        if self.train.token_budget < self.diloco.learners * self.tokens_per_learner_step:
            raise ValueError(
                "train.token_budget is smaller than one step of all learners "
                f"(learners × batch_size{' × seq_len' if self.unit == 'tokens' else ''} = "
                f"{self.diloco.learners * self.tokens_per_learner_step:,} {self.unit}); raise it"
            )
        mb = self.train.microbatch_size
        for field_name, batch in (("diloco.batch_size", self.diloco.batch_size), ("dp.batch_size", self.dp.batch_size)):
            if mb is not None and batch % mb:
                raise ValueError(
                    f"train.microbatch_size ({mb}) must divide {field_name} ({batch}); pick a divisor or unset it"
                )
        d = self.runtime.devices_per_learner
        if self.diloco.batch_size % d:
            raise ValueError(
                f"diloco.batch_size ({self.diloco.batch_size}) must be divisible by runtime.devices_per_learner "
                f"({d}): each of a learner's devices takes an equal share of its batch; pick a multiple of {d} "
                "or lower runtime.devices_per_learner"
            )
        if mb is not None and mb % d:
            raise ValueError(
                f"train.microbatch_size ({mb}) must be divisible by runtime.devices_per_learner ({d}): each "
                f"microbatch is split over a learner's devices too; pick a multiple of {d} or unset it"
            )
        if self.runtime.max_workers is not None and self.runtime.max_workers < self.diloco.learners + 1:
            raise ValueError(
                f"runtime.max_workers ({self.runtime.max_workers}) must be ≥ diloco.learners + 1 "
                f"({self.diloco.learners + 1}): every learner and the syncer run at once; raise it or unset it"
            )
        return self

    def _check_events(self) -> None:
        """``chaos.events`` fit this run: learners exist, step faults are reachable and one per step,
        kills and SIGKILLed syncers have processes of their own, syncer failures a restartable syncer
        and a retry each."""
        M, engine = self.diloco.learners, self.runtime.engine
        steps: set[tuple[int, int]] = set()
        for i, e in enumerate(self.chaos.events):
            at = f"chaos.events[{i}] ({e.kind})"
            if isinstance(e, SyncerFailEvent | DPFailEvent):
                continue
            if e.learner >= M:
                raise ValueError(
                    f"{at}: learner ({e.learner}) must be < diloco.learners ({M}): learners are numbered 0 to {M - 1}"
                )
            if not isinstance(e, LEARNER_FAILURES):
                continue
            if e.at_step is not None:
                if (e.learner, e.at_step) in steps:
                    raise ValueError(
                        f"{at} hits learner {e.learner} at step {e.at_step} again; a learner fails at most "
                        "once per step (list each failure once)"
                    )
                steps.add((e.learner, e.at_step))
                if e.at_step > self.learner_steps:
                    raise ValueError(
                        f"{at}: at_step ({e.at_step}) cannot happen: each learner takes about "
                        f"{self.learner_steps} inner steps of this budget (train.token_budget / (learners × "
                        f"batch_size × seq_len)); pick a step ≤ {self.learner_steps}"
                    )
            if isinstance(e, KillEvent) and engine == "threads" and not self.network.emulate:
                raise ValueError(
                    f"{at}: a kill needs learners in their own processes (SIGKILL on the thread engine would "
                    "kill the whole run): set runtime.engine ray or dask, or use kind: fail"
                )
        self._check_dp_failures()
        syncer = [e for e in self.chaos.events if isinstance(e, SyncerFailEvent)]
        merges = [e.at_merge for e in syncer]
        if any(e.how == "sigkill" for e in syncer) and engine == "threads":
            raise ValueError(
                "chaos.events syncer_fail how: sigkill kills the syncer's process, which on runtime.engine "
                "threads is the whole run: use runtime.engine ray or dask, or how: raise"
            )
        if merges and self.runtime.exchange_kind != "fsspec":
            raise ValueError(
                "chaos.events syncer_fail needs a syncer that can be restarted: set runtime.exchange fsspec "
                "(the in-process exchange's syncer is not retried), or remove the syncer_fail events"
            )
        if merges != sorted(set(merges)):
            raise ValueError(
                f"chaos.events syncer_fail at_merge {merges} must be strictly increasing: the k-th fires "
                "on the syncer's k-th attempt; list each merge once, in order"
            )
        if len(merges) > self.diloco.syncer_retries:
            raise ValueError(
                f"chaos.events schedules {len(merges)} syncer failures but diloco.syncer_retries "
                f"is {self.diloco.syncer_retries}: the run would fail; raise diloco.syncer_retries to "
                f"≥ {len(merges)} or drop failures"
            )

    @model_validator(mode="after")
    def _check_emulation(self, info: ValidationInfo) -> ExperimentConfig:
        """``network.emulate`` runs every learner and DP host as a process of this machine in a
        datacenter of its own: the thread engine starts them, DP needs hosts to put there, and the
        exchange is the hub's own S3 server (a stored stage config names it: ``flows.datacenters``)."""
        if not self.network.emulate:
            return self
        if self.runtime.engine != "threads":
            raise ValueError(
                f"network.emulate starts each learner and DP host as a process of this machine in its own "
                f"network namespace, from the thread engine: set runtime.engine threads (not {self.runtime.engine})"
            )
        if self.dp.enabled and self.dp.hosts == 1:
            raise ValueError(
                "network.emulate measures DP across its links with one process per host: set dp.hosts to "
                f"dp.workers ({self.dp.workers}), or dp.enabled false"
            )
        stored = (info.context or {}).get("stored")
        if not stored and (self.runtime.exchange_url is not None or self.runtime.exchange == "memory"):
            raise ValueError(
                "network.emulate puts the exchange on its own S3 server in the hub's namespace: unset "
                "runtime.exchange_url and runtime.exchange"
            )
        return self

    def _check_dp_failures(self) -> None:
        """``dp_fail`` events fit the DP job: their hosts exist, a SIGKILL has a host process of its
        own to kill, and there is a DP to fail."""
        dp = self.dp
        fails = [(i, e) for i, e in enumerate(self.chaos.events) if isinstance(e, DPFailEvent)]
        for i, e in fails:
            at = f"chaos.events[{i}] (dp_fail)"
            if not dp.enabled:
                raise ValueError(f"{at} fails the DP job, but dp.enabled is false: remove it or enable DP")
            if e.host >= dp.hosts:
                raise ValueError(f"{at}: host ({e.host}) must be < dp.hosts ({dp.hosts}): hosts are numbered from 0")
            if e.how == "sigkill" and dp.hosts == 1:
                raise ValueError(
                    f"{at}: how sigkill with dp.hosts 1 would kill the whole run (the job runs in the flow's "
                    "process): set dp.hosts 2 or more, or how raise (or auto)"
                )
            if e.at_step is not None and e.at_step > self.dp_steps:
                raise ValueError(
                    f"{at}: at_step ({e.at_step}) cannot happen: DP takes {self.dp_steps} steps of this budget; "
                    f"pick a step ≤ {self.dp_steps}"
                )
        mb = self.train.microbatch_size
        if dp.hosts > 1 and mb is not None and mb % dp.hosts:
            raise ValueError(
                f"train.microbatch_size ({mb}) must be divisible by dp.hosts ({dp.hosts}): each microbatch of a "
                f"DP step is split over the hosts; pick a multiple of {dp.hosts} or unset it"
            )

    def fault_events(self) -> list[FaultEvent]:
        """Every scheduled fault of the run in the one language of ``chaos.events``: the config's
        events, then the drawn or replayed schedule's (``ChaosSchedule.events``)."""
        sched = self.chaos_schedule()
        return list(self.chaos.events) + (sched.events if sched is not None else [])

    def _check_schedule(self) -> None:
        """The chaos schedule fits this run: its learners exist, every learner has a retry for each of
        its failures, SIGKILLs only where learners have processes of their own."""
        M = self.diloco.learners
        plan = self.chaos.schedule
        for field, entries in (
            ("scavenged", plan.scavenged if plan else []),
            ("corrupt", plan.corrupt if plan else []),
        ):
            for i, e in enumerate(entries):
                if e.learner >= M:
                    raise ValueError(
                        f"chaos.schedule.{field}[{i}].learner ({e.learner}) must be < diloco.learners ({M})"
                    )
        sched = self.chaos_schedule()
        if sched is None:
            src = "chaos.events"  # explicit faults alone must fit the retries too
        else:
            src = f"chaos.replay {self.chaos.replay}" if self.chaos.replay else "chaos.schedule"
        if sched is not None and sched.learners != M:
            raise ValueError(
                f"{src} is for {sched.learners} learners, diloco.learners is {M}: replay it with "
                f"diloco.learners {sched.learners}"
            )
        # a learner failed more often than its retries ends for good: allowed while another learner
        # lives on to spend the budget (a learner lost for good is a scenario of its own); refused
        # when every learner would end so (the run could only fail short of its budget)
        fails = [
            (len(sched.learner_failures(m)) if sched is not None else 0)
            + sum(1 for e in self.chaos.events if isinstance(e, LEARNER_FAILURES) and e.learner == m)
            for m in range(M)
        ]
        if all(n > self.diloco.learner_retries for n in fails):
            m, n = min(enumerate(fails), key=lambda x: x[1])
            hint = (
                " (or drop some of them)"
                if sched is None
                else ""
                if self.chaos.replay
                else " (or raise chaos.schedule.mtbf_s, or shorten its horizon_s to the run's length)"
            )
            raise ValueError(
                f"{src} fails every learner more often than diloco.learner_retries "
                f"({self.diloco.learner_retries}; the least, learner {m}, {n} times): all would end for "
                f"good and the run could not finish; raise diloco.learner_retries to ≥ {n}" + hint
            )
        if sched is None:
            return
        if (
            any(f.how == "sigkill" for f in sched.failures)
            and self.runtime.engine == "threads"
            and not self.network.emulate
        ):
            raise ValueError(
                f"{src} SIGKILLs learners, which on runtime.engine threads kills the whole run: set "
                "chaos.schedule.how raise (or auto), or runtime.engine ray or dask"
            )

    def chaos_schedule(self) -> ChaosSchedule | None:
        """The run's chaos schedule: ``chaos.replay``'s file, or ``chaos.schedule`` drawn from its seed
        (``configs.chaos.draw_schedule``; the same config always gives the same schedule); None without
        either. Raises ``ValueError`` naming the field when the file is missing or not a schedule."""
        if self.chaos.replay is not None:
            try:
                return load_schedule(self.chaos.replay)
            except FileNotFoundError:
                raise ValueError(
                    f"chaos.replay {self.chaos.replay}: no such file; give a run's pretrain/chaos.json"
                ) from None
            except ValueError as exc:
                raise ValueError(f"chaos.replay: {exc}") from None
        if self.chaos.schedule is None:
            return None
        return draw_schedule(self.chaos.schedule, self.diloco.learners, self.runtime.engine)

    @property
    def budget_tokens(self) -> int:
        """Tokens each method trains on: ``train.token_budget`` rounded up to whole DP steps."""
        return self.dp_steps * self.tokens_per_dp_step

    @property
    def engine_slots(self) -> int:
        """Tasks that run at once: every learner and the syncer, or every DP host when there are more."""
        return max(self.diloco.learners + 1, self.dp.hosts if self.dp.enabled else 0)

    @property
    def pretrain_methods(self) -> list[str]:
        """The pretraining methods this run trains (``diloco``, ``dp``; each when enabled)."""
        return [m for m, on in (("diloco", self.diloco.enabled), ("dp", self.dp.enabled)) if on]

    @property
    def learner_processes(self) -> bool:
        """Each learner runs in a process of its own: on ``runtime.engine`` ray or dask, or with
        ``network.emulate`` (in its datacenter); else the learners are threads of the flow's process."""
        return self.runtime.engine != "threads" or self.network.emulate

    @property
    def dp_checkpoint_every(self) -> int | None:
        """DP's checkpoint interval in steps (``dp.checkpoint_every_steps``; 50 under a schedule or a
        ``dp_fail`` event that fails DP, or with several hosts, which may die), or None: no checkpoints."""
        if self.dp.checkpoint_every_steps is not None:
            return self.dp.checkpoint_every_steps
        sched = self.chaos_schedule() if self.chaos.against_dp else None
        fails = (sched is not None and sched.failures) or any(isinstance(e, DPFailEvent) for e in self.chaos.events)
        return 50 if fails or self.dp.hosts > 1 else None

    # Derived values, computed once (style.md §3).
    @property
    def finetune_task(self) -> str:
        """The fine-tuning task: ``finetune.source``, or the modality's embedded one (``speakers``
        for text, ``rotation`` for images)."""
        if self.finetune.source is not None:
            return self.finetune.source
        return "rotation" if self.data.modality == "image" else "speakers"

    @property
    def unit(self) -> str:
        """What the budget counts: ``tokens`` (text) or ``images`` (vision)."""
        return "images" if self.data.modality == "image" else "tokens"

    @property
    def units_per_row(self) -> int:
        """Budget units one batch row holds: seq_len predicted tokens, or one image."""
        return 1 if self.data.modality == "image" else self.data.seq_len

    @property
    def tokens_per_learner_step(self) -> int:
        """Budget units (tokens, or images for vision) of one learner step."""
        return self.diloco.batch_size * self.units_per_row

    @property
    def dp_batch_size(self) -> int:
        return self.dp.batch_size

    @property
    def learner_microbatches(self) -> int:
        """Forward/backward passes per learner inner step (1 = the whole batch at once)."""
        return self.diloco.batch_size // (self.train.microbatch_size or self.diloco.batch_size)

    @property
    def dp_microbatches(self) -> int:
        """Forward/backward passes per DP step (1 = the whole global batch at once)."""
        return self.dp_batch_size // (self.train.microbatch_size or self.dp_batch_size)

    @property
    def tokens_per_dp_step(self) -> int:
        """Budget units (tokens, or images for vision) of one DP step."""
        return self.dp_batch_size * self.units_per_row

    @property
    def dp_steps(self) -> int:
        return -(-self.train.token_budget // self.tokens_per_dp_step)

    @property
    def learner_steps(self) -> int:
        """Inner steps each learner would take if all M shared the budget evenly."""
        return -(-self.train.token_budget // (self.diloco.learners * self.tokens_per_learner_step))

    def derived(self) -> dict[str, object]:
        """Every value derived from the config, by name (what ``ddiloco validate`` prints and a run logs
        at its start): the budget's unit; per learner step and
        per DP step the budget units, rows and microbatches (forward/backward passes); the steps each
        method takes; the fine-tuning task; DP's checkpoint interval; the exchange in use."""
        return {
            "unit": self.unit,
            "units_per_row": self.units_per_row,
            "tokens_per_learner_step": self.tokens_per_learner_step,
            "learner_microbatches": self.learner_microbatches,
            "learner_steps": self.learner_steps,
            "tokens_per_dp_step": self.tokens_per_dp_step,
            "dp_microbatches": self.dp_microbatches,
            "dp_steps": self.dp_steps,
            "finetune_task": self.finetune_task,
            "dp_checkpoint_every": self.dp_checkpoint_every,
            "exchange": self.runtime.exchange_kind,
            "seeds": self.run_seeds,
        }


def validate_against_model(diloco: DiLoCoConfig, n_tensors: int) -> None:
    """Checks that need the built model: P (``diloco.fragments``) must not exceed the number of
    parameter tensors.

    Raises ``ValueError`` naming ``diloco.fragments``.
    """
    if diloco.fragments > n_tensors:
        raise ValueError(
            f"diloco.fragments (P={diloco.fragments}) exceeds the model's {n_tensors} "
            "parameter tensors; lower diloco.fragments"
        )
