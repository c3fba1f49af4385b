"""The run directory's records, typed: what the writers append to ``metrics/*.jsonl`` and write as
``summary.json`` and evaluation results, and what the reports read (docs/contracts.md, "Records").

Every model allows fields it does not declare (a writer may add optional ones); every field a report
reads is declared, with its unit. Times ``t`` are seconds on the run clock (DP: its job's clock);
steps are a learner's (DiLoCo) or the job's (DP) optimizer steps; tokens are BPE tokens.

State events (``{"event": "state", "state": "up" | "down" | "restarting" | "done", "t", ...}``) are
written by each DiLoCo learner and by the DP job at every transition (:class:`StateEvent`):

- ``up``: training (a learner's ``start``; the DP job's start or its restore);
- ``down``: failed or killed (``reason``), until its next ``restarting``/``up``;
- ``restarting``: a retried attempt has begun (waiting out its restart delay, building its state);
- ``done``: stopped (its budget spent, the run closed, a scavenged learner's window closed).
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

Who = int | str  # a learner's id: its index (older logs: its index as text)


class Record(BaseModel):
    """One record: undeclared fields are kept (``model_extra``); :meth:`line` is its JSON object."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def line(self) -> dict:
        """The record as the dict a writer appends (unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StateEvent(Record):
    """A transition of a DiLoCo learner (``learner``, ``attempt``) or of the DP job (``learner``
    None; ``generation``: its launch, 0 first) to ``state`` at ``t`` (run-clock seconds); ``host``:
    the machine's name, ``reason``: why (a failure's exception, ``retry``, ``left``)."""

    event: Literal["state"] = "state"
    state: Literal["up", "down", "restarting", "done"]
    t: float
    learner: Who | None = None
    attempt: int | None = None
    generation: int | None = None
    host: str | None = None
    reason: str | None = None


# --- metrics/learners.jsonl: a learner's own events --------------------------------------------


class LearnerEvent(Record):
    """A learner's event: ``learner``, its ``attempt`` (1 first; ``step`` lines name none), ``t``
    (run-clock seconds), ``step`` (its local step then) and, for a fault, ``train_t`` (seconds on its
    training clock)."""

    learner: Who
    attempt: int | None = None
    t: float
    step: int | None = None


class Start(LearnerEvent):
    """An attempt began training at ``step`` (its resume point); ``origin``: its training clock's
    zero on the run clock (s); ``host``: the machine."""

    event: Literal["start"]
    origin: float | None = None
    host: str | None = None
    resumed: bool | None = None


class StepLine(LearnerEvent):
    """Every ``log_every`` steps: ``train/loss`` (nats/token) at ``tokens`` processed so far."""

    event: Literal["step"]
    loss: float | None = Field(None, alias="train/loss")
    tokens: int | None = None


class Failure(LearnerEvent):
    """A failure (an exception: ``failure``) or a SIGKILL about to happen (``kill``), ``reason``
    naming it; ``before_start``: the attempt failed before its first step."""

    event: Literal["failure", "kill"]
    reason: str | None = None
    before_start: bool = False


class Stop(LearnerEvent):
    """The attempt handed in its fragments and stopped (``reason``, in older logs)."""

    event: Literal["stop"]
    reason: str | None = None


class Wait(LearnerEvent):
    """The learner waited ``wait_s`` seconds from ``t`` for ``fragment``'s overdue merge."""

    event: Literal["wait"]
    fragment: int | None = None
    wait_s: float = 0.0
    timed_out: bool | None = None


class Slowdown(LearnerEvent):
    """Its pace changed to ``factor`` × its step time (1.0: back to full speed)."""

    event: Literal["slowdown"]
    factor: float = 1.0


class Presence(LearnerEvent):
    """A scavenged learner joined (``join``) or left (``leave``) the run."""

    event: Literal["join", "leave"]


class Corrupt(LearnerEvent):
    """It damaged (``kind``) its submission of ``fragment`` at ``step`` from ``base_version``."""

    event: Literal["corrupt"]
    fragment: int | None = None
    kind: str | None = None
    base_version: int | None = None
    tokens: int | None = None


class Other(Record):
    """Any other line of the log (``resume_point``, ``retry``, a future event): kept as is."""

    event: str | None = None
    learner: Who | None = None
    attempt: int | None = None
    t: float | None = None
    step: int | None = None


# --- metrics/learners.jsonl: the syncer's and the exchange's events ----------------------------


class Dropped(Record):
    """The syncer dropped ``tokens`` of ``learner``'s submission of ``fragment`` (``reason``)."""

    event: Literal["dropped"]
    learner: Who | None = None
    fragment: int | None = None
    reason: str | None = None
    tokens: int | None = None
    base_version: int | None = None
    t: float | None = None


class SyncerEvent(Record):
    """The syncer failed (``syncer-failure``), was killed (``syncer-kill``) or a new one took office
    (``syncer-resumed``: ``generation``, entries ``replayed``, merges ``republished``); ``merges``:
    the merges made so far."""

    event: Literal["syncer-failure", "syncer-kill", "syncer-resumed"]
    attempt: int | None = None
    t: float
    reason: str | None = None
    merges: int | None = None
    generation: int | None = None
    replayed: int | None = None
    republished: int | None = None


