"""Orbax checkpoints of model parameters (and, for DiLoCo, the syncer's outer state).

Layout: ``<ckpt_dir>/<step>/{params, meta[, outer_state], _integrity.json}``. The items are written by
``ocp.CheckpointManager``: Orbax writes each step into a temporary folder and renames it into place
only when complete, so a crash never leaves a readable half-checkpoint; readers only see finalized
steps.

Integrity record. Orbax's atomic finalisation does not protect a step that is damaged *afterwards*
(a file deleted, a copy cut short, a full disk during rsync). So once Orbax has finalised a step,
:func:`save_checkpoint` writes ``<step>/_integrity.json`` (atomically: temp file + ``os.replace``)
listing every file of the step, as relative path -> size in bytes and sha256. Orbax ignores the
extra file (``latest_step()``, ``all_steps()``, restore and ``max_to_keep`` clean-up were checked with
orbax-checkpoint 0.12.8), and keeping it inside the step folder means it is deleted together with its
step. Readers verify a step against its record before restoring it: a missing file, a file of another
size (truncated) or with another sha256 (corrupted) makes the step DAMAGED
(:class:`CheckpointDamaged`), which is reported apart from a checkpoint that does not match the model
(a plain :class:`CheckpointError`). Steps written before records existed are checked as far as possible
without one: the files Orbax needs must exist, be non-empty and (JSON files) parse, and an Orbax read or
decode error during restore is reported as damage too.

With ``step=None`` the loaders use the newest INTACT step: damaged newer steps are skipped with a
``logging`` warning naming the step and the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from run import atomic

logger = logging.getLogger(__name__)


class _OcdbtMergeNotice(logging.Filter):
    """Drop Orbax's "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs"
    warning: written for every item without arrays (the empty state of outer SGD without momentum,
    a meta-only item), it says nothing is wrong (orbax-checkpoint 0.12.8, through absl's logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


logging.getLogger("absl").addFilter(_OcdbtMergeNotice())

# Orbax checkpoint managers of one process must not run at once: two threads saving to different
# folders at the same moment fail inside Orbax ("File exists: <step>.orbax-checkpoint-tmp"), seen
# with orbax-checkpoint 0.12.8 and co-located learners saving resume points. Every Orbax call here
# holds this lock (a save of the default model's optimizer state takes tens of milliseconds).
_ORBAX_LOCK = threading.RLock()

INTEGRITY_FILE = "_integrity.json"
_INTEGRITY_TMP = INTEGRITY_FILE + ".tmp"
_INTEGRITY_VERSION = 1
_FIX = "re-run pretraining for this method to write a new checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, holds no complete step, or does not match the model."""


class CheckpointDamaged(CheckpointError):
    """A finalised checkpoint step has a missing, truncated or corrupted file.

    Attributes: ``step`` (int), ``files`` (list of ``(relative path inside the step folder, what is
    wrong)``, the first one is the one named in the message) and ``step_dir`` (Path).
    """

    def __init__(self, message: str, *, step: int, files: list[tuple[str, str]], step_dir: Path):
        super().__init__(message)
        self.step = step
        self.files = list(files)
        self.step_dir = Path(step_dir)

    @property
    def file(self) -> str:
        """Relative path (inside the step folder) of the first damaged file."""
        return self.files[0][0]


# ----------------------------------------------------------------------------------------- helpers


def _manager(path: Path, **options) -> ocp.CheckpointManager:
    """An Orbax checkpoint manager of ``path`` (created if missing) with ``options``
    (``ocp.CheckpointManagerOptions`` fields).

    In a multi-process JAX job (``jax.distributed``: a DP host of ``training.dp_job``) every manager
    is this process's alone (Orbax's ``active_processes`` = {this process}): the arrays saved and
    restored here are host copies, so one process writes (the DP job's primary host) and each
    reads by itself, with none of Orbax's cross-process barriers (which would wait for the hosts
    that do not save). Orbax then does not create the folder itself; it is made here."""
    if jax.process_count() > 1:
        me = jax.process_index()
        path.mkdir(parents=True, exist_ok=True)
        options.update(
            create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}),
        )
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(**options))


