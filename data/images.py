"""Image preparation: images and labels → stratified train/val/test split → per-learner shards.

Plain functions, no Prefect import (``tasks.shard`` wraps :func:`prepare_images` through
``data.prepare``). Sources (``data.source``):

* ``digits``: scikit-learn's bundled handwritten digits (1,797 grey 8×8 images, pixels 0-16, 10
  classes; UCI ML digits, Alpaydin & Kaynak 1998): real data shipped inside the package, no network;
* ``hf_images``: a Hugging Face image dataset by name (``data.hf_name``; an image column and an
  integer label column, e.g. ``mnist``, ``cifar10``), where the hub is reachable;
* ``imagefolder``: a local folder of class sub-folders (``data.paths[0]/<class>/<image>``),
  read with the ``datasets`` ``imagefolder`` builder.

Run directory layout written by :func:`prepare_images` (``docs/contracts.md``, "Data")::

    RUN/data/{train,val,test}/       datasets.Dataset: ``image`` uint8 [H, W, C], ``label`` ClassLabel
    RUN/data/shard_{m:02d}/          learner m's training images (round-robin; disjoint, cover train)
    RUN/data/manifest.json           modality "image", image_shape, classes, counts per split and class

Shapes: N images of H × W pixels with C channels, stored as uint8 (digits' 0-16 as is; the model
scales by ``pixel_max``); labels int32 in [0, K).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from configs.schema import IMAGE_SOURCES
from data.sources import DATA_DIR, MANIFEST_VERSION

log = logging.getLogger(__name__)

IMAGE_SPLITS = ("train", "val", "test")


@dataclass
class ImageSet:
    """Images ``uint8[N, H, W, C]``, labels ``int32[N]`` in [0, K), the K class names, the largest
    value a pixel can take (``pixel_max``) and where they came from (``info``)."""

    images: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    pixel_max: int
    info: dict = field(default_factory=dict)


def _as_uint8_hwc(img, image_size: int | None) -> np.ndarray:
    """A PIL image or array as ``uint8[H, W, C]`` (grey images get C = 1), resized to a square side
    ``image_size`` when given (PIL's bilinear resampling)."""
    from PIL import Image

    if image_size is not None:
        if not isinstance(img, Image.Image):
            img = Image.fromarray(np.asarray(img))
        img = img.resize((image_size, image_size), Image.BILINEAR)
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.dtype != np.uint8:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    return arr


def _from_dataset(ds, image_column: str, label_column: str, image_size: int | None, where: str) -> ImageSet:
    for col in (image_column, label_column):
        if col not in ds.column_names:
            raise ValueError(f"{where} has no column {col!r} (it has {', '.join(ds.column_names)}); "
                             f"name the columns with data.image_column and data.label_column")
    if len(ds) == 0:
        raise ValueError(f"{where} holds no images")
    feature = ds.features[label_column]
    names = list(getattr(feature, "names", None) or [])
    labels = np.asarray(ds[label_column], dtype=np.int64)
    if not names:
        names = [str(x) for x in sorted(set(labels.tolist()))]
        index = {int(v): i for i, v in enumerate(sorted(set(labels.tolist())))}
        labels = np.asarray([index[int(v)] for v in labels])
    images = [_as_uint8_hwc(x, image_size) for x in ds[image_column]]
    shapes = {a.shape for a in images}
    if len(shapes) != 1:
        raise ValueError(f"{where}: the images have different shapes ({sorted(shapes)[:3]} …); "
                         "set data.image_size to resize them to one square size")
    channels = {a.shape[-1] for a in images}
    if channels - {1, 3}:
        raise ValueError(f"{where}: images with {sorted(channels)} channels; only grey (1) or RGB (3) are read")
    return ImageSet(np.stack(images), labels.astype(np.int32), names, 255)


def load_images(source: str, *, hf_name: str | None = None, hf_split: str = "train",
                image_column: str = "image", label_column: str = "label", path: str | None = None,
                image_size: int | None = None) -> ImageSet:
    """Read the images of ``source`` (one of :data:`IMAGE_SOURCES`).

    Raises ``ValueError`` naming the source and the fix for an unknown source, a missing or empty
    folder, missing columns, images of different shapes (without ``image_size``) or channel counts
    other than 1 and 3; the ``datasets`` errors for an unreachable hub dataset.
    """
    if source == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        images = np.asarray(d.images, dtype=np.uint8)[:, :, :, None]  # 0-16 integers, stored as is
        if image_size is not None:
            raise ValueError("data.image_size does not apply to digits (8×8 as shipped); remove it")
        return ImageSet(images, np.asarray(d.target, dtype=np.int32), [str(n) for n in d.target_names], 16,
                        {"source": "digits", "name": "scikit-learn load_digits (UCI ML hand-written digits)"})
    if source == "hf_images":
        import datasets

        if not hf_name:
            raise ValueError("data.hf_name must name a Hugging Face image dataset for data.source: hf_images")
        ds = datasets.load_dataset(hf_name, split=hf_split)
        out = _from_dataset(ds, image_column, label_column, image_size, f"{hf_name} ({hf_split})")
        out.info = {"source": "hf_images", "name": hf_name, "split": hf_split}
        return out
    if source == "imagefolder":
        import datasets

        folder = Path(path or "")
        if not path or not folder.is_dir():
            raise ValueError(f"data.paths[0] ({path!r}) must be a folder of class sub-folders for "
                             "data.source: imagefolder")
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if len(classes) < 2:
            raise ValueError(f"{folder} holds {len(classes)} class sub-folder(s); an imagefolder needs ≥ 2 "
                             "(one per class, images inside)")
        ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
        out = _from_dataset(ds, "image", "label", image_size, str(folder))
        out.info = {"source": "imagefolder", "name": str(folder)}
        return out
    raise ValueError(f"unknown image source {source!r}; choose one of {', '.join(IMAGE_SOURCES)}")


def stratified_split(labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Indices of ``train``, ``val`` and ``test``, each class split in the same proportions
    (scikit-learn's ``train_test_split`` with ``stratify``, twice); the same labels and seed
    always give the same split. Each index array is sorted.

    Raises ``ValueError`` when a split would be empty or a class has too few images to appear in
    every split (it names the class count and the fix).
    """
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    counts = np.bincount(labels)
    if counts.min() < 3:
        raise ValueError(f"class {int(counts.argmin())} has {int(counts.min())} image(s); every class needs ≥ 3 "
                         "to appear in train, val and test")
    try:
        rest, test = train_test_split(idx, test_size=test_fraction, stratify=labels, random_state=seed)
        train, val = train_test_split(rest, test_size=val_fraction / (1.0 - test_fraction),
                                      stratify=labels[rest], random_state=seed)
    except ValueError as exc:
        raise ValueError(f"cannot split {len(labels)} images into val {val_fraction:.0%} and test "
                         f"{test_fraction:.0%} with every class in each ({exc}); raise data.val_fraction "
                         "and data.test_fraction or use more images") from None
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def _dataset(images: np.ndarray, labels: np.ndarray, class_names: list[str]):
    from datasets import Array3D, ClassLabel, Dataset, Features

    features = Features({"image": Array3D(shape=images.shape[1:], dtype="uint8"),
                         "label": ClassLabel(names=class_names)})
    return Dataset.from_dict({"image": images, "label": labels.astype(np.int64)}, features=features)


def prepare_images(image_set: ImageSet, splits: dict[str, np.ndarray], learners: int, run_dir: str | Path,
                   record: dict) -> dict:
    """Write ``RUN/data`` (layout in the module docstring) and return its manifest.

    ``splits``: :func:`stratified_split`'s indices; ``learners``: M shards of the training split,
    round-robin (``Dataset.shard(..., contiguous=False)``); ``record``: what determines the data
    (``data.text.config_record``), kept in the manifest. Built in a temporary folder and renamed into
    place (a failure never leaves a half-written ``RUN/data``). Raises ``ValueError`` when the
    training split cannot give every learner an image. The manifest: ``modality`` "image",
    ``image_shape`` [H, W, C], ``num_classes``, ``class_names``, ``pixel_max``, ``splits`` (per split
    ``images`` and ``per_class``), ``shards`` (``name``, ``path``, ``images``), ``learners``.
    """
    import datasets

    t0 = time.perf_counter()
    datasets.disable_progress_bars()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{DATA_DIR}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    K = len(image_set.class_names)
    try:
        split_info = {}
        for s in IMAGE_SPLITS:
            idx = splits[s]
            ds = _dataset(image_set.images[idx], image_set.labels[idx], image_set.class_names)
            ds.save_to_disk(str(tmp / s))
            split_info[s] = {"images": int(len(idx)),
                             "per_class": np.bincount(image_set.labels[idx], minlength=K).tolist()}
            if s == "train":
                train_ds = ds
        if len(splits["train"]) < learners:
            raise ValueError(f"{len(splits['train'])} training images cannot fill diloco.learners = {learners} shards")
        shards = []
        for m in range(learners):
            sh = train_ds.shard(num_shards=learners, index=m, contiguous=False)
            name = f"shard_{m:02d}"
            sh.save_to_disk(str(tmp / name))
            shards.append({"name": name, "path": f"{DATA_DIR}/{name}", "images": int(len(sh))})
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "modality": "image",
            **image_set.info,
            "config": record,
            "image_shape": list(image_set.images.shape[1:]),
            "num_classes": K,
            "class_names": image_set.class_names,
            "pixel_max": int(image_set.pixel_max),
            "learners": learners,
            "splits": split_info,
            "shards": shards,
            "versions": {"datasets": datasets.__version__},
            "elapsed_s": round(time.perf_counter() - t0, 3),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        final = run_dir / DATA_DIR
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("images: %s train, %s val, %s test, %d classes, shape %s", *(split_info[s]["images"] for s in IMAGE_SPLITS),
             K, manifest["image_shape"])
    return manifest


def load_image_rows(run_dir: str | Path, name: str) -> dict[str, np.ndarray]:
    """Images and labels of ``name`` (``train``, ``val``, ``test``, ``shard_00``, …):
    ``{"image": uint8[N, H, W, C], "label": int32[N]}``. Raises ``FileNotFoundError`` naming the
    path when it is missing."""
    from datasets import load_from_disk

    path = Path(run_dir) / DATA_DIR / name
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{path} is missing or incomplete (no saved dataset there)")
    ds = load_from_disk(str(path)).with_format("numpy")
    cols = ds[:]
    return {"image": np.ascontiguousarray(cols["image"], dtype=np.uint8),
            "label": np.ascontiguousarray(cols["label"], dtype=np.int32)}
