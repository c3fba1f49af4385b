"""Chaos schedules: a seeded plan of hardware events, drawn once, saved, and replayed on both methods.

A :class:`ChaosPlan` (the config's ``chaos.schedule``) holds the knobs: a per-learner mean time
between failures with an exponentiated-Weibull restart delay (the goodput simulator's recovery
law, ``sim.config``), straggler episodes (a step-time factor for a duration), permanent
heterogeneity (a step-time multiplier per learner, e.g. 1.18 for the paper's gap between
accelerator generations), scavenged learners that join and leave at given times, and submissions
corrupted in flight (a NaN, a wrong shape). :func:`draw_schedule` expands it, from its seed alone,
into a :class:`ChaosSchedule`: explicit events on the training clock (seconds since the method's
first inner step), serialisable to JSON (``RUN/pretrain/chaos.json``) and replayed from that file
exactly (``chaos.replay``).

The same schedule drives both methods:

- Decoupled DiLoCo: learner m fails at ``at_s`` (an exception, or its process is SIGKILLed on the
  Ray and Dask engines), stays down for ``restart_delay_s`` and rejoins; it runs ``factor``× slower
  in a slowdown; it trains only inside its presence window; its next submission after ``at_s`` of a
  corruption is damaged in flight (and must be quarantined by the syncer).
- DP: a failure of any replica stalls the whole job for the restart delay and rolls it back to its
  last checkpoint; a slowdown of any replica slows every step (lock-step: the slowest replica sets
  the pace); scavenged capacity and submissions do not exist for it.

Plain Python, NumPy and pydantic; SciPy for the restart-delay law. No JAX, no Prefect, nothing of
ours but the fault language (``configs.faults``: :meth:`ChaosSchedule.events` gives the schedule as
``chaos.events`` entries): the config validates a run's schedule (a retry for every failure, the
replayed file's learner count) before any work starts, so the schedule lives beside the schema; the
learner loop (``diloco.learner``) and the DP job (``training.dp``) receive its events as plain values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, ValidationInfo, model_validator

from configs.base import _Strict, field_title
from configs.faults import (
    LEARNER_FAILURES,
    CorruptEvent,
    FailEvent,
    FaultEvent,
    KillEvent,
    PresenceEvent,
    SlowdownEvent,
    refuse_old_keys,
)


class _Frozen(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, strict=True, field_title_generator=field_title
    )


# --- the plan (config) --------------------------------------------------------------------------


class RestartDelay(_Frozen):
    """Restart delay of a failed learner (or DP job): an exponentiated Weibull law in seconds,
    ``scipy.stats.exponweib(a, c, scale=scale_s)``, the goodput simulator's recovery law
    (``sim.config.GoodputConfig.recovery``). The defaults are the simulator's shape scaled to
    this machine's seconds: mean 2.47 s."""

    a: PositiveFloat = Field(2.0, description="exponentiated Weibull exponent a")
    c: PositiveFloat = Field(1.5, description="Weibull shape c")
    scale_s: PositiveFloat = Field(2.0, description="scale, seconds")

    def mean_s(self) -> float:
        """The law's mean, seconds."""
        from scipy import stats

        return float(stats.exponweib(self.a, self.c, scale=self.scale_s).mean())