def _abstract(tree):
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), tree)


def _is_record_file(rel: str) -> bool:
    """The record, or a temporary of it (``run.atomic``'s ``._integrity.json.*.tmp``, or the
    ``_integrity.json.tmp-<pid>`` of checkpoints written before it)."""
    return rel == INTEGRITY_FILE or rel.startswith((f".{INTEGRITY_FILE}.", _INTEGRITY_TMP))


def _step_files(step_dir: Path) -> list[str]:
    """Every regular file under ``step_dir`` (relative POSIX paths, sorted), without the record."""
    out = []
    for root, _dirs, files in os.walk(step_dir):
        for f in files:
            rel = (Path(root) / f).relative_to(step_dir).as_posix()
            if not _is_record_file(rel) and (Path(root) / f).is_file():
                out.append(rel)
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_integrity(step_dir: Path, step: int) -> Path:
    """Write ``step_dir/_integrity.json`` atomically and durably (``run.atomic``, fsynced)."""
    files = {}
    for rel in _step_files(step_dir):
        p = step_dir / rel
        files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    record = {"version": _INTEGRITY_VERSION, "step": int(step), "files": files}
    return atomic.write_json(step_dir / INTEGRITY_FILE, record, fsync=True, indent=1, sort_keys=True)


def _check_against_record(step_dir: Path, record_path: Path) -> list[tuple[str, str]]:
    try:
        record = json.loads(record_path.read_text())
        files = record["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [(INTEGRITY_FILE, f"unreadable integrity record ({type(exc).__name__}: {exc})")]
    damaged = []
    for rel, want in sorted(files.items()):
        p = step_dir / rel
        if not p.is_file():
            damaged.append((rel, "missing"))
            continue
        size = p.stat().st_size
        if size < int(want["size"]):
            damaged.append((rel, f"truncated ({size} of {want['size']} bytes)"))
        elif size != int(want["size"]):
            damaged.append((rel, f"has the wrong size ({size} bytes, {want['size']} expected)"))
        elif _sha256(p) != want["sha256"]:
            damaged.append((rel, "corrupted (sha256 differs from the integrity record)"))
    return damaged


def _json_problem(path: Path) -> str | None:
    """Why the JSON file at ``path`` is damaged (missing / empty / does not parse), or None."""
    if not path.is_file():
        return "missing"
    if path.stat().st_size == 0:
        return "empty (0 bytes)"
    try:
        json.loads(path.read_bytes())
    except ValueError:
        return "truncated or corrupted (does not parse as JSON)"
    return None


def _check_without_record(step_dir: Path) -> list[tuple[str, str]]:
    """Best-effort check of a step that has no integrity record (written before records existed).

    Checks the files Orbax needs to restore each item (they must exist, be non-empty and, for JSON
    files, parse) and flags any empty file; truncation inside array data files is only found when a
    restore fails (see :func:`_classify_restore_error`).
    """
    damaged: list[tuple[str, str]] = []
    items: dict[str, str] = {}
    ckpt_meta = step_dir / "_CHECKPOINT_METADATA"
    if ckpt_meta.is_file():
        problem = _json_problem(ckpt_meta)
        if problem:
            damaged.append(("_CHECKPOINT_METADATA", problem))
        else:
            parsed = json.loads(ckpt_meta.read_bytes())
            handlers = parsed.get("item_handlers") if isinstance(parsed, dict) else None
            if isinstance(handlers, dict):
                items = {str(k): str(v) for k, v in handlers.items()}
    for sub in sorted(step_dir.iterdir()):
        if sub.is_dir():
            items.setdefault(sub.name, "")
    for name, handler in sorted(items.items()):
        item = step_dir / name
        if not item.is_dir():
            damaged.append((name + "/", "missing (item folder)"))
            continue
        if "Json" in handler or (not handler and (item / "metadata").exists()):
            problem = _json_problem(item / "metadata")
            if problem:
                damaged.append((f"{name}/metadata", problem))
            continue
        problem = _json_problem(item / "_METADATA")
        if problem:
            damaged.append((f"{name}/_METADATA", problem))
        else:
            meta = json.loads((item / "_METADATA").read_bytes())
            tree = meta.get("tree_metadata", {}) if isinstance(meta, dict) else {}
            # a tree without arrays (e.g. the empty state of outer SGD without momentum) has no data files
            has_arrays = not isinstance(tree, dict) or any(
                not (v.get("value_metadata") or {}).get("skip_deserialize", False)
                for v in tree.values()
                if isinstance(v, dict)
            )
            if (
                isinstance(meta, dict)
                and meta.get("use_ocdbt", True)
                and has_arrays
                and not (item / "manifest.ocdbt").is_file()
            ):
                damaged.append((f"{name}/manifest.ocdbt", "missing"))
        for p in sorted((item / "array_metadatas").glob("*")):
            problem = _json_problem(p) if p.is_file() else None
            if problem:
                damaged.append((p.relative_to(step_dir).as_posix(), problem))
    seen = {rel for rel, _ in damaged}
    for rel in _step_files(step_dir):
        if rel not in seen and (step_dir / rel).stat().st_size == 0:
            damaged.append((rel, "empty (0 bytes)"))
    return damaged


def _damaged_files(step_dir: Path) -> list[tuple[str, str]]:
    record = step_dir / INTEGRITY_FILE
    if record.exists():
        return _check_against_record(step_dir, record)
    return _check_without_record(step_dir)


def _describe(files: list[tuple[str, str]]) -> str:
    head = ", ".join(f"file {rel} is {why}" for rel, why in files[:3])
    return head + (f" (and {len(files) - 3} more damaged files)" if len(files) > 3 else "")


def _damaged_error(step_dir: Path, step: int, files: list[tuple[str, str]], fix: str) -> CheckpointDamaged:
    return CheckpointDamaged(
        f"checkpoint step {step} in {step_dir.parent} is DAMAGED: {_describe(files)}; {fix}",
        step=step,
        files=files,
        step_dir=step_dir,
    )


def _error_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# Orbax 0.12.8 wording of a genuine shape / tree-structure mismatch (checked before the read markers:
# TensorStore specs quoted in read errors mention shapes and dtypes too).
_MISMATCH_MARKERS = ("is not compatible with the stored shape", "tree structures do not match")
_READ_MARKERS = (
    "NOT_FOUND",
    "OUT_OF_RANGE",
    "DATA_LOSS",
    "FAILED_PRECONDITION",
    "Error reading",
    "Error decoding",
    "Error opening",
    "not found",
    "Truncated",
    "error while reading",
    "Unexpected end",
    "corrupt",
)
_LOCAL_FILE = re.compile(r'local file \\?"([^"\\]+)\\?"')
_FILE_NOT_FOUND = re.compile(r"File (\S+) not found")


_TS_STATUS = re.compile(r"^[A-Z_]{4,}: ")


def _orbax_status(chain: list[BaseException]) -> str:
    """A short reason from an Orbax/TensorStore error chain: prefer a TensorStore status line."""
    lines = [str(e).splitlines()[0] for e in chain if str(e).strip()]
    best = next((ln for ln in lines if _TS_STATUS.match(ln)), lines[0] if lines else type(chain[0]).__name__)
    return best.split(" [tensorstore_spec")[0][:300]


def _classify_restore_error(exc: Exception, step_dir: Path) -> list[tuple[str, str]] | None:
    """Damaged files if Orbax's restore error is a file-not-found / read / decode error, else None."""
    damaged = _damaged_files(step_dir)
    if damaged:
        return damaged
    chain = list(_error_chain(exc))
    text = "\n".join(str(e) for e in chain)
    io_error = any(isinstance(e, (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError)) for e in chain)
    if not io_error and (any(m in text for m in _MISMATCH_MARKERS) or not any(m in text for m in _READ_MARKERS)):
        return None
    # A read / decode error, but every checked file looks fine: name the file Orbax complained about.
    names = []
    for e in chain:
        if isinstance(e, OSError) and e.filename:
            names.append(str(e.filename))
    names += _FILE_NOT_FOUND.findall(text) + _LOCAL_FILE.findall(text)
    status = _orbax_status(chain)
    for name in names:
        try:
            rel = Path(name).absolute().relative_to(step_dir).as_posix()
        except ValueError:
            continue
        if name.endswith("/") or (step_dir / rel).is_dir():
            return [(rel.rstrip("/") + "/<a data file>", f"unreadable (Orbax: {status})")]
        return [(rel, f"unreadable (Orbax: {status})")]
    return [("<a file of this step>", f"unreadable (Orbax: {status})")]


def _ckpt_root(ckpt_dir: str | Path) -> Path:
    ckpt_dir = Path(ckpt_dir).absolute()
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt_dir} does not exist; run pretraining first")
    return ckpt_dir


