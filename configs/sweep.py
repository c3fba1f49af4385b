"""An experiment sweep: a base config and a grid (or a list) of overrides, one pipeline run per cell.

A sweep file (``configs/sweeps/<name>.yaml``, or any YAML path) loads into :class:`SweepSpec`
(``configs.specs.load_spec("sweep", ...)``)::

    name: tiny-grid
    base: tiny                       # a shipped config's name or a YAML path
    overrides: {finetune.enabled: false}   # applied to the base first, in every cell
    grid:                            # every combination is a cell (key order: first key slowest)
      diloco.learners: [2, 3]
      diloco.quorum: [1, 2]

:func:`expand_cells` turns the grid (then ``cells``, a list of dotted-override dicts) into named
cells; :func:`cell_config` validates each cell's config. Nothing here imports Prefect or JAX.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt, model_validator

from configs.base import _Strict
from configs.eval import EvalConfig
from configs.load import CONFIG_DIR, apply_overrides, config_path, read_config_file, validated
from configs.schema import ExperimentConfig

SWEEP_DIR = CONFIG_DIR / "sweeps"
# Keys a cell may not set: the sweep names and places each cell's run itself.
RESERVED_KEYS = ("name", "run_root")
MAX_CELLS = 256


class SweepSpec(_Strict):
    """What to run: every cell is the ``base`` config with ``overrides`` and then the cell's own
    dotted keys applied, run through the whole pipeline in its own run directory
    (``<sweep_dir>/cells/<cell>``).

    Raises :class:`pydantic.ValidationError` naming the field: an empty sweep (no grid axis and no
    cell), an axis without values, a key that names or places the run (``name``, ``run_root``), a
    shared override that a grid axis also sets (the grid would silently win).
    """

    name: str = Field(
        "sweep",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the sweep's name: its folder (<sweep_root>/<name>), its concurrency limit "
        "(sweep-<name>) and its report's title",
    )
    base: str = Field(
        "tiny",
        min_length=1,
        description="the config every cell starts from: a shipped config's name (default, failure, moe, "
        "tiny, vit, vit_moe, chaos) or the path of a YAML config (relative to the repository)",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted keys applied to the base in every cell before the cell's own, e.g. "
        '{"finetune.enabled": false}',
    )
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description='axes: a dotted config key and its values, e.g. {"diloco.learners": [2, 4, 8], '
        '"diloco.quorum": [1, 2]}; every combination is one cell (the first key '
        "varies slowest)",
    )
    cells: list[dict[str, Any]] = Field(
        default_factory=list,
        description="cells listed one by one (after the grid's), each a dict of dotted keys, e.g. "
        '[{"model.kind": "moe_lm", "model.n_experts": 4}]',
    )
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None,
        min_length=1,
        description="every cell trains each method once per seed (the cells' config key seeds; "
        "each cell's report gives means with 95 % intervals and the paired gap), e.g. [0, 1, 2]; with reuse_dp, "
        "DP is trained once per seed for the whole sweep. Unset: the base config's seeds, or its one seed",
    )
    concurrency: PositiveInt = Field(
        1,
        description="cells running at once, enforced by the Prefect global concurrency limit sweep-<name> "
        "(created or updated to this value when the sweep starts)",
    )
    launch: Literal["subflow", "deployment"] = Field(
        "subflow",
        description="subflow: each cell is a child flow run of the pipeline in the sweep's own process "
        "(runs anywhere, no worker needed); deployment: each cell is a run of the "
        "`deployment` below, executed by a worker of its work pool in its own process",
    )
    deployment: str = Field(
        "pipeline/default",
        pattern=r"^pipeline/[A-Za-z0-9_.-]+$",
        description="with launch: deployment, the pipeline deployment that runs each cell "
        "(its parameters are replaced by the cell's whole config)",
    )
    sweep_root: str = Field("runs/sweeps", min_length=1, description="local folder holding sweep folders")
    reuse_dp: bool = Field(
        True,
        description="true: cells whose DP settings are the same (configs.sweep.dp_digest: data, model, "
        "seed, training, DP, precision) train and evaluate DP once and share it (<sweep folder>/dp/); "
        "false: every cell trains its own",
    )
    resume: bool = Field(
        True,
        description="true: the sweep's folder is <sweep_root>/<name>, and re-running the sweep skips every "
        "cell whose run there completed with the same resolved config; false: a new folder "
        "<sweep_root>/<name>-<UTC time> each time (e.g. a nightly schedule)",
    )

    @model_validator(mode="after")
    def _check(self) -> SweepSpec:
        if not self.grid and not self.cells:
            raise ValueError(
                "grid: the sweep is empty (no grid axis and no cells); give at least one axis, e.g. "
                "grid: {diloco.learners: [2, 4]}, or one cell"
            )
        for key, values in self.grid.items():
            _check_key(f"grid.{key}", key)
            if not values:
                raise ValueError(f"grid.{key}: no values; give a list of at least one value, e.g. [2, 4]")
            dupes = [v for i, v in enumerate(values) if _canonical(v) in map(_canonical, values[:i])]
            if dupes:
                raise ValueError(f"grid.{key}: the value {dupes[0]!r} is listed twice")
        for i, cell in enumerate(self.cells):
            if not cell:
                raise ValueError(f"cells[{i}]: an empty cell; give its dotted keys, e.g. {{diloco.learners: 8}}")
            for key in cell:
                _check_key(f"cells[{i}].{key}", key)
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeats a seed; list each once")
        for where, keys in (
            ("overrides", self.overrides),
            ("grid", self.grid),
            *((f"cells[{i}]", c) for i, c in enumerate(self.cells)),
        ):
            if self.seeds is not None and any(k in ("seed", "seeds") for k in keys):
                raise ValueError(
                    f"{where}: sets the seed while the sweep's seeds ({self.seeds}) set every cell's; "
                    "remove one of them"
                )
        for key in self.overrides:
            _check_key(f"overrides.{key}", key)
            axis = next((a for a in self.grid if a == key or a.startswith(key + ".") or key.startswith(a + ".")), None)
            if axis is not None:
                raise ValueError(
                    f"overrides.{key}: also set by the grid's axis {axis}, whose values would replace it in "
                    f"every cell; remove {key} from overrides (or {axis} from grid)"
                )
        n = (_product_size(self.grid) if self.grid else 0) + len(self.cells)
        if n > MAX_CELLS:
            raise ValueError(f"grid: {n} cells, more than {MAX_CELLS}; split the sweep")
        return self


def _check_key(where: str, key: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ValueError(f"{where}: {key!r} is not a dotted config key (e.g. diloco.learners)")
    if key.split(".")[0] in RESERVED_KEYS:
        raise ValueError(
            f"{where}: the sweep names and places every cell's run; remove {key} (set sweep_root or "
            "the sweep's name instead)"
        )


def _product_size(grid: dict[str, list]) -> int:
    n = 1
    for values in grid.values():
        n *= len(values)
    return n


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


@dataclass(frozen=True)
class Cell:
    """One cell: ``name`` (a folder name made from its overrides, e.g. ``learners-2_quorum-1``) and
    ``overrides`` (its own dotted keys, without the sweep's shared ``overrides``)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _slug(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ""), default=str)
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "x"


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key's shortest unambiguous suffix (``diloco.learners`` → ``learners``; two keys
    ending in ``lr`` keep enough of their path to differ)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = "-".join(parts[-n:])
            if sum(1 for k in keys if "-".join(k.split(".")[-n:]) == short) == 1 or n == len(parts):
                out[key] = short
                break
    return out