class ChaosPlan(_Frozen):
    """The knobs of a seeded chaos schedule (``chaos.schedule``); :func:`draw_schedule` expands them.

    Times are seconds of the training clock (since the method's first inner step). Every draw is
    made from ``seed`` (and the learner's index) alone, so a plan always gives the same schedule."""

    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of every draw")
    horizon_s: PositiveFloat = Field(
        120.0,
        description="events are drawn over this many seconds of training (those past the end of a run never fire)",
    )
    mtbf_s: PositiveFloat | None = Field(
        None,
        description="per-learner mean time between failures, seconds "
        "(a Poisson process, renewed at each restart); unset = no failures",
    )
    restart_delay: RestartDelay = Field(
        default_factory=RestartDelay, description="restart delay law after a failure (exponentiated Weibull)"
    )
    how: Literal["auto", "raise", "sigkill"] = Field(
        "auto",
        description="how a failure is carried out: raise (an exception, retried by Prefect), sigkill "
        "(the learner's process is killed, re-run by the engine: runtime.engine ray or dask), auto (sigkill on "
        "ray and dask, raise on threads)",
    )
    straggler_every_s: PositiveFloat | None = Field(
        None, description="per-learner mean time between straggler episodes, seconds; unset = none"
    )
    straggler_s: PositiveFloat = Field(5.0, description="mean length of a straggler episode, seconds (exponential)")
    straggler_factor: float = Field(2.0, gt=1.0, description="step-time multiplier during a straggler episode")
    heterogeneity: list[Annotated[float, Field(ge=1.0)]] | None = Field(
        None,
        description="permanent step-time multiplier per learner, one per learner (1.0 = full speed; "
        "e.g. [1, 1, 1.18, 1.18]: two learners on an older accelerator generation)",
    )
    scavenged: list[PresenceEvent] = Field(
        default_factory=list, description="learners that join and leave: [{learner, join_s, leave_s}]"
    )
    corrupt: list[CorruptEvent] = Field(
        default_factory=list, description="submissions damaged in flight: [{learner, at_s, corruption: nan | shape}]"
    )

    @model_validator(mode="before")
    @classmethod
    def _corruption_was_kind(cls, data: Any) -> Any:
        """``corrupt`` entries were written ``{learner, at_s, kind: nan | shape}`` before they were
        ``chaos.events``' corrupt events: read that spelling (stored configs of earlier runs) as one."""
        if isinstance(data, dict) and isinstance(data.get("corrupt"), list):
            old = ("nan", "shape")
            fix = [
                {**e, "kind": "corrupt", "corruption": e["kind"]} if isinstance(e, dict) and e.get("kind") in old else e
                for e in data["corrupt"]
            ]
            data = {**data, "corrupt": fix}
        return data


# --- the schedule (explicit events) ------------------------------------------------------------


# the fields of a schedule before it held chaos.events' own events (each entry: _old_entry)
_OLD_FIELDS = ("failures", "slowdowns", "presence", "corruptions")


def _old_entry(field: str, e: dict) -> dict:
    """One entry of an earlier ``chaos.json`` (failures, slowdowns, presence, corruptions) as the event it was."""
    if field == "failures":
        return {**{k: v for k, v in e.items() if k != "how"}, "kind": "kill" if e.get("how") == "sigkill" else "fail"}
    if field == "slowdowns":
        return {**{k: v for k, v in e.items() if k != "kind"}, "kind": "slowdown", "cause": e.get("kind", "straggler")}
    if field == "corruptions":
        return {**{k: v for k, v in e.items() if k != "kind"}, "kind": "corrupt", "corruption": e.get("kind", "nan")}
    return {**e, "kind": "presence"}