def _no_complete(ckpt_dir: Path) -> CheckpointError:
    return CheckpointError(
        f"{ckpt_dir} holds no complete checkpoint (an interrupted save leaves only a temporary "
        "folder); re-run pretraining for this method"
    )


def _skip_warning(ckpt_dir: Path, err: CheckpointDamaged) -> None:
    logger.warning(
        "skipping DAMAGED checkpoint step %d in %s: %s; trying an older step", err.step, ckpt_dir, _describe(err.files)
    )


def _no_intact(ckpt_dir: Path, damaged: list[CheckpointDamaged]) -> CheckpointDamaged:
    newest = damaged[0]
    older = f"; the {len(damaged) - 1} older step(s) are damaged too" if len(damaged) > 1 else ""
    return CheckpointDamaged(
        f"{ckpt_dir} holds no intact checkpoint: the newest step {newest.step} is DAMAGED: "
        f"{_describe(newest.files)}{older}; {_FIX}",
        step=newest.step,
        files=newest.files,
        step_dir=newest.step_dir,
    )


def _restore_verified(ckpt_dir: str | Path, step: int | None, items: dict[str, Any]) -> tuple[int, Any]:
    """Verify and restore ``items`` (name -> ``ocp.args`` restore args) of ``step`` or the newest
    intact step; returns ``(step, restored)``. Raises as documented on the public loaders."""
    ckpt_dir = _ckpt_root(ckpt_dir)
    with _ORBAX_LOCK, _manager(ckpt_dir) as mngr:
        steps = sorted(mngr.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                if not steps:
                    raise _no_complete(ckpt_dir)
                raise CheckpointError(f"{ckpt_dir} has no complete step {step}; its steps are {sorted(steps)}")
            return step, _restore_step(
                mngr, ckpt_dir, step, items, fix=f"load an older step (steps: {sorted(steps)}) or {_FIX}"
            )
        if not steps:
            raise _no_complete(ckpt_dir)
        damaged: list[CheckpointDamaged] = []
        for s in steps:
            try:
                return s, _restore_step(mngr, ckpt_dir, s, items, fix=_FIX)
            except CheckpointDamaged as err:
                _skip_warning(ckpt_dir, err)
                damaged.append(err)
        raise _no_intact(ckpt_dir, damaged)


def _restore_step(mngr, ckpt_dir: Path, step: int, items: dict[str, Any], *, fix: str):
    step_dir = ckpt_dir / str(step)
    files = _damaged_files(step_dir)
    if files:
        raise _damaged_error(step_dir, step, files, fix)
    for name in items:
        if not (step_dir / name).is_dir():
            raise CheckpointError(
                f"checkpoint step {step} in {ckpt_dir} has no item {name!r} "
                f"(it holds {sorted(p.name for p in step_dir.iterdir() if p.is_dir())})"
            )
    try:
        return mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as exc:  # orbax raises a variety of errors for mismatched trees and bad files
        files = _classify_restore_error(exc, step_dir)
        if files:
            raise _damaged_error(step_dir, step, files, fix) from exc
        raise CheckpointError(
            f"cannot restore {ckpt_dir}/{step} into this model: the checkpoint does not match this "
            f"model ({type(exc).__name__}: {exc})"
        ) from exc


# ------------------------------------------------------------------------------------------ public


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    params: Any,
    meta: dict,
    extra: dict[str, Any] | None = None,
    *,
    max_to_keep: int = 2,
) -> Path:
    """Save ``params`` (a pytree, e.g. ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``; None: none), JSON
    ``meta`` and optional extra pytrees (name -> pytree) under ``ckpt_dir/step``; blocks until written.

    ``step`` is the integer step label (the callers use tokens seen). After Orbax has finalised the
    step, its integrity record ``ckpt_dir/step/_integrity.json`` (every file: size in bytes and
    sha256) is written atomically. Orbax keeps the newest ``max_to_keep`` steps and deletes older
    ones (with their records).

    Returns the step folder. Raises ``FileExistsError`` if that step exists: a checkpoint that a
    later step may read is never overwritten.
    """
    ckpt_dir = Path(ckpt_dir).absolute()
    if (ckpt_dir / str(step)).exists():
        raise FileExistsError(f"checkpoint {ckpt_dir / str(step)} already exists; it is never overwritten")
    items = {"meta": ocp.args.JsonSave(meta)}
    if params is not None:
        items["params"] = ocp.args.StandardSave(params)
    for name, tree in (extra or {}).items():
        items[name] = ocp.args.StandardSave(tree)
    with (
        _ORBAX_LOCK,
        _manager(ckpt_dir, max_to_keep=max_to_keep) as mngr,
    ):
        mngr.save(step, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()
    # Orbax has renamed the step into place and closed the manager: the files are final.
    _write_integrity(ckpt_dir / str(step), step)
    return ckpt_dir / str(step)


def verify_step(ckpt_dir: str | Path, step: int) -> None:
    """Check one finalised step against its integrity record (or, for a step written before records
    existed, the files Orbax needs). Reads every file of the step once (sha256).

    Raises :class:`CheckpointDamaged` naming the step and the damaged file(s) (paths relative to the
    step folder), or :class:`CheckpointError` if the folder or the step does not exist.
    """
    ckpt_dir = _ckpt_root(ckpt_dir)
    step_dir = ckpt_dir / str(step)
    if not step_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} has no step {step}")
    files = _damaged_files(step_dir)
    if files:
        raise _damaged_error(step_dir, step, files, _FIX)


