"""Names of flow runs as the Prefect UI lists them: a pipeline run ``<config name>-<UTC start>``
(its run directory's name once known, :func:`rename_flow_run`), ``pretrain-<method>-<run>``,
``finetune-<run>``, ``sweep-<name>``, ``tune-<study>``. Each function is a Prefect ``flow_run_name``
callable: it reads the run's parameters through ``prefect.runtime`` and never raises (a name is never
worth a failed start: it falls back to the flow's name and the time).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any


def _params() -> dict[str, Any]:
    from prefect.runtime import flow_run

    try:
        return dict(flow_run.parameters or {})
    except Exception:  # noqa: BLE001 - outside a flow run
        return {}


def _stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")


def _run_dir_name(p: dict[str, Any]) -> str | None:
    return Path(str(p["run_dir"])).name if p.get("run_dir") else None


def _named(p: dict[str, Any], file_key: str, value_key: str) -> str | None:
    """The stem of parameter ``file_key`` (a shipped spec is named after its file), else the ``name``
    of parameter ``value_key`` (a model or its dict)."""
    if p.get(file_key):
        return Path(str(p[file_key])).stem
    value = p.get(value_key)
    return value.get("name") if isinstance(value, dict) else getattr(value, "name", None)


def pipeline_run_name() -> str:
    """The run directory's name when ``run_dir`` is given (``ddiloco run`` always gives it); else
    ``<name>-<UTC time>``, the name from ``overrides``, ``config_file`` or ``config``."""
    p = _params()
    if given := _run_dir_name(p):
        return given
    name = (p.get("overrides") or {}).get("name") or _named(p, "config_file", "config") or "pipeline"
    return f"{name}-{_stamp()}"


def pretrain_run_name(method: str):
    """``pretrain-<method>-<run directory's name>``."""

    def name() -> str:
        return f"pretrain-{method}-{_run_dir_name(_params()) or _stamp()}"

    return name


def finetune_run_name() -> str:
    """``finetune-<run directory's name>`` (or ``finetune-<name>`` for one checkpoint)."""
    p = _params()
    return f"finetune-{_run_dir_name(p) or p.get('name') or _stamp()}"


def sweep_run_name() -> str:
    """``sweep-<sweep name>``: the sweep file's stem when one is given, else the spec's ``name``."""
    return f"sweep-{_named(_params(), 'sweep_file', 'spec') or _stamp()}"


def tune_run_name() -> str:
    """``tune-<study name>``: the study file's stem when one is given, else the spec's ``name``."""
    return f"tune-{_named(_params(), 'study_file', 'spec') or _stamp()}"


def rename_flow_run(name: str) -> None:
    """Give the current flow run the name ``name`` (a pipeline run: its run directory's name, known
    only after the checks). Outside a flow run, or if the API refuses, nothing happens."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        if flow_run.id and flow_run.name != name:
            with get_client(sync_client=True) as client:
                client.update_flow_run(flow_run.id, name=name)
    except Exception:  # noqa: BLE001 - a name is never worth a failed run
        pass
