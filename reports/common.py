"""Names, definitions and small value helpers shared by the report's modules (pure; no I/O). Stage and
method names are the run directory's (``run.layout``); every comparison is against :data:`BASELINE`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import pandas as pd
from pydantic import ValidationError

from configs.load import stored_config
from configs.schema import ExperimentConfig
from run.layout import METHOD_ORDER, REPORT_JSON  # noqa: F401  (re-exported to the report modules)

NOT_RUN = "not run"
BASELINE = "dp"  # every method of a stage is compared with this one
PAPER = (
    'Decoupled DiLoCo (Douillard et al., "Decoupled DiLoCo for Resilient Distributed '
    'Pre-training", arXiv 2604.21428, 2026)'
)
LABELS = {"diloco": "Decoupled DiLoCo", "dp": "Data-parallel"}
SHORT_LABELS = {"diloco": "DiLoCo", "dp": "DP"}
STAGE_LABELS = {"pretrain": "Pretraining", "finetune": "Fine-tuning"}

# What each byte figure counts: report.json's ``definitions``, printed under each bytes table.
BYTES_CONVENTION = (
    "Bytes are payload bytes (tensor bytes, no framing). DiLoCo, counted by the learners: "
    "learner→syncer submission payload bytes (every fragment a learner sent, merged or not, in its "
    "wire format: float32, or a bfloat16/int8/int4 update with its scales) and "
    "syncer→learner pulled bytes (every global fragment a learner pulled, including the pull at "
    "the start of each attempt); counted by the syncer in its merge log: bytes_in (submission "
    "bytes that went into merges) and bytes_out (fragment bytes × M per merge, the publish fan-out "
    "if every learner pulled every version). DP, counted by the model of a ring all-reduce of the "
    "gradient: each of the M workers sends 2(M−1)/M × the gradient bytes per step and receives as "
    "many, so the all-reduce bytes (sent + received, all workers) split evenly: half sent, half "
    'received. "All" figures are summed over all learners/workers and attempts; "per" figures '
    'are that sum divided by M; "per token" figures divide it by the method\'s training tokens.'
)
STALE_DEFINITION = (
    "a stale contribution is a submission merged into a global fragment newer than the one it was "
    "based on, i.e. the syncer had merged that fragment again after the learner pulled it: "
    "merge-log stale > 0 versions behind"
)


def figure_file(stage: str, figure: str, method: str | None = None) -> str:
    """File name of a figure inside ``RUN/report/``: ``<stage>[_<method>]_<figure>.png``."""
    return "_".join(x for x in (stage, method, figure) if x) + ".png"


def md_table(headers: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A markdown (pipe) table by pandas/tabulate; cells as text ("|" escaped, newlines as spaces, not re-parsed)."""
    esc = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return pd.DataFrame([[esc(c) for c in r] for r in rows], columns=[esc(h) for h in headers]).to_markdown(
        index=False, disable_numparse=True
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under 1024 of it: "11.8 MiB" ("" below 1 KiB)."""
    x, unit = float(n), ""
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024:
            break
        x, unit = x / 1024, u
    return f"{x:.1f} {unit}" if unit else ""


def format_value(v: Any, fmt: str = "") -> str:
    """A table cell: ``None`` → "—", strings as is, ints with thousands separators,
    ``fmt == "bytes"`` → "12,345,678 (11.8 MiB)", otherwise ``fmt.format(v)``."""
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(", ", ": "))
    if fmt == "bytes":
        return f"{int(round(v)):,}" + (f" ({human_bytes(v)})" if human_bytes(v) else "")
    if fmt == "int" or (isinstance(v, int) and not fmt):
        return f"{int(round(v)):,}"
    if fmt:
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def with_ci(v: Any, ci: list | None, fmt: str = "{:.4f}") -> str:
    """A value and its interval in one cell: "0.2700 [0.2300, 0.3100]" (``format_value`` of each
    by ``fmt``); "—" for None, no brackets without an interval."""
    if v is None:
        return "—"
    return format_value(v, fmt) + (f" [{format_value(ci[0], fmt)}, {format_value(ci[1], fmt)}]" if ci else "")


def label(method: str) -> str:
    """``Decoupled DiLoCo``, ``Data-parallel``, or the method's folder name."""
    return LABELS.get(method, method)


def short_label(method: str) -> str:
    return SHORT_LABELS.get(method, method)


def stage_label(stage: str) -> str:
    return STAGE_LABELS.get(stage, stage)


def ordered_methods(methods: Iterable[str]) -> list[str]:
    """Known methods first (``run.layout.METHOD_ORDER``), then the others by name."""
    return sorted(set(methods), key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m))


def num(x: Any) -> float | int | None:
    """A JSON number as int/float; bools, strings that are not numbers and None → None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def lid(x: Any) -> int | str:
    """Learner id normalised (``"0"`` and ``0`` are the same learner)."""
    try:
        return int(x)
    except (TypeError, ValueError):
        return str(x)


def sort_key(k: Any) -> tuple:
    """Numbers in numeric order first, then names: fragment and learner ids as dict keys."""
    s = str(k)
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def flatten(d: dict, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dicts as one level with ``sep``-joined keys (``{"inner": {"lr": 1}}`` → ``inner/lr``);
    lists and empty dicts are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= flatten(v, f"{prefix}{k}{sep}", sep) if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def nested(d: Any, keys: Iterable[str]) -> Any:
    """``d[k0][k1]…``, or None where a level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def safe_exp(x: float | None) -> float | None:
    """exp(x) (perplexity from a loss in nats); inf on overflow, None for None."""
    if x is None:
        return None
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def json_safe(x: Any) -> Any:
    """Non-finite floats become the strings "nan"/"inf"/"-inf" so report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def settings(config: dict | None) -> ExperimentConfig | None:
    """A run's ``config.json`` as the typed config (``configs.load.stored_config``); None without one,
    or for a file whose keys this schema refuses (the figures that need it then say so)."""
    if not config:
        return None
    try:
        return stored_config(config)
    except ValidationError:
        return None


def unit_of(config: dict | None) -> str:
    """What the run's budget and losses count (``ExperimentConfig.unit``); ``tokens`` without a config."""
    s = settings(config)
    return s.unit if s is not None else "tokens"


def per_unit(unit: str) -> str:
    """``token`` or ``image``: the loss's denominator (nats per …)."""
    return unit.removesuffix("s")
