"""Flat JSON-lines metrics with slash names, and atomic JSON files (paths from ``run.layout``).

No Prefect and no JAX here.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class JsonlWriter:
    """Thread-safe append-only JSONL file; every record is flushed so a crash keeps what was logged.

    ``path``: a local file (created with its parents). Records are dicts of JSON values; floats
    that JSON cannot hold as numbers (numpy scalars) are converted with ``float``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")
        self.count = 0

    def __call__(self, record: dict) -> None:
        line = json.dumps(record, default=float)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()
            self.count += 1

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL file; ``[]`` when it does not exist (blank lines skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically (temp file in the same folder + ``os.replace``): readers never see half
    a file, and a crash leaves the previous version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    os.replace(tmp, path)
