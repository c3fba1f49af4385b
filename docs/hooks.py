"""MkDocs hooks (mkdocs.yml `hooks:`): pages made at build time from the repository itself.

- `configuration.md`: the configuration reference, read from the pydantic models (every section and
  field of `configs.schema.ExperimentConfig`, then `configs.sweep.SweepSpec` and
  `configs.tune.TuneSpec`): each field's type, default and `description`, each section's docstring.
- `records/<file>`: every dated record in `benchmarks/results/` (Markdown and its figures), so the
  results page links to them; a record that `results.md` does not link is a warning (an error
  under `mkdocs build --strict`).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import sys
import types
import typing
from pathlib import Path

from mkdocs.structure.files import File
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results"
log = logging.getLogger("mkdocs.hooks")


def _models_in(tp) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (through Optional, unions, lists, Annotated)."""
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return [tp]
    found = []
    for arg in typing.get_args(tp):
        for m in _models_in(arg):
            if m not in found:
                found.append(m)
    return found


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if inspect.isclass(tp) and not typing.get_args(tp):
        return "None" if tp is type(None) else tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    name = getattr(origin, "__name__", str(origin))
    return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _member_tag(model: type[BaseModel]) -> str:
    """How a union member is picked: its ``kind`` or ``source`` literal(s), e.g. "kind: vit"."""
    for name in ("kind", "source"):
        field = model.model_fields.get(name)
        if field is not None and typing.get_origin(field.annotation) is typing.Literal:
            return f"{name}: {' | '.join(str(v) for v in typing.get_args(field.annotation))}"
    return ""


def _section(model: type[BaseModel], path: str, level: int, out: list[str], kind: str = "") -> None:
    doc = inspect.getdoc(model) if model.__doc__ else ""
    if path:  # a top-level model's table sits under its page section's heading
        out += [f"{'#' * level} `{path}`" + (f" with `{kind}`" if kind else "") + f" ({model.__name__})", ""]
    if doc:
        out += [re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", doc.split("\n\n")[0].replace("``", "`")), ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        out.append(
            f"| `{key}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} "
            f"| {_cell(field.description or '')} |"
        )
        subs = _models_in(field.annotation)
        suffix, tp = "", field.annotation
        while typing.get_origin(tp) in (list, dict):  # chaos.events[], study space.<key>.<key>
            suffix += "[]" if typing.get_origin(tp) is list else ".<key>"
            tp = typing.get_args(tp)[-1]
        for sub in subs:  # a union's members are told apart by their `kind` (model, chaos events) or `source` (data)
            nested.append((sub, key + suffix, _member_tag(sub) if len(subs) > 1 else ""))
    out.append("")
    for sub, key, tag in nested:
        _section(sub, key, min(level + 1, 4), out, tag)


def config_reference() -> str:
    if str(ROOT) not in sys.path:  # mkdocs runs from anywhere; the configs package is at the root
        sys.path.insert(0, str(ROOT))
    from configs.schema import ExperimentConfig
    from configs.sweep import SweepSpec
    from configs.tune import TuneSpec

    out = [
        "# Configuration reference",
        "",
        "Generated when the site is built, from the pydantic models themselves (`configs/schema.py` and "
        "its sections, one module each: `configs/data.py`, `model.py`, `methods.py`, `runtime.py`, `chaos.py`, "
        "`faults.py`, `finetune.py`, `eval.py`; "
        "`configs/sweep.py`, `configs/tune.py`): every section and field with its type, its default and "
        "the schema's description. Set a field in a YAML file or with `--set section.field=value`; "
        "`ddiloco validate FILE` checks a config without running it.",
        "",
        "## Experiment config (`ddiloco run`, `ddiloco validate`)",
        "",
    ]
    _section(ExperimentConfig, "", 2, out)
    out += ["## Sweep file (`configs/sweeps/*.yaml`, `ddiloco sweep`)", ""]
    _section(SweepSpec, "", 2, out)
    out += ["## Study file (`configs/studies/*.yaml`, `ddiloco tune`)", ""]
    _section(TuneSpec, "", 2, out)
    return "\n".join(out) + "\n"


def on_files(files, config):
    files.append(File.generated(config, "configuration.md", content=config_reference()))
    linked = (Path(config["docs_dir"]) / "results.md").read_text(encoding="utf-8")
    for record in sorted(RECORDS.iterdir()):
        if record.suffix in (".md", ".png"):
            files.append(File.generated(config, f"records/{record.name}", abs_src_path=str(record)))
        if record.suffix == ".md" and f"records/{record.name}" not in linked:
            log.warning("benchmarks/results/%s is not linked from results.md: add it to the records table", record.name)
    return files