def latest_step(ckpt_dir: str | Path) -> int:
    """The newest complete and intact step (damaged newer steps are skipped with a logged warning
    naming the step and the file).

    A step without an integrity record can only be checked as far as its metadata files here; an
    array data file damaged inside it shows up when it is restored (the loaders then fall back too).

    Raises :class:`CheckpointError` if the folder does not exist or holds no complete step, and
    :class:`CheckpointDamaged` (naming the newest step and its damaged file) if every step is damaged.
    """
    ckpt_dir = _ckpt_root(ckpt_dir)
    with _ORBAX_LOCK, _manager(ckpt_dir) as mngr:
        steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
        raise _no_complete(ckpt_dir)
    damaged: list[CheckpointDamaged] = []
    for s in steps:
        files = _damaged_files(ckpt_dir / str(s))
        if not files:
            return s
        err = _damaged_error(ckpt_dir / str(s), s, files, _FIX)
        _skip_warning(ckpt_dir, err)
        damaged.append(err)
    raise _no_intact(ckpt_dir, damaged)


def load_meta(ckpt_dir: str | Path, step: int | None = None) -> dict:
    """The JSON meta of ``step``, or of the newest intact step when ``step`` is None.

    The whole step is verified (not just its meta), so the meta always belongs to the step that
    :func:`load_into_model` would restore. Raises :class:`CheckpointError` when the folder / a complete
    step is missing, and :class:`CheckpointDamaged` when the given step, or with ``step=None`` every
    step, is damaged.
    """
    _, restored = _restore_verified(ckpt_dir, step, {"meta": ocp.args.JsonRestore()})
    return dict(restored.meta)


