"""The data step for any modality: ``prepare_data(cfg, run_dir)`` builds ``RUN/data`` from the
config's text (``data.text``) or image (``data.images``) source; ``load_rows`` reads a split back
in the form the training loops batch (``data.cursor.batch_at``)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from configs.schema import ExperimentConfig
from data.images import complete_splits, load_image_rows, load_images, prepare_images
from data.sources import DATA_DIR
from data.store import load_manifest, load_sequences
from data.text import config_record, prepare_data as prepare_text

log = logging.getLogger(__name__)


def prepare_data(cfg: ExperimentConfig, run_dir: str | Path, overwrite: bool = False) -> dict:
    """Build ``RUN/data`` for ``cfg.data`` and return its manifest (``docs/contracts.md``, "Data").

    Text: :func:`data.text.prepare_data` (its errors). Images: :func:`data.images.load_images`, the
    source's own split folders completed by a stratified split (:func:`data.images.complete_splits`:
    ``data.val_fraction``, ``data.test_fraction``, ``data.seed``) and
    :func:`data.images.prepare_images`. Either way a ``RUN/data`` built from the same data config and
    learner count is reused, and a different one raises ``FileExistsError`` unless ``overwrite``.
    """
    if cfg.data.modality == "text":
        eval_rows = cfg.train.eval_batches * cfg.train.eval_batch_size
        return prepare_text(cfg.data, cfg.diloco.learners, run_dir, overwrite, eval_rows=eval_rows)
    run_dir = Path(run_dir)
    record = config_record(cfg.data, cfg.diloco.learners)
    if (run_dir / DATA_DIR).exists() and not overwrite:
        try:
            old = load_manifest(run_dir)
        except (FileNotFoundError, ValueError):
            old = None
        if old is not None and old.get("config") == record:
            log.info("reusing %s (built from the same data config)", run_dir / DATA_DIR)
            return old
        raise FileExistsError(
            f"{run_dir / DATA_DIR} already exists and was built from a different (or no) "
            "data config; pass overwrite=True or use a new run directory"
        )
    d = cfg.data
    images = load_images(
        d.source,
        hf_name=d.hf_name,
        hf_split=d.hf_split,
        image_column=d.image_column,
        label_column=d.label_column,
        path=d.paths[0] if d.paths else None,
        image_size=d.image_size,
        channels=d.channels,
    )
    splits, source = complete_splits(images, d.val_fraction, d.test_fraction, d.seed)
    return prepare_images(images, splits, cfg.diloco.learners, run_dir, record, source)


def load_rows(run_dir: str | Path, name: str) -> np.ndarray | dict[str, np.ndarray]:
    """Rows of ``name`` (``train``, ``val``, ``test`` for images, ``shard_00``, …): text sequences
    ``int32[N, L+1]``, or images ``{"image": uint8[N, H, W, C], "label": int32[N]}``, by the
    manifest's modality. Raises ``FileNotFoundError`` naming what is missing."""
    if load_manifest(run_dir).get("modality", "text") == "image":
        return load_image_rows(run_dir, name)
    return load_sequences(run_dir, name)
