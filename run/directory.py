"""Where a run lives and what state it is in: checked before anything is written.

A run directory (``<run_root>/<name>-<UTC time>`` unless given) holds one pipeline run:
``config.json``, ``status.json`` and the stage folders (``docs/contracts.md``). This module decides,
before Prefect or JAX start, whether a path may take a new run, and records the run's state.

Rules (:func:`check_run_dir`): the path must not exist, or be an empty directory, or hold only the
``data/`` folder (and ``config.json``) of an earlier run that never trained, which the data step
reuses when its data config matches (else the data step refuses it). A directory that holds any
results (``pretrain/``, ``finetune/``, ``eval/``, ``report/``; ``checkpoints/`` or ``metrics/`` of
runs written before ``run.layout``) or a
``status.json`` is a run, finished or not, and is never written to by a new run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from run import atomic
from run.layout import RESULT_ENTRIES as _RESULTS, REUSABLE_ENTRIES, STAGES, RunLayout

# what makes a folder a run: this layout's entries, and those of runs written before it
RESULT_ENTRIES = (*_RESULTS, "checkpoints", "metrics")


def is_run(path: str | Path) -> bool:
    """True when ``path`` is a pipeline run's directory: it holds ``status.json``, or (a run written
    before status files) ``config.json`` beside a ``pretrain/`` folder."""
    layout = RunLayout(path)
    return layout.status.is_file() or (layout.config.is_file() and (layout.root / "pretrain").is_dir())


RUN_DIR_CONTENTS = (
    "a run directory is the folder the pipeline creates: it holds config.json and, once training "
    f"ran, <stage>/<method>/ folders ({', '.join(f'{s}/' for s in STAGES)}; also data/, eval/, report/)"
)


class NotARunDirectory(ValueError):
    """``path`` is not a run directory a report can be read from; ``problem`` says why. The message
    starts with the path."""

    def __init__(self, path, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")


def readable_run(run_dir: str | Path) -> RunLayout:
    """The layout of ``run_dir`` (a local path or fsspec URL) once it is known to be a run directory
    to read (a report's input; checked before the report's libraries load).

    Raises :class:`NotARunDirectory` naming the path when it does not exist, is not a directory, or
    holds neither ``config.json`` nor a stage with a method.
    """
    layout = RunLayout(run_dir)
    if not layout.root.is_dir():
        what = "is not a directory" if layout.root.exists() else "does not exist"
        raise NotARunDirectory(layout.root, f"{what}; {RUN_DIR_CONTENTS}")
    if not layout.config.is_file() and not layout.stages():
        stages = " or ".join(f"{s}/" for s in STAGES)
        raise NotARunDirectory(
            layout.root,
            f"not a run directory (no config.json and no {stages} folder holding a method); {RUN_DIR_CONTENTS}",
        )
    return layout


def default_run_dir(run_root: str | Path, name: str) -> Path:
    """``<run_root>/<name>-<UTC timestamp>`` (seconds), absolute. ``ValueError`` for a URL."""
    if "://" in str(run_root):
        raise ValueError(f"run_root {run_root} is a URL; runs are written to a local folder: give a local path")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return (Path(run_root).expanduser() / f"{name}-{stamp}").absolute()


def check_run_dir(path: str | Path) -> Path:
    """The absolute path if a new run may be written there; writes nothing.

    Raises ``ValueError`` (one line naming the path and the fix) when the path or one of its
    parents is a file, the nearest existing parent is not writable, or the directory already
    holds a run (see the module docstring).
    """
    if not str(path).strip():
        raise ValueError("run directory is empty or blank; give a folder name with --run-dir")
    if "://" in str(path):
        raise ValueError(
            f"run directory {path} is a URL; runs are written to a local folder (run_root or "
            "--run-dir): give a local path"
        )
    path = Path(os.path.normpath(Path(path).expanduser().absolute()))
    if path.is_symlink() and not path.exists():
        raise ValueError(f"run directory {path} is a dangling symbolic link; choose another --run-dir")
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {path} exists and is not a directory; choose another --run-dir")
    real = path.resolve()  # a symbolic link must not lead inside a run either
    for above in [*path.parents, *(real.parents if real != path else [])]:  # never nested in a run
        if is_run(above):
            raise ValueError(f"run directory {path} is inside the run directory {above}; choose a path outside it")
    parent = path
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if parent.is_symlink() and not parent.exists():
        raise ValueError(f"run directory {path}: {parent} is a dangling symbolic link; choose another --run-dir")
    if not parent.is_dir():
        raise ValueError(
            f"run directory {path}: {parent} is a file, not a folder, so nothing can be created under it; "
            "choose another --run-dir (or run_root)"
        )
    if path.is_dir():  # a run is refused before anything is created inside it (even a probe)
        entries = sorted(p.name for p in path.iterdir())
        taken = [e for e in entries if e in RESULT_ENTRIES]
        if taken:
            status = read_status(path).get("status", "unknown state")
            raise ValueError(
                f"run directory {path} already holds a run ({status}; {', '.join(taken)}); a run is never "
                "written over: choose a new --run-dir"
            )
        other = [e for e in entries if e not in REUSABLE_ENTRIES or (e == "config.json" and "data" not in entries)]
        if other:
            raise ValueError(
                f"run directory {path} is not empty ({', '.join(other[:5])}) and is not a run directory; "
                "choose a new or empty --run-dir"
            )
    _probe_writable(parent, path)
    return path


def _probe_writable(parent: Path, path: Path) -> None:
    """Create and remove an empty folder in ``parent``: permission bits do not tell (root may write
    anywhere by them, yet not in /proc or on a read-only mount). Raises ``ValueError``."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ddiloco-probe-", dir=parent))
    except OSError as exc:
        raise ValueError(
            f"run directory {path}: nothing can be created in {parent} ({exc.strerror or exc}); choose another "
            "--run-dir (or run_root)"
        ) from None