def load_into_model(ckpt_dir: str | Path, model: nnx.Module, step: int | None = None) -> dict:
    """Restore the newest intact (or the given) step's params into ``model`` in place; returns its meta.

    With ``step=None`` damaged newer steps are skipped with a logged warning naming the step and file.
    Raises :class:`CheckpointDamaged` when the given step, or with ``step=None`` every step, is damaged
    (missing / truncated / corrupted file); :class:`CheckpointError` (not damaged) when the folder or
    a complete step is missing, or when the checkpoint does not match this model (shapes, structure).
    """
    state = nnx.state(model, nnx.Param)
    target = nnx.to_pure_dict(state)
    _, restored = _restore_verified(
        ckpt_dir, step, {"params": ocp.args.StandardRestore(_abstract(target)), "meta": ocp.args.JsonRestore()}
    )
    nnx.replace_by_pure_dict(state, restored.params)
    nnx.update(model, state)
    return dict(restored.meta)


def load_extra(ckpt_dir: str | Path, name: str, like: Any, step: int | None = None) -> Any:
    """Restore an extra pytree saved by :func:`save_checkpoint` with the structure of ``like``, from
    ``step`` or the newest intact step.

    Raises :class:`CheckpointDamaged` when the given step, or with ``step=None`` every step, is
    damaged; :class:`CheckpointError` when the folder / step / item ``name`` is missing or the saved
    tree does not match ``like``.
    """
    _, restored = _restore_verified(ckpt_dir, step, {name: ocp.args.StandardRestore(_abstract(like))})
    return restored[name]


