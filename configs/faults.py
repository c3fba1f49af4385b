"""The config's one fault language: ``chaos.events``, a list of typed events (chaos testing).

Each event names its ``kind`` and when it happens: at a learner's local step (``at_step``), at a
time of its training clock (``at_s``: seconds since its first attempt started) or, for the syncer, at a
merge (``at_merge``, counted over the run)::

    chaos:
      events:
        - {kind: fail, learner: 1, at_step: 20}                      # raises; Prefect retries it
        - {kind: fail, learner: 0, at_s: 9.0, restart_delay_s: 2.0}  # down 2 s, then rejoins
        - {kind: kill, learner: 1, at_step: 30}                      # SIGKILL (runtime.engine ray or dask)
        - {kind: slowdown, learner: 2, factor: 1.18}                 # a slower device, for good
        - {kind: corrupt, learner: 1, at_s: 5.0, corruption: nan}    # its next submission damaged
        - {kind: presence, learner: 3, join_s: 10.0, leave_s: 60.0}  # a scavenged learner
        - {kind: syncer_fail, at_merge: 6, when: before_publish}     # runtime.exchange fsspec
        - {kind: dp_fail, host: 1, at_step: 40}                      # a DP host dies: the job restarts

The seeded generator (``chaos.schedule``, :mod:`configs.chaos`) draws events of the same kinds and a
replayed schedule (``chaos.replay``) yields them again (``ChaosSchedule.events``); the learner and the
syncer receive all of them as ``diloco.faults`` values. The earlier keys ``chaos.failures``,
``chaos.kills``, ``chaos.slowdowns`` and ``chaos.syncer_failures`` are refused with this spelling.

Plain pydantic; of ours only the titles of its fields (``configs.base.field_title``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Tag,
    model_validator,
)

from configs.base import field_title


class _Event(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, strict=True, field_title_generator=field_title
    )


class _LearnerFailure(_Event):
    kind: Literal["fail", "kill"]  # first in a dump; each subclass narrows it
    learner: int = Field(ge=0, description="learner index m (< diloco.learners)")
    at_step: PositiveInt | None = Field(
        None,
        description="local inner step at which it happens (a learner's step faults fire in step order, the "
        "k-th on its k-th attempt: a retry resumes at the step it failed at)",
    )
    at_s: NonNegativeFloat | None = Field(
        None, description="seconds of the learner's training clock after which it happens (at the next step)"
    )
    restart_delay_s: NonNegativeFloat = Field(
        0.0, description="with at_s: seconds the learner stays down before its retry rejoins"
    )

    @model_validator(mode="after")
    def _check(self):
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError(f"a {self.kind} event needs exactly one of at_step and at_s")
        if self.at_step is not None and self.restart_delay_s:
            raise ValueError(f"restart_delay_s applies to a {self.kind} at_s; remove it or give at_s")
        return self

    @property
    def how(self) -> str:
        return "sigkill" if self.kind == "kill" else "raise"


class FailEvent(_LearnerFailure):
    """Learner ``learner`` raises an exception; Prefect retries its task and it rejoins from its last
    resume point (after ``restart_delay_s`` when timed)."""

    kind: Literal["fail"] = Field("fail", description="fail: the learner raises and is retried")


class KillEvent(_LearnerFailure):
    """Learner ``learner``'s process is SIGKILLed (a real crash: no exception, no clean-up); the
    engine runs it again in a new process. Needs runtime.engine ray or dask. A step kill tells no one
    (the syncer sees the silence); a timed one reports the learner down first."""

    kind: Literal["kill"] = Field("kill", description="kill: the learner's process is SIGKILLed and re-run")


class SlowdownEvent(_Event):
    """Learner ``learner`` runs ``factor`` times slower from ``from_s`` to ``to_s`` (unset: to the
    end): permanent heterogeneity (e.g. 1.18, the paper's gap between accelerator generations) or a
    straggler episode. On a host shared in compute turns it sits out (factor − 1) of a turn per step;
    alone on its device it idles (factor − 1) × each step's compute time; nobody waits for it."""

    kind: Literal["slowdown"] = Field("slowdown", description="slowdown: a slower device for a while")
    learner: int = Field(ge=0, description="learner index m (< diloco.learners)")
    factor: float = Field(gt=1.0, description="step-time multiplier (> 1), e.g. 1.18")
    from_s: NonNegativeFloat = Field(0.0, description="seconds of training when it begins")
    to_s: PositiveFloat | None = Field(None, description="seconds of training when it ends; unset = never")
    cause: Literal["straggler", "heterogeneity"] | None = Field(
        None, description="what a drawn schedule (chaos.schedule) drew it as: a straggler episode or heterogeneity"
    )

    @model_validator(mode="after")
    def _check(self):
        if self.to_s is not None and self.to_s <= self.from_s:
            raise ValueError(
                f"a slowdown event ends (to_s {self.to_s:g}) before it begins (from_s {self.from_s:g}): "
                "set to_s > from_s, or unset it for a permanent slowdown"
            )
        return self


class CorruptEvent(_Event):
    """Learner ``learner``'s first submission after ``at_s`` is damaged in flight; the syncer must
    quarantine it (``nan``: a NaN in the payload; ``shape``: a truncated tensor)."""

    kind: Literal["corrupt"] = Field("corrupt", description="corrupt: a submission damaged in flight")
    learner: int = Field(ge=0, description="learner index m (< diloco.learners)")
    at_s: NonNegativeFloat = Field(description="seconds of training after which its next submission is damaged")
    corruption: Literal["nan", "shape"] = Field("nan", description="nan: a NaN; shape: a truncated tensor")


class PresenceEvent(_Event):
    """A scavenged learner: it trains only from ``join_s`` to ``leave_s`` (unset: to the end); outside
    the window it holds no devices and is out of the quorum."""

    kind: Literal["presence"] = Field("presence", description="presence: a learner that joins late or leaves early")
    learner: int = Field(ge=0, description="learner index m (< diloco.learners)")
    join_s: NonNegativeFloat = Field(0.0, description="seconds of training before it joins")
    leave_s: PositiveFloat | None = Field(None, description="seconds of training at which it leaves; unset = never")

    @model_validator(mode="after")
    def _check(self):
        if self.leave_s is not None and self.leave_s <= self.join_s:
            raise ValueError(
                f"a presence event leaves (leave_s {self.leave_s:g}) before it joins (join_s {self.join_s:g}): "
                "set leave_s > join_s, or unset it"
            )
        return self


class SyncerFailEvent(_Event):
    """The syncer fails right after its ``at_merge``-th merge (over the run) is journaled, before it is
    published (``before_publish``: the nastiest point), or right after the publish; it is retried
    (diloco.syncer_retries) and resumes from its checkpoint and journal. The k-th fires on the
    syncer's k-th attempt. Needs runtime.exchange fsspec; ``how: sigkill`` a process engine."""

    kind: Literal["syncer_fail"] = Field("syncer_fail", description="syncer_fail: the syncer fails at a merge")
    at_merge: PositiveInt = Field(description="the merge (1, 2, … over the run) after which the syncer fails")
    when: Literal["before_publish", "after_publish"] = Field(
        "before_publish",
        description="before_publish: after the merge's journal entry, before its publish; after_publish: right after",
    )
    how: Literal["raise", "sigkill"] = Field(
        "raise",
        description="raise: an exception, retried by Prefect in the same worker; sigkill: the syncer's process is "
        "killed (runtime.engine ray or dask) and re-run by the engine in a new process",
    )


class DPFailEvent(_Event):
    """DP host ``host`` fails at DP step ``at_step`` or after ``at_s`` seconds of the job's clock: with
    several hosts its process is SIGKILLed (``how`` auto or sigkill; ``raise``: it exits with an
    exception) and the whole SPMD job goes down with it; in one process (``dp.hosts`` 1) the job raises.
    Either way the job restarts every host from its last checkpoint after ``restart_delay_s``."""

    kind: Literal["dp_fail"] = Field("dp_fail", description="dp_fail: a DP host dies and takes the job down")
    host: int = Field(0, ge=0, description="DP host index (< dp.hosts)")
    at_step: PositiveInt | None = Field(None, description="DP step at which it fails (before taking it)")
    at_s: NonNegativeFloat | None = Field(None, description="seconds of the job's clock after which it fails")
    restart_delay_s: NonNegativeFloat = Field(0.0, description="seconds the job stays down before it restarts")
    how: Literal["auto", "raise", "sigkill"] = Field(
        "auto", description="sigkill (the host's process), raise (an exception) or auto (sigkill with dp.hosts > 1)"
    )

    @model_validator(mode="after")
    def _check(self):
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("a dp_fail event needs exactly one of at_step and at_s")
        return self


EVENT_KINDS: dict[str, type[_Event]] = {
    "fail": FailEvent,
    "kill": KillEvent,
    "slowdown": SlowdownEvent,
    "corrupt": CorruptEvent,
    "presence": PresenceEvent,
    "syncer_fail": SyncerFailEvent,
    "dp_fail": DPFailEvent,
}


def _event_kind(value: object) -> str | None:
    """The member of the event union a value belongs to: its ``kind`` (None: unknown or missing)."""
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in EVENT_KINDS else None


# One chaos event, picked by its ``kind`` (an unknown or missing kind names them all).
FaultEvent = Annotated[
    Union[tuple(Annotated[cls, Tag(kind)] for kind, cls in EVENT_KINDS.items())],  # noqa: UP007
    Discriminator(
        _event_kind,
        custom_error_type="event_kind",
        custom_error_message=f"unknown chaos event kind; choose one of {', '.join(EVENT_KINDS)}",
    ),
]
LEARNER_FAILURES = (FailEvent, KillEvent)

# the earlier keys of chaos, and how each entry is written now
RENAMED = {
    "failures": "chaos.events entries {kind: fail, learner: L, at_step: S}",
    "kills": "chaos.events entries {kind: kill, learner: L, at_step: S} (or at_s: T)",
    "slowdowns": "chaos.events entries {kind: slowdown, learner: L, factor: F, from_s: A, to_s: B}",
    "syncer_failures": "chaos.events entries {kind: syncer_fail, at_merge: N, when: W, how: H}",
}


# the event kind each earlier key's entries are (a stored config.json of a run from before chaos.events)
_OLD_KINDS = {"failures": "fail", "kills": "kill", "slowdowns": "slowdown", "syncer_failures": "syncer_fail"}


def refuse_old_keys(data: object, stored: bool = False) -> object:
    """Raise ``ValueError`` naming the fix when a ``chaos`` mapping gives faults under a key of the
    earlier fault languages (:data:`RENAMED`). Such a key left empty (``[]``: the config.json of a
    run from before ``chaos.events``) carries nothing and is dropped, so those runs still load. A
    ``stored`` mapping (a run's config.json, read back: ``configs.load.stored_config``) has its
    entries turned into the events they were instead, appended to ``events``."""
    if isinstance(data, dict):
        old = {k: data[k] for k in RENAMED if data.get(k) not in ([], None)}
        if old and not stored:
            key = next(iter(old))
            raise ValueError(f"chaos.{key} is now written as {RENAMED[key]}")
        data = {k: v for k, v in data.items() if k not in RENAMED}
        if old:
            events = [{**e, "kind": _OLD_KINDS[k]} if isinstance(e, dict) else e for k, v in old.items() for e in v]
            data["events"] = [*(data.get("events") or []), *events]
    return data
