"""Atomic writes: every file and folder of a run, sweep or study directory is written through here.

A reader (another process, a resumed run, the report) sees the old version or the new one, never
half of one, and a crash part-way leaves the old version and at most a hidden temporary
(``.<name>.*``) beside it:

* :func:`write_text` / :func:`write_json`: a temporary file in the same folder, then ``os.replace``;
  ``fsync=True`` also flushes the file and the rename to disk (checkpoint integrity records). On an
  fsspec URL (a run's report on object storage, ``memory://`` in tests) the object is put whole, as
  object stores do;
* :func:`folder`: a temporary folder beside the final one, filled by the caller, then renamed into
  place (:func:`swap_in_folder` when one is there already).

Object storage (the fsspec exchange, ``diloco/exchange/fsspec.py``) has its own put-then-rename, and
``diloco/`` imports nothing of ours, so the learners' host turns (``diloco/pacing.py``) keep theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from upath import UPath

LOCAL_PROTOCOLS = ("", "file", "local")


def write_text(path: str | Path | UPath, text: str | bytes, *, fsync: bool = False) -> Path | UPath:
    """Write ``text`` (``str`` as UTF-8, or ``bytes``) to ``path`` atomically; create its folder.

    The temporary file is made 0644 like every other file of a run (``mkstemp`` makes it 0600).
    ``fsync``: flush the file before the rename and the folder after it (best effort where the
    filesystem refuses a folder fsync). Returns ``path``. On any error the temporary is removed and
    the old file, if any, is left as it was.
    """
    data = text.encode("utf-8") if isinstance(text, str) else text
    if isinstance(path, str) and "://" in path:
        path = UPath(path)
    if isinstance(path, UPath) and path.protocol not in LOCAL_PROTOCOLS:  # an object store: one put
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    return path


def write_json(path: str | Path | UPath, obj, *, fsync: bool = False, newline: bool = False, **dumps) -> Path | UPath:
    """:func:`write_text` of ``json.dumps(obj, indent=2, default=float, **dumps)`` (NumPy and JAX
    scalars written as floats); ``newline`` ends the file with one."""
    text = json.dumps(obj, **{"indent": 2, "default": float, **dumps})
    return write_text(path, text + ("\n" if newline else ""), fsync=fsync)


def swap_in_folder(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` (same parent): renamed into place, or, when
    ``final`` exists, the old one renamed aside, the new one in, the old one deleted. A reader never
    sees half a folder; between the two renames ``final`` is briefly absent, and a crash there leaves
    the old folder aside as ``.<name>.old-*`` (writers that race take a lock: the DP cache)."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def folder(final: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``final`` to fill; when the block ends without an error it takes
    ``final``'s place (:func:`swap_in_folder`), and on an error it is deleted and ``final`` is left as
    it was. ``final``'s parent is created."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        swap_in_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