def expand_cells(spec: SweepSpec) -> list[Cell]:
    """The sweep's cells in run order: the grid's combinations (first key slowest), then ``cells``.

    Names are ``<key>-<value>`` joined by ``_`` with each key shortened to its last unambiguous
    part (``learners-2_quorum-1``); a name shared by two cells gets ``-2``, ``-3`` appended.
    Raises ``ValueError`` when two cells set the very same overrides.
    """
    raw: list[dict[str, Any]] = []
    if spec.grid:
        keys = list(spec.grid)
        raw += [dict(zip(keys, combo)) for combo in itertools.product(*spec.grid.values())]
    raw += [dict(c) for c in spec.cells]
    all_keys = list(dict.fromkeys(k for c in raw for k in c))
    short = _short_keys(all_keys)
    cells: list[Cell] = []
    seen: dict[str, int] = {}
    names: set[str] = set()
    for i, overrides in enumerate(raw):
        canon = _canonical(overrides)
        if canon in seen:
            raise ValueError(
                f"cells: cell {i + 1} sets the same overrides as cell {seen[canon] + 1} ({overrides}); "
                "list each combination once"
            )
        seen[canon] = i
        name = "_".join(f"{short[k]}-{_slug(v)}" for k, v in overrides.items())[:120] or f"cell-{i + 1}"
        base, n = name, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.add(name)
        cells.append(Cell(name=name, overrides=overrides))
    return cells


