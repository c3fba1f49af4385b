"""Names of flow runs and task runs as the Prefect UI lists them.

Flow runs are named from what they run, not Prefect's random ``adjective-animal``: a pipeline run
``<config name>-<UTC start>`` (renamed to its run directory's name once that is known, see
:func:`rename_flow_run`), ``pretrain-diloco-<run>``, ``pretrain-dp-<run>``, ``finetune-<run>``,
``sweep-<name>``, ``tune-<study>``. Each function here is a Prefect ``flow_run_name`` callable: it
reads the run's parameters through ``prefect.runtime`` and never raises (a name is never worth a
failed start: it falls back to the flow's name and the time).
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


def _field(value: Any, name: str) -> Any:
    """``value.name`` for a model, ``value[name]`` for a dict, else None."""
    if isinstance(value, dict):
        return value.get(name)
    return getattr(value, name, None)


def _stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")


def pipeline_run_name() -> str:
    """The run directory's name when ``run_dir`` is given (``ddiloco run`` always gives it: its log
    lines then carry the directory's name from the first); else ``<config name>-<UTC time>``, the
    name from ``overrides``, ``config_file`` (its stem: a shipped config is named after its file) or
    ``config``: the run directory's form (renamed to the directory's name once it is chosen)."""
    p = _params()
    if given := _run_dir_name(p):
        return given
    name = (p.get("overrides") or {}).get("name")
    if not name and p.get("config_file"):
        name = Path(str(p["config_file"])).stem
    name = name or _field(p.get("config"), "name") or "pipeline"
    return f"{name}-{_stamp()}"


def _run_dir_name(p: dict[str, Any]) -> str | None:
    rd = p.get("run_dir")
    return Path(str(rd)).name if rd else None


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
    p = _params()
    name = Path(str(p["sweep_file"])).stem if p.get("sweep_file") else _field(p.get("spec"), "name")
    return f"sweep-{name or _stamp()}"


def tune_run_name() -> str:
    """``tune-<study name>``: the study file's stem when one is given, else the spec's ``name``."""
    p = _params()
    name = Path(str(p["study_file"])).stem if p.get("study_file") else _field(p.get("spec"), "name")
    return f"tune-{name or _stamp()}"


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