class ChaosSchedule(_Frozen):
    """A drawn or replayed chaos schedule: ``events``, the config's own fault events (``configs.faults``:
    ``fail``/``kill`` at ``at_s`` with a restart delay, ``slowdown``, ``presence``, ``corrupt``) on the
    training clock (seconds), for ``learners`` learners.

    Per learner, each failure lies after the previous one's restart (a learner that is down cannot fail
    again), and a learner has at most one presence window. Serialise with :meth:`dumps`, read back with
    :meth:`loads` or :func:`load_schedule`: the round trip is exact. A ``chaos.json`` of an earlier
    run (lists ``failures``, ``slowdowns``, ``presence``, ``corruptions``) reads as the same events."""

    learners: int = Field(ge=1)
    seed: int | None = None
    plan: dict | None = None  # the ChaosPlan it was drawn from (JSON), so a replay still knows mtbf_s and the law
    events: list[FaultEvent] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _earlier_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in _OLD_FIELDS):
            old = [_old_entry(k, e) for k in _OLD_FIELDS for e in data.get(k) or [] if isinstance(e, dict)]
            data = {k: v for k, v in data.items() if k not in _OLD_FIELDS} | {"events": [*data.get("events", []), *old]}
        return data

    @model_validator(mode="after")
    def _check(self) -> ChaosSchedule:
        for i, e in enumerate(self.events):
            if not hasattr(e, "learner") or e.kind in ("fail", "kill") and e.at_s is None:
                raise ValueError(f"chaos schedule events[{i}]: a {e.kind} event has no place in a schedule")
            if e.learner >= self.learners:
                raise ValueError(
                    f"chaos schedule events[{i}].learner ({e.learner}) must be < the schedule's learners "
                    f"({self.learners})"
                )
        seen: set[int] = set()
        for p in self.presence:
            if p.learner in seen:
                raise ValueError(f"chaos schedule: learner {p.learner} has two presence windows; give one")
            seen.add(p.learner)
        for m in range(self.learners):
            mine = self.learner_failures(m)
            for a, b in zip(mine, mine[1:]):
                if b.at_s < a.at_s + a.restart_delay_s:
                    raise ValueError(
                        f"chaos schedule: learner {m} fails at {b.at_s:g} s while still down from its "
                        f"failure at {a.at_s:g} s (restart at {a.at_s + a.restart_delay_s:g} s)"
                    )
        return self

    # views of one kind
    @property
    def failures(self) -> list[FailEvent | KillEvent]:
        """The timed failures (``fail``: raise, ``kill``: SIGKILL), by time."""
        return sorted((e for e in self.events if isinstance(e, LEARNER_FAILURES)), key=lambda f: (f.at_s, f.learner))

    @property
    def slowdowns(self) -> list[SlowdownEvent]:
        return [e for e in self.events if isinstance(e, SlowdownEvent)]

    @property
    def presence(self) -> list[PresenceEvent]:
        return [e for e in self.events if isinstance(e, PresenceEvent)]

    @property
    def corruptions(self) -> list[CorruptEvent]:
        return sorted((e for e in self.events if isinstance(e, CorruptEvent)), key=lambda c: c.at_s)

    def learner_failures(self, m: int) -> list[FailEvent | KillEvent]:
        return [f for f in self.failures if f.learner == m]

    def window(self, m: int) -> tuple[float, float | None]:
        """Learner m's presence window (join_s, leave_s or None); (0, None) for a permanent learner."""
        return next(((p.join_s, p.leave_s) for p in self.presence if p.learner == m), (0.0, None))

    def dp_factor(self, t: float) -> float:
        """The DP step-time factor at ``t``: the slowest replica sets the pace of a lock-step job."""
        return max((e.factor for e in self.slowdowns if e.from_s <= t and (e.to_s is None or t < e.to_s)), default=1.0)

    @property
    def empty(self) -> bool:
        return not self.events

    def dumps(self) -> str:
        """The schedule as indented JSON (what ``RUN/pretrain/chaos.json`` holds)."""
        return self.model_dump_json(indent=2)

    @classmethod
    def loads(cls, text: str) -> ChaosSchedule:
        return cls.model_validate_json(text)