def cell_config(spec: SweepSpec, cell: Cell, base_raw: dict | None = None) -> ExperimentConfig:
    """The cell's resolved config: the base file's values, ``spec.overrides``, the cell's
    overrides, and ``name`` = the cell's name (through ``configs.load.apply_overrides``: a value that
    is a mapping, e.g. an axis ``diloco: [{learners: 2}, {learners: 4}]``, merges into the section).
    ``base_raw``: the base file's mapping, if already read. Raises ``ValueError`` in one line naming
    the cell and the field."""
    raw = base_raw if base_raw is not None else read_config_file(config_path(spec.base))
    where = f"sweep {spec.name}, cell {cell.name}"
    try:
        merged = apply_overrides(apply_overrides(raw, spec.overrides), cell.overrides)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    merged["name"] = cell.name
    if spec.seeds is not None:
        merged["seeds"] = list(spec.seeds)
    return validated(merged, where)


def config_digest(data: dict) -> str:
    """sha256 of a resolved config's canonical JSON (``data``: ``model_dump(mode="json")``, or a
    stored ``config.json``): a cell's identity for resuming."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def dp_digest(cfg: ExperimentConfig) -> str:
    """sha256 of exactly what a DP baseline's result depends on: the data, model, seed, training
    and evaluation settings, DP's own section, the precision policy, the chaos it meets (when
    ``chaos.against_dp``) and the derived batch and steps. Cells and trials with one digest train
    DP once (``flows.pipeline``'s ``dp_cache``); DiLoCo's settings, the runtime and the network
    are not part of it."""
    data = cfg.model_dump(mode="json", include={"seed", "data", "model", "train", "dp", "precision"})
    data["data"].pop("cache_dir", None)  # where the corpus is cached, not what it is
    chaos = cfg.chaos_schedule() if cfg.chaos.against_dp else None
    data["chaos"] = json.loads(chaos.dumps()) if chaos is not None else None
    data["derived"] = {
        "dp_batch_size": cfg.dp_batch_size,
        "tokens_per_dp_step": cfg.tokens_per_dp_step,
        "dp_steps": cfg.dp_steps,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def dp_eval_digest(trained: str, eval_cfg: EvalConfig) -> str:
    """sha256 of what DP's evaluation depends on: its result (``trained``, its :func:`dp_digest`) and
    the ``eval`` section ``eval_cfg``. Runs with one digest evaluate DP once (``flows.pipeline``'s
    ``dp_cache``)."""
    data = {"dp": trained, "eval": eval_cfg.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def shipped_sweeps() -> list[Path]:
    return sorted(SWEEP_DIR.glob("*.yaml"))
