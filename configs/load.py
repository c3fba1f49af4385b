"""Reading a config: YAML files (YAML 1.2 scalars, no duplicate keys), shipped names or paths,
``--set`` overrides, and validation errors rewritten as one line per field naming the fix.

These are the pieces; :func:`configs.specs.load_spec` puts them together for every command (a
config, a sweep or a study, refused in one line)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from configs.base import Strict as _Strict
from configs.data import DATA_MODALITIES, IMAGE_SOURCES, TEXT_SOURCES
from configs.faults import EVENT_KINDS
from configs.model import MODEL_KINDS
from configs.schema import ExperimentConfig

CONFIG_DIR = Path(__file__).resolve().parent


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars and no duplicate keys.

    PyYAML follows YAML 1.1, where ``3e-4`` is a string, ``010`` is 8 (octal), ``1:30`` is 90
    (base 60) and ``yes``/``on`` are booleans. Here numbers are YAML 1.2 (``3e-4`` a float, ``010``
    ten, ``1:30`` a string; ``_`` between digits is allowed, as in Python), only ``true``/``false``
    are booleans, and a key given twice in one mapping is an error instead of the last one winning.
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain name, not {type(key).__name__}", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag
        not in (
            "tag:yaml.org,2002:bool",
            "tag:yaml.org,2002:int",
            "tag:yaml.org,2002:float",
            "tag:yaml.org,2002:timestamp",
        )
    ]  # YAML 1.2 core has no dates: 2001-12-14 is a string
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"),
    list("-+0123456789"),
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_int(loader, node):
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    text = text.lstrip("+-")
    if text.startswith("0o"):
        return sign * int(text[2:], 8)
    if text.startswith("0x"):
        return sign * int(text[2:], 16)
    return sign * int(text, 10)  # YAML 1.2: a leading zero is still decimal


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def yaml_value(text: str) -> Any:
    """One YAML scalar or flow collection, parsed like a config file's values (``3e-4`` → float)."""
    return yaml.load(text, Loader=ConfigLoader)


def config_path(name_or_path: str | Path) -> Path:
    """A shipped config's name (``default``, ``tiny``, ``failure``: ``configs/<name>.yaml``) or a
    path to a YAML file. Raises ``FileNotFoundError`` naming both places looked at."""
    return shipped_or_path(name_or_path, CONFIG_DIR, "config")