def claim_run_dir(path: str | Path) -> Path:
    """Create ``path`` (checked by :func:`check_run_dir`) and claim it for this run by creating its
    ``status.json`` exclusively: of two runs started on one new directory, the second is refused
    (``FileExistsError`` naming it) instead of writing beside the first."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(RunLayout(path).status, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        raise FileExistsError(f"run directory {path} was just claimed by another run; choose a new --run-dir") from None
    return path


def write_status(
    run_dir: str | Path, status: str, completed_stages: list[str], reason: str | None = None, **extra
) -> dict:
    """Record the run's state in ``RUN/status.json`` (atomically) and return the record.

    ``status``: ``running`` | ``completed`` | ``interrupted`` | ``failed``; ``completed_stages``: the
    stages finished so far, in order (``data``, ``pretrain-diloco``, ``pretrain-dp``,
    ``eval-diloco``, ``eval-dp``, ``finetune``, ``report``); ``reason``: why it stopped, for the last two.
    """
    if status not in ("running", "completed", "interrupted", "failed"):
        raise ValueError(f"unknown run status {status!r}")
    record = {
        "status": status,
        "completed_stages": list(completed_stages),
        "reason": reason,
        "updated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **extra,
    }
    atomic.write_text(RunLayout(run_dir).status, json.dumps(record, indent=2))
    return record


def read_status(run_dir: str | Path) -> dict:
    """``RUN/status.json`` as a dict (empty if absent or unreadable)."""
    try:
        return json.loads(RunLayout(run_dir).status.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def link_or_copy(src: str, dst: str) -> None:
    """``shutil.copytree``'s ``copy_function`` for copies that share bytes: a hard link, or a copy
    where the filesystem has none (another device, no link support). Files linked so must never
    be written in place afterwards (every writer here writes a new file and renames it)."""
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
