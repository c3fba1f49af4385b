"""What a Decoupled DiLoCo run reads of its config, split from it once per process: :class:`DiLoCoPlan`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from configs.data import DataConfig
from configs.faults import FaultEvent
from configs.methods import DiLoCoConfig, TrainConfig
from configs.model import ModelConfig
from configs.runtime import PrecisionConfig, RuntimeConfig
from configs.schema import ExperimentConfig


@dataclass(frozen=True)
class DiLoCoPlan:
    """The sections and derived values the DiLoCo set-up, its learners and its syncer read: the
    ``model`` built for ``data``, the ``diloco`` section, ``train`` (evaluation cadence and batches,
    microbatch size), ``runtime`` (engine, exchange, devices, compilation cache), ``precision`` and
    the init and data-order ``seed``; derived once (``configs.schema.ExperimentConfig``): the budget's
    ``unit`` (tokens or images), units per learner step, each learner's inner steps and
    microbatches per step, whether learners run in processes of their own, the token budget
    (``ExperimentConfig.budget_tokens``) and every scheduled fault (``fault_events()``)."""

    model: ModelConfig
    data: DataConfig
    diloco: DiLoCoConfig
    train: TrainConfig
    runtime: RuntimeConfig
    precision: PrecisionConfig
    seed: int
    unit: str
    tokens_per_learner_step: int
    learner_steps: int
    learner_microbatches: int
    learner_processes: bool
    token_budget: int
    fault_events: tuple[FaultEvent, ...]

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> DiLoCoPlan:
        """``cfg``'s plan: each field the config's attribute of that name, but the token budget and
        the fault events (the chaos schedule drawn or replayed once)."""
        own = {"token_budget": cfg.budget_tokens, "fault_events": tuple(cfg.fault_events())}
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.name not in own}, **own)
