"""A tuning study: the same number of trials and the same budget per trial for DP and for DiLoCo.

A study file (``configs/studies/<name>.yaml``, or any YAML path) loads into :class:`TuneSpec`
(``configs.specs.load_spec("study", ...)``)::

    name: tune-tiny
    base: tiny                              # a shipped config's name or a YAML path
    overrides: {finetune.enabled: false}    # every trial and the tuned comparison
    trial_overrides: {eval.enabled: false}  # the trials only (the budget of one trial)
    trials: 8                               # per method
    seeds: [0, 1, 2]                        # the tuned comparison: both methods' best settings, each seed
    variants: [{diloco.learners: 2}, {diloco.learners: 4}]   # optional: one DiLoCo study each, DP tuned once
    space:
      dp:
        dp.inner.lr: {low: 0.001, high: 0.03, log: true}
        dp.batch_size: {choices: [16, 32, 64]}
      diloco:
        diloco.inner.lr: {low: 0.001, high: 0.03, log: true}
        diloco.outer_lr: {low: 0.3, high: 1.0}

Each search space maps a dotted config key (any key of :class:`configs.schema.ExperimentConfig`)
to a range (``low``, ``high``, optional ``log`` and ``step``; integers when both ends are
integers) or a list of ``choices``. A trial of one method trains that method alone
(``diloco.enabled`` / ``dp.enabled`` false for the other) and is scored by its loss on the whole
validation split; the test split is read only by the tuned comparison. Nothing here imports
Prefect, JAX or Optuna.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from configs.base import _Strict
from configs.load import CONFIG_DIR, apply_overrides, config_path, read_config_file
from configs.sweep import RESERVED_KEYS, _check_key

STUDY_DIR = CONFIG_DIR / "studies"
METHODS = ("dp", "diloco")
# The keys a trial sets itself: which method trains, and where.
TRIAL_KEYS = ("diloco.enabled", "dp.enabled", "seed", "seeds")


class Range(_Strict):
    """A searched value: ``choices`` (a list of values), or ``low``..``high`` (floats, or integers
    when both ends are integers), sampled on a log scale with ``log: true``, on a grid of ``step``."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)
    choices: list[Any] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Range:
        if self.choices is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either choices or low and high, not both")
            bad = [c for c in self.choices if c is not None and not isinstance(c, (bool, int, float, str))]
            if bad:
                raise ValueError(
                    f"choices hold single values (numbers, strings, booleans), not {bad[0]!r}; search a "
                    "section's keys one by one"
                )
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (e.g. {low: 0.001, high: 0.03, log: true}) or choices")
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be above low ({self.low})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        if self.log and self.step is not None:
            raise ValueError("log and step do not go together; remove one")
        return self

    @property
    def is_int(self) -> bool:
        return (
            self.choices is None
            and float(self.low).is_integer()
            and float(self.high).is_integer()
            and (self.step is None or float(self.step).is_integer())
        )

    def holds(self, value: Any) -> bool:
        """Whether ``value`` lies in the space (a choice, or within [low, high] on its grid)."""
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            return False
        return self.step is None or abs((value - self.low) / self.step - round((value - self.low) / self.step)) < 1e-9

    def values(self) -> list[Any]:
        """The values a preflight validates: every choice, or both ends."""
        if self.choices is not None:
            return list(self.choices)
        return [int(self.low), int(self.high)] if self.is_int else [self.low, self.high]


