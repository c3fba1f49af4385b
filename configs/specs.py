"""The one way in: a config, a sweep or a study, from a file or a shipped name, with what the command
line adds, validated once, or refused in one line.

``ddiloco run``, ``validate``, ``sweep``, ``tune`` and ``finetune``, the flows they start (which the UI
starts too, with a form's fields instead of a file) and the scripts under ``benchmarks/`` all load
through :func:`load_spec`:

1. the source: a YAML file or a shipped name (``configs/<name>.yaml``, ``configs/sweeps/``,
   ``configs/studies/``), else a ``value`` (a form's mapping, or a model already validated);
2. what the command line adds: ``sets`` (``--set key=value``: a config's dotted keys; for a sweep or
   a study, dotted keys of every cell's or trial's config, added to its ``overrides``), ``axes`` (a
   sweep's ``--axis key=[values]``, added to its ``grid``) and ``fields`` (a sweep's or study's own
   fields given as options, e.g. ``--concurrency 2``);
3. pydantic validation of the whole, once;
4. a refusal: a ``ValueError`` (a missing file too) whose message is one line naming the file, the
   field, the option that gave it (``(from --set diloco.learners=0)``, ``(from --concurrency 0)``)
   and the fix. The CLI prints it as ``error: …`` and exits 2; a script may print it as it is.

The checks that look beyond the spec (folders, corpus, devices, a Prefect server) come after, in
``flows/preflight.py``. Nothing here imports Prefect or JAX.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from configs.load import (
    CONFIG_DIR,
    EMPTY_CONFIG,
    apply_overrides,
    config_path,
    option_text,
    parse_overrides,
    read_config_file,
    shipped_or_path,
    validated,
)
from configs.schema import ExperimentConfig
from configs.sweep import SWEEP_DIR, SweepSpec
from configs.tune import STUDY_DIR, TuneSpec

# The sections every experiment config has and no sweep or study file: a file holding one is an
# experiment config given where a sweep or study belongs.
EXPERIMENT_SECTIONS = ("data", "model", "diloco", "dp", "train")


@dataclass(frozen=True)
class Kind:
    """What :func:`load_spec` loads: ``what`` names it in messages, ``model`` validates it, ``folder``
    holds the shipped files; ``empty`` and ``keys`` say what its file holds; ``not_this``: the
    refusal of an experiment config given as this kind (``{given}``: as the command line named it)."""

    what: str
    model: type[BaseModel]
    folder: Path
    empty: str
    keys: str
    not_this: str | None = None


KINDS = {
    "config": Kind("config", ExperimentConfig, CONFIG_DIR, EMPTY_CONFIG, "config sections"),
    "sweep": Kind(
        "sweep",
        SweepSpec,
        SWEEP_DIR,
        "a sweep file holds at least base and grid (see configs/sweeps/)",
        "name, base, overrides, grid, cells, ...",
        "{given} is an experiment config, not a sweep file; sweep over it with --base {given} and "
        "--axis key=[values] (a sweep file holds base, grid, ...: see configs/sweeps/)",
    ),
    "study": Kind(
        "study",
        TuneSpec,
        STUDY_DIR,
        "a study file holds base, trials and space (see configs/studies/)",
        "name, base, trials, space, ...; see configs/studies/",
        "{given} is an experiment config, not a study file: run it with `ddiloco run {given}`, or name "
        "it as a study's base (a study file holds base, trials, space: see configs/studies/)",
    ),
}


def shipped(kind: str) -> str:
    """The names of the shipped files of ``kind`` (config, sweep, study), for help texts and refusals."""
    return ", ".join(sorted(p.stem for p in KINDS[kind].folder.glob("*.yaml")))


def load_spec(
    kind: str,
    source: str | Path | None = None,
    sets: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    axes: Mapping[str, Any] | Iterable[str] | None = None,
    fields: Mapping[str, Any] | None = None,
    value: BaseModel | Mapping[str, Any] | None = None,
    where: str | None = None,
) -> Any:
    """The ``kind`` (``config``, ``sweep``, ``study``) a command or flow runs (see the module).

    ``source``: a YAML path or a shipped name; without one, ``value`` (returned as is when it is
    already a validated model and nothing is added). ``sets`` and ``axes``: ``--set`` / ``--axis``
    items (``"key=value"`` strings, parsed as YAML) or a mapping of dotted keys. ``fields``: a spec's
    own fields, as options give them (``None`` = not given). ``where``: how a validation refusal
    begins (default ``invalid <kind> <source>``). Returns the validated model; raises ``ValueError``
    with one line.
    """
    k = KINDS[kind]
    sets = _items(sets, "--set", "diloco.learners=2")
    axes = _items(axes, "--axis", "diloco.learners=[2,4]")
    fields = {f: v for f, v in (fields or {}).items() if v is not None}
    if source is None and isinstance(value, k.model) and not (sets or axes or fields):
        return value
    if source is not None:
        raw = _read(k, source)
    elif isinstance(value, BaseModel):
        raw = value.model_dump(mode="json")
    else:
        raw = dict(value or {})
    if kind == "config":
        if axes or fields:
            raise ValueError("a config takes --set only")
        raw, given = apply_overrides(raw, sets), {key: option_text("--set", key, v) for key, v in sets.items()}
    else:
        raw, given = _add_to_spec(k, raw, sets, axes, fields, named=source is not None or value is not None)
    return validated(raw, where or f"invalid {k.what}" + (f" {source}" if source is not None else ""), given, k.model)


def _items(items: Mapping[str, Any] | Iterable[str] | None, option: str, example: str) -> dict[str, Any]:
    if isinstance(items, Mapping):
        return dict(items)
    return parse_overrides(list(items or []), option, example)


def _read(k: Kind, source: str | Path) -> dict:
    """The raw mapping of ``source`` (a path or a shipped name of ``k``), in one line when it cannot be."""
    try:
        path = shipped_or_path(source, k.folder, k.what)
    except FileNotFoundError as exc:
        raise ValueError(k.not_this.format(given=source) if k.not_this and _is_config(source) else str(exc)) from None
    try:
        raw = read_config_file(path, k.what, k.empty, k.keys)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from None
    if k.not_this and any(s in raw for s in EXPERIMENT_SECTIONS):
        raise ValueError(k.not_this.format(given=source))
    return raw


def _is_config(name: str | Path) -> bool:
    """Whether ``name`` is an experiment config's path or shipped name."""
    try:
        config_path(name)
    except FileNotFoundError:
        return False
    return True