def shipped_or_path(name_or_path: str | Path, folder: Path, what: str) -> Path:
    """``name_or_path`` if it is a file, else ``folder/<name>.yaml`` (a shipped ``what``: config,
    sweep). Raises ``FileNotFoundError`` naming both places looked at and the shipped names."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = folder / f"{name_or_path}.yaml"
    if re.fullmatch(r"[A-Za-z0-9_.-]+", str(name_or_path)) and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise FileNotFoundError(
        f"{what} file not found: {name_or_path} (neither a file nor a shipped {what}; shipped: {names})"
    )


def apply_overrides(raw: dict, overrides: dict | None) -> dict:
    """``raw`` with dotted keys (``{"diloco.learners": 2}``) set; returns a new dict.

    A mapping given for a section merges into it, key by key at every depth (``diloco={learners: 4}``
    sets ``diloco.learners`` and keeps the file's other ``diloco`` values, like ``diloco.learners=4``);
    any other value (a number, a string, a list) replaces what was there.
    Raises ``ValueError`` when a key goes below a single value (``diloco.learners.x``)."""
    import copy

    raw = copy.deepcopy(raw)
    for key, value in (overrides or {}).items():
        node = raw
        *parents, leaf = str(key).split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"--set {key}: {'.'.join(parents[: i + 1])} is a single value, not a section; "
                    f"set it directly ({'.'.join(parents[: i + 1])}=...)"
                )
        node[leaf] = _merged(node.get(leaf), copy.deepcopy(value))
    return raw


def _merged(old, new):
    """``new`` deep-merged into ``old`` when both are mappings (``new``'s keys win), else ``new``. A
    mapping that names another ``kind`` (a model family) replaces the section: the old family's
    fields would not fit the new one."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    if "kind" in new and new["kind"] != old.get("kind", new["kind"]):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


EMPTY_CONFIG = (
    "an empty config would run the schema's defaults, not what you meant; write the sections to use, e.g. "
    "start from configs/default.yaml"
)


def read_config_file(
    path: str | Path, what: str = "config", empty: str = EMPTY_CONFIG, keys: str = "config sections"
) -> dict:
    """The raw mapping of a YAML file (read with :class:`ConfigLoader`): a config, or a sweep or
    study file (``what``; ``empty``: why an empty one is refused, ``keys``: what its top level holds).

    Raises ``FileNotFoundError`` for a missing file, ``yaml.YAMLError`` for malformed YAML, and
    ``ValueError`` for a file that is not UTF-8, an empty file (or one holding only comments: it
    would silently mean the schema's defaults) or a top level that is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text (byte at offset {exc.start}); a {what} is a YAML text file"
        ) from None
    raw = yaml.load(text, Loader=ConfigLoader)
    if raw is None:
        raise ValueError(f"{path} is empty (or holds only comments): {empty}")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping ({keys})")
    return raw


def load_config(path: str | Path, overrides: dict | None = None) -> ExperimentConfig:
    """Read a YAML file into an :class:`ExperimentConfig`.

    ``overrides`` are dotted keys (``{"diloco.learners": 2}``) applied before validation.
    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for an empty one and
    ``pydantic.ValidationError`` (naming the field) for bad content. (The commands load through
    :func:`configs.specs.load_spec`, which refuses in one line.)
    """
    return ExperimentConfig.model_validate(apply_overrides(read_config_file(path), overrides))


def stored_config(raw: dict) -> ExperimentConfig:
    """A run directory's ``config.json`` (the resolved config the pipeline wrote) as the typed config,
    for code that reads a finished run, e.g. its report. Validated as written (context
    ``{"stored": True}``), without the checks that look at this machine's files
    (``chaos.reference_run``'s folder): a report may be built where those files are not. A section
    missing from an older run's file takes today's defaults; ``model_fields_set`` tells which were
    written; the fault keys from before ``chaos.events`` are read as the events they were. Raises
    ``pydantic.ValidationError`` for a file this schema no longer reads."""
    return ExperimentConfig.model_validate(raw, context={"stored": True})


def validated(raw: dict, where: str, given: dict[str, str] | None = None, model: type[BaseModel] = ExperimentConfig):
    """``raw`` validated as ``model`` (the config by default). A validation error is raised as one
    ``ValueError`` line: ``where``, then each field's problem (:func:`validation_lines`; a field in
    ``given``, dotted path -> the command-line option that set it, names that option)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{where}: " + "; ".join(validation_lines(exc, given=given))) from None


def option_text(option: str, key: str, value: Any) -> str:
    """How ``key=value`` reads on the command line after ``option``: ``--set chaos.events=[{kind: fail}]``
    (the value as YAML, the way it is written there, not Python's repr)."""
    if not isinstance(value, str):
        value = yaml.safe_dump(value, default_flow_style=True, sort_keys=False).removesuffix("\n...\n")
    return f"{option} {key}={value.strip()}"


def parse_overrides(items: list[str], option: str = "--set", example: str = "diloco.learners=2") -> dict:
    """``["diloco.learners=2", "seeds=5"]`` → ``{"diloco.learners": 2, "seeds": 5}`` (values parsed as YAML).

    Raises ``ValueError`` naming the option and the item that is not ``key=value``, or the key given
    twice (the later value would silently win; a YAML file refuses a repeated key the same way).
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} expects key=value (e.g. {example}), got {item!r}")
        try:
            parsed = yaml_value(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"{option} {item!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
        if key in out:
            raise ValueError(f"{option} {key} is given twice ({out[key]!r}, then {parsed!r}); give each key once")
        out[key] = parsed
    return out


# keys of earlier versions of this schema -> what replaced them (named when an old config uses them)
RENAMED = {
    "diloco.keep_in_flight": "replaced by diloco.receipt: keep_in_flight (or overwrite, mix)",
}


def validation_lines(
    exc: ValidationError, overrides: dict | None = None, option: str = "--set", given: dict[str, str] | None = None
) -> list[str]:
    """One line per validation error, the field path first (no pydantic boilerplate), with the value
    given; an error in a field that ``overrides`` set (dotted keys, as :func:`parse_overrides`
    returns) names it as ``option key=value``, so a refusal points at the command line, not the file.
    ``given``: more fields and how the command line gave them (dotted path -> text, e.g.
    ``{"concurrency": "--concurrency 0"}``)."""
    from_cli = {**{k: option_text(option, k, v) for k, v in (overrides or {}).items()}, **(given or {})}
    lines = []
    for err in exc.errors():
        parts = list(err["loc"])
        # pydantic puts a union member's tag in the path: drop it, keep the member (its fields are the
        # valid keys) and the depth of its own fields
        member = owner = None
        depth = 2
        if len(parts) >= 2 and parts[0] == "model" and parts[1] in MODEL_KINDS:
            member = owner = MODEL_KINDS[parts.pop(1)]
        if len(parts) >= 2 and parts[0] == "data" and parts[1] in DATA_MODALITIES:
            owner = DATA_MODALITIES[parts.pop(1)]
        if len(parts) >= 4 and parts[:2] == ["chaos", "events"] and parts[3] in EVENT_KINDS:
            owner, depth = EVENT_KINDS[parts.pop(3)], 4
        err = {**err, "loc": tuple(parts)}
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in parts).lstrip(".")  # chaos.events[0].kind
        msg = err["msg"].removeprefix("Value error, ")
        section_keys = _valid_keys(exc.title, err["loc"]) if err["type"] == "model_type" else []
        if section_keys:  # a value where a section belongs, e.g. `precision: bfloat16`
            value = err.get("input")
            shown = ", ".join(f"{loc}.{k}" for k in section_keys[:6]) + (", …" if len(section_keys) > 6 else "")
            msg = f"is a section, not a value (got {value!r}); set its keys: {shown}"
        elif err["type"].endswith("_type") and "input" in err and not isinstance(err["input"], (dict, list)):
            value = err["input"]  # strict types: say what was given, e.g. `true` where a number belongs
            if err["type"] == "list_type":  # e.g. `seeds=3` where a list belongs
                msg += f" (got {value!r}; write a YAML list, e.g. [{value!r}] or [0, 1, 2])"
            else:
                msg += f" (got {value!r}, a {type(value).__name__}; write it as a plain YAML value of that type)"
        elif (
            err["type"] != "extra_forbidden" and isinstance(err.get("input"), (str, int, float)) and loc not in from_cli
        ):  # (a value given on the command line is shown below)
            msg += f" (got {err['input']!r})"  # e.g. `float16` where float32 or bfloat16 belongs
        if err["type"] == "model_kind":
            got = err["input"].get("kind") if isinstance(err["input"], dict) else err["input"]
            loc, msg = "model.kind", f"{got!r} is unknown; choose one of {', '.join(MODEL_KINDS)}"
        if err["type"] == "event_kind":
            got = err["input"].get("kind") if isinstance(err["input"], dict) else None
            loc = f"{loc}.kind"
            msg = f"{got!r} is unknown" if got is not None else "is missing"
            msg += f"; choose one of {', '.join(EVENT_KINDS)}"
        if err["type"] == "data_source":
            got = err["input"].get("source") if isinstance(err["input"], dict) else err["input"]
            loc, msg = "data.source", f"{got!r} is unknown; choose one of {', '.join(TEXT_SOURCES + IMAGE_SOURCES)}"
        if err["type"] == "extra_forbidden":
            if member is not None and len(parts) == 2:
                owners = [k for k, c in MODEL_KINDS.items() if parts[1] in c.model_fields]
                if owners:
                    msg += f" for kind {member.model_fields['kind'].default} (a field of kind: {', '.join(owners)})"
            if loc in RENAMED:
                msg += f" ({RENAMED[loc]})"
            own = owner is not None and len(parts) == depth
            keys = list(owner.model_fields) if own else _valid_keys(exc.title, err["loc"][:-1])
            close = difflib.get_close_matches(str(parts[-1]), keys, n=1, cutoff=0.6) if keys and parts else []
            if close:  # a typo: name the key it most likely meant
                prefix = loc.rsplit(".", 1)[0] + "." if "." in loc else ""
                msg += f"; did you mean {prefix}{close[0]}?"
            if keys:
                msg += f" (valid keys here: {', '.join(keys)})"
        # a cross-field error (no loc) names its field first, e.g. "chaos.events[0] (kill): …"
        if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            field = _field(exc.title, err["loc"])  # a range: say what the number means (and if null is the way out)
            if field is not None and field.description:
                msg += f" ({field.description})"
        # a cross-field error is traced to every field it names, e.g. network.emulate and runtime.engine
        named = [loc] if loc else re.findall(r"\b[a-z_]+(?:\.[a-z_]+|\[\d+\])+", msg)
        paths = {re.sub(r"\[\d+\]", "", p) for p in named}
        shown = [
            text
            for k, text in from_cli.items()
            if any(p == k or p.startswith(k + ".") or k.startswith(p + ".") for p in paths)
        ]
        if shown:
            msg += f" (from {', '.join(shown)})"
        if loc and msg.startswith(loc.split(".")[0] + "."):  # cross-field errors already name it
            lines.append(msg)
        else:
            lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def _is_section(x) -> bool:
    return isinstance(x, type) and issubclass(x, BaseModel)


def _field(title: str, loc: tuple):
    """The pydantic ``FieldInfo`` at ``loc`` of the model titled ``title`` (None when it cannot be
    resolved, e.g. inside a list such as ``chaos.events``)."""
    section, field = {"ExperimentConfig": ExperimentConfig}.get(title) or _strict_model(title), None
    for part in loc:
        field = section.model_fields.get(str(part)) if _is_section(section) else None
        section = field.annotation if field else None
    return field


def _valid_keys(title: str, loc: tuple) -> list[str]:
    """The field names of the config section at ``loc`` (empty when it cannot be resolved, e.g.
    inside a list such as ``chaos.events``)."""
    if loc:
        field = _field(title, loc)
        section = field.annotation if field else None
    else:
        section = {"ExperimentConfig": ExperimentConfig}.get(title) or _strict_model(title)
    return list(section.model_fields) if _is_section(section) else []


def _strict_model(title: str) -> type[BaseModel] | None:
    """The strict model class (a subclass of ``_Strict``, e.g. ``configs.sweep.SweepSpec``) whose
    validation errors carry ``title``, or None."""
    todo = list(_Strict.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__name__ == title:
            return cls
        todo += cls.__subclasses__()
    return None
