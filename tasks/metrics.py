"""Flat JSON-lines metrics with slash names, one file per stage in the run directory."""

from __future__ import annotations

import json
import threading
from pathlib import Path


class JsonlWriter:
    """Thread-safe append-only JSONL file; every record is flushed so a crash keeps what was logged."""

    def __init__(self, path: Path):
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


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    tmp.replace(path)