def _add_to_spec(k: Kind, raw: dict, sets: dict, axes: dict, fields: dict, named: bool) -> tuple[dict, dict[str, str]]:
    """A sweep's or study's raw mapping with the command line's additions, and how each was given
    (field path -> option text, for the refusal)."""
    if k.what == "sweep" and not named and not axes:
        raise ValueError(
            f"no sweep given: name a sweep file or a shipped sweep ({shipped('sweep')}), or give its grid "
            "with --axis, e.g. ddiloco sweep --axis diloco.learners=[2,4]"
        )
    for key, values in axes.items():
        if not isinstance(values, list):
            raise ValueError(f"--axis {key}={values}: give a list of values, e.g. --axis {key}=[{values},...]")
    raw = {**raw, **fields}
    for section, added in (("overrides", sets), ("grid", axes)):
        old = raw.get(section, {})
        if added:  # (a section that is not a mapping is left for validation to name)
            raw[section] = {**old, **added} if isinstance(old, dict) else old
    given = {f: _field_option(f, v) for f, v in fields.items()}
    given |= {f"overrides.{key}": option_text("--set", key, v) for key, v in sets.items()}
    given |= {f"grid.{key}": option_text("--axis", key, v) for key, v in axes.items()}
    return raw, given


def _field_option(field: str, value: Any) -> str:
    """How the command line gave a spec's field: ``--concurrency 0``, ``--no-compare``."""
    option = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return option if value else f"--no-{option[2:]}"
    return f"{option} {value}"


def read_base(base: str, where: str) -> dict:
    """The raw mapping of a sweep's or study's ``base`` config (a shipped name or a path); refused in
    one line beginning ``<where>, base:``."""
    try:
        return read_config_file(config_path(base))
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"{where}, base: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}, base: {base} is not valid YAML: {' '.join(str(exc).split())}") from None