def load_schedule(path: str | Path) -> ChaosSchedule:
    """A schedule saved by an earlier run. Raises ``FileNotFoundError``, or ``ValueError`` naming the
    file when it is not a schedule."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give the schedule file itself, a run's pretrain/chaos.json")
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
        return ChaosSchedule.loads(text)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a chaos schedule (not UTF-8 text): give a run's pretrain/chaos.json") from None
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"]) or "the file"
        raise ValueError(f"{path} is not a chaos schedule ({where}: {e['msg']})") from None
    except ValueError as exc:
        first = str(exc).splitlines()
        raise ValueError(f"{path} is not a chaos schedule ({first[0] if first else exc})") from None


# --- drawing ------------------------------------------------------------------------------------


def _rng(seed: int, learner: int, stream: int) -> np.random.Generator:
    """An independent stream per (seed, learner, kind of event): adding stragglers to a plan does not
    move its failures."""
    return np.random.default_rng([seed, learner, stream])


def draw_schedule(plan: ChaosPlan, learners: int, engine: str = "threads") -> ChaosSchedule:
    """Expand ``plan`` into explicit events for ``learners`` learners (``engine`` resolves
    ``how: auto``). Deterministic in ``plan`` alone.

    Failures: a renewal process per learner, inter-failure times Exponential(``mtbf_s``) counted
    from the previous restart, each with a restart delay drawn from ``plan.restart_delay``; a
    scavenged learner fails only inside its presence window. Straggler episodes: a renewal process
    per learner, gaps Exponential(``straggler_every_s``), lengths Exponential(``straggler_s``), each
    ``straggler_factor``× slower. Heterogeneity: a permanent episode for every factor > 1.
    Raises ``ValueError`` when an event names a learner ≥ ``learners``.
    """
    from scipy import stats

    how = plan.how if plan.how != "auto" else ("raise" if engine == "threads" else "sigkill")
    law = stats.exponweib(plan.restart_delay.a, plan.restart_delay.c, scale=plan.restart_delay.scale_s)
    windows = {p.learner: (p.join_s, p.leave_s) for p in plan.scavenged}
    failures: list[FailEvent | KillEvent] = []
    slowdowns: list[SlowdownEvent] = []
    failure = FailEvent if how == "raise" else KillEvent
    for m in range(learners):
        join, leave = windows.get(m, (0.0, None))
        end = plan.horizon_s if leave is None else min(plan.horizon_s, leave)
        if plan.mtbf_s is not None:
            rng, t = _rng(plan.seed, m, 0), join
            while True:
                t += float(rng.exponential(plan.mtbf_s))
                if t >= end:
                    break
                delay = float(law.rvs(random_state=rng))
                failures.append(failure(learner=m, at_s=round(t, 3), restart_delay_s=round(delay, 3)))
                t = round(t, 3) + round(delay, 3)
        if plan.straggler_every_s is not None:
            rng, t = _rng(plan.seed, m, 1), 0.0
            while True:
                t += float(rng.exponential(plan.straggler_every_s))
                if t >= plan.horizon_s:
                    break
                length = float(rng.exponential(plan.straggler_s))
                slowdowns.append(
                    SlowdownEvent(
                        learner=m,
                        factor=plan.straggler_factor,
                        from_s=round(t, 3),
                        to_s=round(t + length, 3),
                        cause="straggler",
                    )
                )
                t += length
    for m, factor in enumerate(plan.heterogeneity or []):
        if factor > 1.0:
            slowdowns.append(SlowdownEvent(learner=m, factor=factor, cause="heterogeneity"))
    if plan.heterogeneity is not None and len(plan.heterogeneity) != learners:
        raise ValueError(
            f"chaos.schedule.heterogeneity lists {len(plan.heterogeneity)} factors for "
            f"{learners} learners (diloco.learners): give one per learner (1.0 = full speed)"
        )
    failures.sort(key=lambda f: (f.at_s, f.learner))
    return ChaosSchedule(
        learners=learners,
        seed=plan.seed,
        plan=plan.model_dump(mode="json"),
        events=[*failures, *slowdowns, *plan.scavenged, *plan.corrupt],
    )


# --- the chaos section of the config -----------------------------------------------------------


class ChaosConfig(_Strict):
    """Scheduled faults of a run (chaos testing)."""

    events: list[FaultEvent] = Field(
        default_factory=list,
        description="scheduled faults, typed events (configs.faults): fail, kill, slowdown, corrupt, presence "
        "(a learner at a step or a time) and syncer_fail (at a merge), e.g. [{kind: fail, learner: 1, at_step: 20}]",
    )
    schedule: ChaosPlan | None = Field(
        None,
        description="a seeded chaos schedule (configs.chaos), drawn as events of chaos.events' kinds: failures "
        "with restart delays (mtbf_s, restart_delay), straggler episodes, heterogeneity, scavenged learners, "
        "corrupted submissions; drawn once, saved as pretrain/chaos.json and replayed on DiLoCo and on DP",
    )
    replay: str | None = Field(
        None,
        description="replay the schedule saved by an earlier run (its pretrain/chaos.json) instead of "
        "drawing chaos.schedule",
    )
    reference_run: str | None = Field(
        None,
        description="a finished run directory of the same experiment without chaos: the report's Resilience "
        "section puts its held-out loss at equal time and tokens beside this run's",
    )
    against_dp: bool = Field(
        True,
        description="replay the schedule's failures and slowdowns on the DP baseline too "
        "(a failure of any replica stalls the job and rolls it back to its last checkpoint)",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_keys(cls, data: Any, info: ValidationInfo) -> Any:
        return refuse_old_keys(data, stored=bool((info.context or {}).get("stored")))

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> ChaosConfig:
        if self.schedule is not None and self.replay is not None:
            raise ValueError(
                "chaos.schedule and chaos.replay both give a schedule: keep one (on a config that sets "
                "chaos.schedule, add --set chaos.schedule=null to replay)"
            )
        stored = (info.context or {}).get("stored")  # a run's config.json, read where its files may not be
        if self.reference_run is not None and not stored and not (Path(self.reference_run) / "pretrain").is_dir():
            raise ValueError(
                f"chaos.reference_run {self.reference_run} holds no pretraining results (no pretrain/ "
                "folder): give a finished run directory"
            )
        return self