_LEARNERS = {
    "state": StateEvent,
    "start": Start,
    "step": StepLine,
    "failure": Failure,
    "kill": Failure,
    "stop": Stop,
    "wait": Wait,
    "slowdown": Slowdown,
    "join": Presence,
    "leave": Presence,
    "corrupt": Corrupt,
    "dropped": Dropped,
    "syncer-failure": SyncerEvent,
    "syncer-kill": SyncerEvent,
    "syncer-resumed": SyncerEvent,
}


def _kind(v: Any) -> str:
    return v.get("event") if isinstance(v, dict) else v.event


def _union(kinds: dict[str, type]) -> Any:
    """A union over ``kinds`` by ``event``; a line of another (or no) event reads as :class:`Other`."""
    models = {m.__name__: m for m in kinds.values()}
    by_event = {e: m.__name__ for e, m in kinds.items()}
    pick = Discriminator(lambda v: by_event.get(_kind(v), "Other"))
    choices = [Annotated[m, Tag(n)] for n, m in {**models, "Other": Other}.items()]
    return Annotated[Union[tuple(choices)], pick]  # noqa: UP007 - a union built from a list


LearnersLine = _union(_LEARNERS)  # one line of metrics/learners.jsonl


# --- metrics/events.jsonl: the DP job's events -------------------------------------------------


class DPEvent(Record):
    """A DP job event at ``t`` (its clock, s): ``start`` (generation 0), ``failure`` (``replica``
    failed at ``step``; ``while_down``: while the job was already down), ``restore`` (back at
    ``step``, ``lost_steps`` behind, ``restore_s`` and ``down_s`` seconds), ``recovered`` (back at
    its high-water ``step`` after ``recompute_s`` s), ``checkpoint`` (saved at ``step`` in ``save_s``
    s), ``slowdown`` (step time × ``factor``)."""

    event: Literal["start", "failure", "restore", "recovered", "checkpoint", "slowdown"]
    t: float
    generation: int | None = None
    step: int | None = None
    replica: int | None = None
    host: Any = None
    reason: str | None = None
    restart_delay_s: float | None = None
    while_down: bool = False
    lost_steps: int | None = None
    restore_s: float | None = None
    down_s: float | None = None
    recompute_s: float | None = None
    save_s: float | None = None
    factor: float = 1.0


DPLine = _union({**dict.fromkeys(DPEvent.model_fields["event"].annotation.__args__, DPEvent), "state": StateEvent})


# --- metrics/merges.jsonl, train.jsonl, eval.jsonl ---------------------------------------------


class Merge(Record):
    """One merge of ``fragment`` into ``version`` at ``merged_at_s`` (run clock, s): per contributor
    (``contributors``) its ``tokens``, ``steps``, ``local_steps``, ``attempts`` and ``stale`` (versions
    behind; older logs: a bool); ``bytes_in`` / ``bytes_out`` (bytes)."""

    fragment: int | None = None
    version: int | None = None
    contributors: list[Who] = []
    tokens: list[int] = []
    steps: list[int] = []
    stale: list[int | bool] = []
    local_steps: list[int] | None = None
    attempts: list[int] | None = None
    quorum_at_s: float | None = None
    merged_at_s: float | None = None  # (always written; hand-made logs may leave it out)
    bytes_in: int | None = None
    bytes_out: int | None = None
    fragment_bytes: int | None = None


class TrainRow(Record):
    """A DP training line: ``train/loss`` (nats/token) at ``step`` and ``tokens``, ``t`` (s)."""

    step: int
    tokens: int | None = None
    loss: float | None = Field(None, alias="train/loss")
    t: float | None = None


class EvalRow(Record):
    """A held-out measurement: ``val/loss`` (nats/token) at ``tokens`` and ``wall_s`` (the method's
    clock, s); ``step`` (DP) or ``merges`` (DiLoCo) then; ``eval_s``: its seconds."""

    method: str | None = None
    tokens: int
    wall_s: float | None = None
    val_loss: float = Field(alias="val/loss")
    step: int | None = None
    merges: int | None = None


# --- summary.json and eval/<stage>/<method>.json ------------------------------------------------


class Summary(Record):
    """A pretraining method's ``summary.json``: ``tokens`` and ``steps`` trained, ``wall_s`` (s),
    ``final_val_loss`` (nats/token), ``hyperparameters``; DiLoCo: ``merges``, ``ledger`` (learner →
    token counts), ``work_lost``, ``startup_s`` (run clock, s); DP: ``chaos`` (failures, lost_steps,
    stall_s, checkpoint_every_steps) and ``restarts``."""

    method: str | None = None
    tokens: int | None = None
    steps: int | None = None
    wall_s: float | None = None
    final_val_loss: float | None = None
    hyperparameters: dict[str, Any] = {}
    merges: int | None = None
    ledger: dict[str, Any] | None = None
    work_lost: dict[str, Any] | None = None
    startup_s: float | None = None
    chaos: dict[str, Any] | None = None
    restarts: list[dict] | None = None


class EvalResult(Record):
    """An evaluation of a method's checkpoint: its metrics (``<task>/<metric>``, undeclared) at
    ``checkpoint_tokens``, in ``eval_s`` seconds."""

    method: str | None = None
    checkpoint_tokens: int | None = None
    eval_s: float | None = None


@cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(list[kind])


def parse(kind: Any, rows: list[dict] | None) -> list:
    """``rows`` (a JSONL file's lines) as records of ``kind`` (a model or :data:`LearnersLine` /
    :data:`DPLine`); None reads as []. Raises ``pydantic.ValidationError`` naming the bad field."""
    return _adapter(kind).validate_python(rows or [])
