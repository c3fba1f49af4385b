"""Flat JSON-lines metrics with slash names, and atomic JSON files (paths from ``run.layout``).

No Prefect and no JAX here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path


class JsonlWriter:
    """Thread-safe append-only JSONL file; every record is flushed so a crash keeps what was logged.

    ``path``: a local file (created with its parents). Records are dicts of JSON values; floats
    that JSON cannot hold as numbers (numpy scalars) are converted with ``float``. A file whose last
    line was cut short (a process killed mid-write) loses that partial line on opening, with a
    warning, so the records appended after it stay one per line. Each line is written under an
    advisory ``flock`` (local filesystems), so several writers of one file never interleave.

    ``sink``: called with each record once it is written (``run.tracking.Tracker.sink``: the same
    record to TensorBoard and W&B); None: the file only.
    """

    def __init__(self, path: str | Path, sink: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.sink = sink
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        _drop_cut_line(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open, closed by close()
        self.count = 0

    def __call__(self, record: dict) -> None:
        line = json.dumps(record, default=float)
        with self._lock:
            # an advisory lock per line: writers of one file in other processes (learner attempts
            # appending to learners.jsonl) and a reopening writer's check never see half a line
            fcntl.flock(self._fh, fcntl.LOCK_EX)
            try:
                self._fh.write(line + "\n")
                self._fh.flush()
            finally:
                fcntl.flock(self._fh, fcntl.LOCK_UN)
            self.count += 1
        if self.sink is not None:
            self.sink(record)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def _drop_cut_line(path: Path) -> None:
    """Truncate ``path`` after its last newline when it does not end with one (bytes after it are a
    record cut short by a kill: never valid JSON, and appending to it would spoil the next record)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released on close; no writer is half-way through a line now
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        block, end = 65536, size
        while end > 0:  # find the last newline, reading backwards
            start = max(0, end - block)
            fh.seek(start)
            cut = fh.read(end - start).rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        fh.truncate(keep)
    logging.getLogger(__name__).warning(
        "%s: dropped a last line cut short (%d bytes) before appending", path, size - keep
    )


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL file; ``[]`` when it does not exist (blank lines skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