# ------------------------------------------------------------------------------ learner resume points


class OrbaxResumeStore:
    """A DiLoCo learner's resume points (``diloco.learner.ResumePoint``) as Orbax checkpoints.

    ``path``: the learner's resume folder (``run.layout.RunLayout.resume_point``). Each save writes
    step ``point.step`` with items ``opt_state`` (the inner optimizer state, a pytree of arrays:
    Adam moments and step counts) and ``meta`` (``step``, ``cursor``, ``tokens``), keeps the newest
    two, and records their integrity like every checkpoint here. ``load`` returns the newest intact
    point, restored with the structure of ``opt_template``, or None when nothing usable was saved
    (no save yet, only a save cut off mid-way, or every step damaged: logged as a warning).

    Writes are asynchronous, as Orbax's own async checkpointing is on accelerators: ``save`` copies
    the state to host memory (the next step donates its buffers) and returns; one background
    thread per store writes it (about 0.15 s for the default model, mostly waiting on the file
    system), while the learner steps on. A save waits for the previous one; ``flush`` (and
    ``load``) wait for the last and re-raise its error, if any. A write cut off by a killed process
    leaves only Orbax's temporary folder, which ``load`` skips: the older point is used.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, point) -> None:
        self.flush()
        meta = {"step": int(point.step), "cursor": [int(c) for c in point.cursor], "tokens": int(point.tokens)}
        host = jax.tree.map(lambda x: np.array(x, copy=True), point.opt_state)

        def write() -> None:
            try:
                save_checkpoint(self.path, int(point.step), None, meta, extra={"opt_state": host})
            except BaseException as exc:  # re-raised in the learner's thread by flush()
                self._error = exc

        self._writer = threading.Thread(target=write, name=f"resume-writer:{self.path.name}", daemon=True)
        self._writer.start()

    def ready(self) -> bool:
        """No save in flight: a new one would not wait. (A learner saves inside its compute turn and
        skips a resume point rather than hold the turn while Orbax, one process-wide lock, serves
        another learner's save or restore.)"""
        return self._writer is None or not self._writer.is_alive()

    def flush(self) -> None:
        """Block until the last save is written; re-raise its error (once) if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def load(self, opt_template):
        from diloco.learner import ResumePoint

        self.flush()
        if not self.path.is_dir():
            return None
        try:
            step = latest_step(self.path)
            meta = load_meta(self.path, step)
            opt_state = load_extra(self.path, "opt_state", opt_template, step)
        except CheckpointError as exc:
            # Only a save cut off mid-way (a killed process leaves <step>.orbax-checkpoint-tmp), or
            # damaged steps: a learner must still be able to rejoin, so it starts again at step 0.
            logger.warning("resume point %s is unusable, the learner starts again at step 0: %s", self.path, exc)
            return None
        return ResumePoint(
            step=int(meta["step"]), cursor=tuple(meta["cursor"]), tokens=int(meta["tokens"]), opt_state=opt_state
        )


# ------------------------------------------------------------------------------ syncer checkpoints


_SYNCER_ITEMS = ("global", "outer", "bases")  # Syncer.state_dict()'s array items ("bases": quantised wire only)


class OrbaxSyncerStore:
    """The DiLoCo syncer's checkpoints (``diloco.syncer_journal.SyncerStateStore``) as Orbax steps.

    ``path``: the syncer's state folder (``run.layout.RunLayout.syncer_state``). Each step holds the
    items ``global`` and ``outer`` (``Syncer.state_dict()``'s arrays: Θ per fragment and the outer
    optimizer's momentum, float32), with a quantised wire format also ``bases`` (the earlier
    versions of Θ that learners' updates are decoded against), and ``meta`` (JSON: the rest of the
    syncer's state, the journal seq, the generation, the loop's state), written by
    :func:`save_checkpoint` (so under this module's Orbax lock, with an integrity record), keeping
    the newest ``max_to_keep`` steps. ``save`` blocks until the step and its record are on disk: the
    journal entries and inbox objects the step covers may be deleted right after.
    """

    def __init__(self, path: str | Path, max_to_keep: int = 2):
        self.path = Path(path).absolute()
        self.max_to_keep = int(max_to_keep)

    def steps(self) -> list[int]:
        """Finalised steps, oldest first (an interrupted save leaves only Orbax's temporary folder,
        which is not listed); none when the folder does not exist."""
        if not self.path.is_dir():
            return []
        with _ORBAX_LOCK, _manager(self.path) as mngr:
            return sorted(mngr.all_steps())

    def save(self, step: int, arrays: dict, meta: dict) -> None:
        """Write step ``step`` (``arrays``: ``{"global": …, "outer": …}`` and optionally ``"bases": …``,
        of numpy arrays). Raises ``FileExistsError`` if the step exists."""
        save_checkpoint(
            self.path,
            step,
            None,
            meta,
            extra={k: arrays[k] for k in _SYNCER_ITEMS if k in arrays},
            max_to_keep=self.max_to_keep,
        )

    def load(self, step: int, like: dict) -> tuple[dict, dict]:
        """``(arrays, meta)`` of ``step``, verified against its integrity record; ``like``: arrays of
        the same structure (a fresh syncer's). Raises :class:`CheckpointDamaged` (a missing,
        truncated or corrupted file) or :class:`CheckpointError` (no such step, or it does not match)."""
        items = {"meta": ocp.args.JsonRestore()}
        keys = [k for k in _SYNCER_ITEMS if k in like]
        for k in keys:
            if jax.tree.leaves(like[k]):
                items[k] = ocp.args.StandardRestore(_abstract(like[k]))
        _, restored = _restore_verified(self.path, step, items)
        arrays = {k: (jax.tree.map(np.asarray, restored[k]) if k in items else like[k]) for k in keys}
        return arrays, dict(restored.meta)

    def delete(self, step: int) -> None:
        """Remove step ``step`` (a damaged or superseded one) and its record."""
        with _ORBAX_LOCK, _manager(self.path) as mngr:
            if step in mngr.all_steps():
                mngr.delete(step)