class TuneSpec(_Strict):
    """A study of both methods (see the module). Raises :class:`pydantic.ValidationError` naming the
    field: a method without a search space, a key a trial sets itself, a key that names or places
    the run."""

    name: str = Field(
        "tune",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the study's name: its folder (<study_root>/<name>) and its Optuna studies",
    )
    base: str = Field(
        "tiny",
        min_length=1,
        description="the config every trial starts from: a shipped config's name or the path of a YAML config",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="dotted keys applied to the base in every trial and in the tuned comparison"
    )
    trial_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted keys applied in the trials "
        "only, e.g. {eval.enabled: false, finetune.enabled: false}: the budget of "
        "one trial, the same for both methods",
    )
    trials: PositiveInt = Field(8, description="trials per method (the same number for both)")
    trial_seed: int = Field(0, ge=0, description="the training seed of every trial")
    from_base: bool = Field(
        True,
        description="each study tries the base config's own values of its searched keys "
        "first (where they lie in the space), so a tuned method is never worse on validation than "
        "its shipped settings",
    )
    sampler_seed: int = Field(
        0,
        ge=0,
        description="seed of Optuna's TPE sampler, the same for both methods (a resumed study "
        "draws on with this seed + its trials so far)",
    )
    space: dict[Literal["dp", "diloco"], dict[str, Range]] = Field(
        description="per method (dp, diloco), dotted config keys and their ranges or choices"
    )
    variants: list[dict[str, Any]] = Field(
        default_factory=list,
        description="DiLoCo variants, each a dict of dotted keys, e.g. [{diloco.learners: 1}, "
        "{diloco.learners: 4}]: each gets its own DiLoCo study with the same number of trials and its own tuned "
        "comparison against the one tuned DP (DP's seeds trained once); empty: one DiLoCo study",
    )
    seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2],
        min_length=1,
        description="the tuned comparison: both methods' best settings, once per seed",
    )
    compare: bool = Field(True, description="run the tuned comparison after the trials (false: trials only)")
    concurrency: PositiveInt = Field(
        1, description="trials running at once (the Prefect global concurrency limit tune-<name>)"
    )
    study_root: str = Field("runs/studies", min_length=1, description="local folder holding study folders")

    @model_validator(mode="after")
    def _check(self) -> TuneSpec:
        missing = [m for m in METHODS if not self.space.get(m)]
        if missing:
            raise ValueError(
                f"space.{missing[0]}: no search space; give at least one key, e.g. "
                f"{'dp.inner.lr' if missing[0] == 'dp' else 'diloco.outer_lr'}: {{low: ..., high: ...}} "
                "(both methods get the same number of trials)"
            )
        for i, v in enumerate(self.variants):
            if not v:
                raise ValueError(f"variants[{i}]: an empty variant; give its dotted keys, e.g. {{diloco.learners: 8}}")
            if any(not k.startswith("diloco.") for k in v):
                raise ValueError(
                    f"variants[{i}]: a variant changes DiLoCo only (diloco.* keys; DP is tuned once for "
                    f"all variants), not {next(k for k in v if not k.startswith('diloco.'))}"
                )
        for where, keys in (
            ("overrides", self.overrides),
            ("trial_overrides", self.trial_overrides),
            *((f"space.{m}", s) for m, s in self.space.items()),
            *((f"variants[{i}]", v) for i, v in enumerate(self.variants)),
        ):
            for key in keys:
                _check_key(f"{where}.{key}", key)
                if key in TRIAL_KEYS or key.split(".")[0] in RESERVED_KEYS:
                    raise ValueError(
                        f"{where}.{key}: the study sets {key} itself (which method a trial trains, its "
                        "seed and its folder); remove it"
                    )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeats a seed; list each once")
        return self

    def study_dir(self) -> Path:
        return (Path(self.study_root).expanduser() / self.name).absolute()

    def base_params(self, method: str, raw: dict, variant: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The base config's values (after ``overrides`` and the ``variant``) of ``method``'s searched
        keys, or None when one is unset or outside the space."""
        from configs.schema import ExperimentConfig

        cfg = ExperimentConfig.model_validate(apply_overrides(apply_overrides(raw, self.overrides), variant or {}))
        out = {}
        for key, rng in self.space[method].items():
            node: Any = cfg
            for part in key.split("."):
                node = getattr(node, part, None)
            if node is None or not rng.holds(node):
                return None
            out[key] = node
        return out

    def arms(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The studies to run: ``(name, method, variant overrides)``: ``dp``, then ``diloco`` or one
        ``diloco-<variant>`` per variant (named like sweep cells, e.g. ``diloco-learners-4``)."""
        if not self.variants:
            return [("dp", "dp", {}), ("diloco", "diloco", {})]
        from configs.sweep import SweepSpec, expand_cells

        cells = expand_cells(SweepSpec(cells=self.variants))
        return [("dp", "dp", {})] + [(f"diloco-{c.name}", "diloco", c.overrides) for c in cells]

    def trial_config(
        self, method: str, params: dict[str, Any], base_raw: dict | None = None, variant: dict[str, Any] | None = None
    ) -> dict:
        """The raw config of a trial of ``method`` with ``params``: the base, ``overrides``,
        ``trial_overrides``, the ``variant``, the params, the other method off, ``seed`` =
        ``trial_seed``."""
        raw = base_raw if base_raw is not None else read_config_file(config_path(self.base))
        other = "diloco" if method == "dp" else "dp"
        merged = apply_overrides(apply_overrides(raw, self.overrides), self.trial_overrides)
        merged = apply_overrides(apply_overrides(merged, variant or {}), params)
        return apply_overrides(
            merged,
            {
                f"{other}.enabled": False,
                f"{method}.enabled": True,
                "seed": self.trial_seed,
                "name": f"{self.name}-{method}",
            },
        )

    def final_config(
        self,
        best_dp: dict[str, Any],
        best_diloco: dict[str, Any],
        base_raw: dict | None = None,
        variant: dict[str, Any] | None = None,
        arm: str = "diloco",
    ) -> dict:
        """The raw config of a tuned comparison: the base, ``overrides``, the ``variant``, both
        methods' best params, ``seeds``."""
        raw = base_raw if base_raw is not None else read_config_file(config_path(self.base))
        merged = apply_overrides(apply_overrides(raw, self.overrides), variant or {})
        merged = apply_overrides(apply_overrides(merged, best_dp), best_diloco)
        return apply_overrides(merged, {"seeds": list(self.seeds), "name": f"{self.name}-tuned-{arm}"})
