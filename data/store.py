"""Reading prepared data back from a run directory (``RUN/data/``, see ``data.text``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from data.sources import DATA_DIR, Document
from run.layout import HELDOUT_FILE


def _data_dir(run_dir: str | Path) -> Path:
    d = Path(run_dir) / DATA_DIR
    if not d.is_dir():
        raise FileNotFoundError(f"no data folder at {d}; run prepare_data (the shard step) first")
    return d


def load_manifest(run_dir: str | Path) -> dict:
    """The manifest dict written by :func:`prepare_data` (``RUN/data/manifest.json``).

    Raises ``FileNotFoundError`` naming the path when the folder or manifest is missing (an
    incomplete data folder), ``ValueError`` when it is not valid JSON.
    """
    path = _data_dir(run_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_sequences(run_dir: str | Path, name: str) -> np.ndarray:
    """Packed sequences ``name`` (``train``, ``val``, ``test``, ``shard_00``, ...): int32 ``[N, seq_len+1]``.

    Raises ``FileNotFoundError`` naming the path when the data folder or that dataset is missing.
    """
    from datasets import load_from_disk

    if name not in ("train", "val", "test") and not re.fullmatch(r"shard_\d{2,}", name):
        raise ValueError(f"unknown sequence set {name!r}; use train, val, test or shard_00, shard_01..")
    path = _data_dir(run_dir) / name
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{path} is missing or incomplete (no saved dataset there)")
    ds = load_from_disk(str(path))
    arr = ds.with_format("numpy")[:]["ids"] if len(ds) else np.zeros((0, 0))
    return np.ascontiguousarray(np.asarray(arr, dtype=np.int32))


def load_tokenizer(run_dir: str | Path):
    """The run's ``tokenizers.Tokenizer`` (``RUN/data/tokenizer.json``).

    Raises ``FileNotFoundError`` naming the path when it is missing.
    """
    from tokenizers import Tokenizer

    path = _data_dir(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    return Tokenizer.from_file(str(path))


def load_heldout(run_dir: str | Path, split: str) -> list[Document]:
    """Raw held-out documents of ``split`` (``val``, ``test`` or ``finetune``): a list of
    ``{"title", "text"}``.

    Raises ``ValueError`` for another split name, ``FileNotFoundError`` naming the missing file
    (``finetune``: the run was prepared with ``data.finetune_docs: 0``).
    """
    if split not in ("val", "test", "finetune"):
        raise ValueError(f"held-out split must be 'val', 'test' or 'finetune', not {split!r}")
    path = _data_dir(run_dir) / HELDOUT_FILE.format(split=split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
