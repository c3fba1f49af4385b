"""Image preparation: images and labels → stratified train/val/test split → per-learner shards.

Plain functions, no Prefect import (``tasks.shard`` wraps :func:`prepare_images` through
``data.prepare``). Sources (``data.source``):

* ``digits``: scikit-learn's bundled handwritten digits (1,797 grey 8×8 images, pixels 0-16, 10
  classes; UCI ML digits, Alpaydin & Kaynak 1998): real data shipped inside the package, no network;
* ``hf_images``: a Hugging Face image dataset by name (``data.hf_name``; an image column and an
  integer label column, e.g. ``mnist``, ``cifar10``), where the hub is reachable;
* ``imagefolder``: a local folder, or a .zip / .tar(.gz, .bz2, .xz) archive of one, laid out as
  the ``datasets`` ``imagefolder`` builder expects: one sub-folder per class
  (``data.paths[0]/<class>/<image>``), optionally below split folders named as ``datasets`` names
  them (``train``/``training``, ``val``/``valid``/``validation``/``dev``, ``test``/``testing``/
  ``eval``/``evaluation``), read with Pillow (:func:`scan_image_folder`, :func:`read_image_folder`).
  Split folders are kept as the train/val/test splits; a split the folder lacks is cut from
  ``train/``, stratified. Hidden entries (``.name``, ``__MACOSX``-style ``__name``) are skipped.

Every image becomes ``data.channels`` channels (1 grey or 3 RGB; unset: 1 when every image is
grey, else 3) before any shape check, by :func:`to_channels`: palette images with their palette's
colours, transparency flattened onto a white background, 16-bit grey scaled to 8 bits, CMYK and
YCbCr converted to RGB; then resized to ``data.image_size`` when set.

Run directory layout written by :func:`prepare_images` (``docs/contracts.md``, "Data")::

    RUN/data/{train,val,test}/       datasets.Dataset: ``image`` uint8 [H, W, C], ``label`` ClassLabel
    RUN/data/shard_{m:02d}/          learner m's training images (round-robin; disjoint, cover train)
    RUN/data/manifest.json           modality "image", image_shape, classes, counts per split and class

Shapes: N images of H × W pixels with C channels, stored as uint8 (digits' 0-16 as is; the model
scales by ``pixel_max``); labels int32 in [0, K).
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from configs.data import IMAGE_SOURCES
from data.sources import DATA_DIR, MANIFEST_VERSION
from run import atomic

log = logging.getLogger(__name__)

IMAGE_SPLITS = ("train", "val", "test")


@dataclass
class ImageSet:
    """Images ``uint8[N, H, W, C]``, labels ``int32[N]`` in [0, K), the K class names, the largest
    value a pixel can take (``pixel_max``), where they came from (``info``) and the splits the source
    itself gives (``splits``: split name → sorted ``int64`` indices, e.g. an image folder's
    ``train/`` and ``test/``; None when the source gives none)."""

    images: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    pixel_max: int
    info: dict = field(default_factory=dict)
    splits: dict[str, np.ndarray] | None = None


GREY_MODES = ("1", "L", "LA", "La", "I;16", "I;16L", "I;16B", "I;16N")  # PIL modes read as 1 channel by default
BACKGROUND = (255, 255, 255)  # what transparent pixels are flattened onto: white


def channels_for(modes) -> int:
    """The channel count ``data.channels`` unset means: 1 when every PIL mode in ``modes`` is grey
    (:data:`GREY_MODES`), else 3."""
    return 1 if all(m in GREY_MODES for m in modes) else 3


def to_channels(img, channels: int, name: str = "an image"):
    """A PIL image as mode ``L`` (``channels`` 1) or ``RGB`` (3), whatever its mode.

    Palette images (``P``, ``PA``) take their palette's colours, never the indices. Transparency
    (an alpha band, or a palette's or grey/RGB image's ``transparency`` entry) is flattened onto the
    white :data:`BACKGROUND` (alpha compositing: ``out = α·pixel + (1 − α)·255``). 16-bit grey
    (``I;16``) is scaled to 8 bits (``round(v / 257)``). RGB → grey is PIL's ITU-R 601-2 luma
    ``L = 0.299 R + 0.587 G + 0.114 B``; grey → RGB repeats the grey. CMYK and YCbCr go through
    PIL's conversion to RGB.

    Raises ``ValueError`` naming ``name`` for modes with no 8-bit reading (32-bit ``I``, float
    ``F``, and modes PIL cannot convert to RGB).
    """
    from PIL import Image

    if img.mode.startswith("I;16"):
        img = Image.fromarray(np.round(np.asarray(img, dtype=np.float64) / 257.0).astype(np.uint8))
    elif img.mode in ("I", "F"):
        raise ValueError(
            f"{name} is a {'32-bit integer' if img.mode == 'I' else 'floating-point'} image (PIL mode "
            f"{img.mode}), which has no 8-bit reading; save it as 8-bit grey or RGB"
        )
    if img.mode in ("P", "PA", "RGBA", "RGBa", "LA", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", img.size, (*BACKGROUND, 255)), rgba)
    target = "L" if channels == 1 else "RGB"
    if img.mode != target:
        try:
            img = img.convert(target)
        except ValueError as exc:
            raise ValueError(
                f"{name} has PIL mode {img.mode}, which cannot be converted to {target} ({exc}); save it as grey or RGB"
            ) from None
    return img


def _as_uint8_hwc(img, image_size: int | None, channels: int, name: str = "an image") -> np.ndarray:
    """A PIL image or array as ``uint8[H, W, channels]`` (:func:`to_channels`), resized to a square
    side ``image_size`` when given (PIL's bilinear resampling)."""
    from PIL import Image

    if not isinstance(img, Image.Image):
        arr = np.asarray(img)
        if arr.dtype != np.uint8:
            arr = np.clip(arr, 0, 255).astype(np.uint8)
        img = Image.fromarray(arr[:, :, 0] if arr.ndim == 3 and arr.shape[-1] == 1 else arr)
    img = to_channels(img, channels, name)
    if image_size is not None:
        img = img.resize((image_size, image_size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _mode_of(img) -> str:
    from PIL import Image

    if isinstance(img, Image.Image):
        return img.mode
    arr = np.asarray(img)
    return "L" if arr.ndim == 2 or arr.shape[-1] == 1 else "RGBA" if arr.shape[-1] == 4 else "RGB"


def size_refusal(sizes: dict[tuple[int, int], str], where: str) -> ValueError:
    """The refusal of images of different sizes without ``data.image_size``: ``sizes`` maps each
    (width, height) in pixels to the first image that has it."""
    seen = ", ".join(f"{w}×{h} in {n}" for (w, h), n in sorted(sizes.items())[:3])
    side = max(max(wh) for wh in sizes)
    return ValueError(
        f"data.image_size: {where} holds images of different sizes ({seen}{' …' if len(sizes) > 3 else ''}; "
        f"width × height in pixels); set data.image_size to resize every image to one square side "
        f"(e.g. data.image_size={side})"
    )


def _from_dataset(
    ds, image_column: str, label_column: str, image_size: int | None, where: str, channels: int | None = None
) -> ImageSet:
    for col in (image_column, label_column):
        if col not in ds.column_names:
            raise ValueError(
                f"{where} has no column {col!r} (it has {', '.join(ds.column_names)}); "
                f"name the columns with data.image_column and data.label_column"
            )
    if len(ds) == 0:
        raise ValueError(f"{where} holds no images")
    feature = ds.features[label_column]
    names = list(getattr(feature, "names", None) or [])
    labels = np.asarray(ds[label_column], dtype=np.int64)
    if not names:
        names = [str(x) for x in sorted(set(labels.tolist()))]
        index = {int(v): i for i, v in enumerate(sorted(set(labels.tolist())))}
        labels = np.asarray([index[int(v)] for v in labels])
    raw = ds[image_column]
    channels = channels or channels_for({_mode_of(x) for x in raw})
    images = [_as_uint8_hwc(x, image_size, channels, f"{where} row {i}") for i, x in enumerate(raw)]
    sizes: dict[tuple[int, int], str] = {}
    for i, a in enumerate(images):
        sizes.setdefault((a.shape[1], a.shape[0]), f"row {i}")
    if len(sizes) != 1:
        raise size_refusal(sizes, where)
    return ImageSet(np.stack(images), labels.astype(np.int32), names, 255)


ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


def _split_names() -> dict[str, str]:
    """Folder name (lower case) → our split, from the ``datasets`` library's own split keywords
    (``datasets.data_files.SPLIT_KEYWORDS``), so a folder ``datasets`` reads as a split is one here."""
    from datasets.data_files import SPLIT_KEYWORDS

    ours = {"train": "train", "validation": "val", "test": "test"}
    return {kw: ours[str(split)] for split, kws in SPLIT_KEYWORDS.items() for kw in kws}


def _is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def _image_suffixes() -> set[str]:
    from PIL import Image

    Image.init()
    return {ext.lower() for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


def _hidden(parts) -> bool:
    return any(p.startswith((".", "__")) for p in parts)


@dataclass
class ImageFolder:
    """What :func:`scan_image_folder` finds, without opening an image: ``classes`` (sorted class
    folder names, K), ``files`` (split → ``[(relative POSIX path, label)]``, sorted by path; the
    splits the folder gives, or just ``"all"`` without split folders), ``archive`` (the archive's
    path when ``data.paths[0]`` is one, else None) and ``prefix`` (the archive's top folder that was
    stripped, '' for none)."""

    root: str
    classes: list[str]
    files: dict[str, list[tuple[str, int]]]
    archive: Path | None = None
    prefix: str = ""

    @property
    def given_splits(self) -> list[str]:
        return [s for s in IMAGE_SPLITS if s in self.files]

    def ordered(self) -> list[tuple[str, str, int]]:
        """``(split, relative path, label)`` of every image in the order :func:`read_image_folder`
        stacks them: by split (train, val, test; ``all`` without split folders), then path."""
        return [
            (s, rel, label) for s in ("train", "val", "test", "all") if s in self.files for rel, label in self.files[s]
        ]

    def labels_and_splits(self) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """Labels ``int32[N]`` in :meth:`ordered` order, and the split folders' indices (None without
        split folders): what :func:`complete_splits` needs, known without opening an image."""
        order = self.ordered()
        labels = np.asarray([label for _, _, label in order], dtype=np.int32)
        if "all" in self.files:
            return labels, None
        names = np.asarray([s for s, _, _ in order])
        return labels, {s: np.flatnonzero(names == s) for s in self.given_splits}

    def display(self, rel: str) -> str:
        """A file as the user can find it: ``<folder>/<rel>`` or ``<archive>:<member>``."""
        if self.archive is not None:
            return f"{self.archive}:{self.prefix}{rel}"
        return f"{self.root}/{rel}"

    def read(self):
        """Yield ``(relative path, binary file object)`` for every image, folder order or archive order.
        Raises ``ValueError`` naming the archive when it cannot be read."""
        wanted = {rel for items in self.files.values() for rel, _ in items}
        if self.archive is None:
            for rel in sorted(wanted):
                with open(Path(self.root) / rel, "rb") as f:
                    yield rel, f
            return
        try:
            if self.archive.name.lower().endswith(".zip"):
                with zipfile.ZipFile(self.archive) as z:
                    for info in z.infolist():
                        name = _member(info.filename)
                        rel = name[len(self.prefix) :]
                        if name.startswith(self.prefix) and rel in wanted:
                            with z.open(info) as f:
                                yield rel, io.BytesIO(f.read())
            else:
                with tarfile.open(self.archive, "r|*") as t:  # one sequential pass
                    for m in t:
                        name = _member(m.name)
                        rel = name[len(self.prefix) :]
                        if m.isfile() and name.startswith(self.prefix) and rel in wanted:
                            yield rel, io.BytesIO(t.extractfile(m).read())
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
            raise ValueError(
                f"data.paths[0]: {self.archive} cannot be read as a "
                f"{'zip' if self.archive.name.lower().endswith('.zip') else 'tar'} archive ({exc}); "
                "repack or extract it"
            ) from None


def _member(name: str) -> str:
    """An archive member's path as the folder's relative path: ``./cat/0.png`` and ``/cat//0.png``
    are ``cat/0.png`` (``tar czf x.tgz .`` writes the first form)."""
    return PurePosixPath(name.lstrip("/")).as_posix().removeprefix("./")


def _list_archive(path: Path) -> list[str]:
    kind = "zip" if path.name.lower().endswith(".zip") else "tar"
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as z:
                return [_member(i.filename) for i in z.infolist() if not i.is_dir()]
        with tarfile.open(path, "r:*") as t:
            return [_member(m.name) for m in t.getmembers() if m.isfile()]
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise ValueError(
            f"data.paths[0]: {path} cannot be read as a {kind} archive ({exc}); repack or extract it"
        ) from None


def scan_image_folder(path: str | Path) -> ImageFolder:
    """The layout of an image folder (or of a .zip/.tar archive of one), checked, without opening an
    image.

    Layout: class folders (``cat/``, ``dog/``; images anywhere below each), or split folders
    (``train/`` and any of ``val/``, ``test/``, named as ``datasets`` names splits) with the class
    folders below them. Hidden files and folders (``.x``, ``__x``) are skipped, and so are files
    that are not images (by suffix); an archive whose files all lie below one top folder
    (``zip -r pets.zip pets``) is read from inside it.

    Raises ``FileNotFoundError`` when ``path`` does not exist, or ``ValueError`` in one line
    naming ``data.paths[0]``, the folder or file and the fix, for: a file that is not an archive; an
    unreadable archive; an archive inside the folder; no class folders, or only one; images beside
    the class folders; split folders mixed with other folders, or two folders of one split; split
    folders without ``train/``; a split folder without class folders; a class in ``val/`` or
    ``test/`` that ``train/`` lacks.
    """
    root = Path(path).expanduser()
    where = f"data.paths[0]: {path}"
    suffixes = _image_suffixes()
    archive, prefix = None, ""
    if root.is_dir():
        rels = _list_folder(root, where)
    elif root.is_file():
        archive = root
        rels, prefix = _list_archive_folder(root, where, suffixes)
    else:
        raise FileNotFoundError(
            f"{where} does not exist (an imagefolder is a folder of class sub-folders, or a zip/tar archive of one)"
        )
    images = sorted(r for r in rels if PurePosixPath(r).suffix.lower() in suffixes)
    skipped = len(rels) - len(images)
    if skipped:
        log.info("%s: %d file(s) that are not images skipped", path, skipped)
    parts = [PurePosixPath(r).parts for r in images]
    names = _split_names()
    _check_folders_hold_images(rels, parts, names, where)
    fix = "put the images in one sub-folder per class (cat/, dog/, …), optionally below train/, val/ and test/"
    split_dirs, groups, prefixes = _split_groups(parts, names, where, fix)
    classes = _folder_classes(groups, prefixes, bool(split_dirs), where, fix)
    index = {c: i for i, c in enumerate(classes)}
    files = {s: [(prefixes[s] + "/".join(p), index[p[0]]) for p in ps] for s, ps in groups.items()}
    return ImageFolder(str(root), classes, files, archive, prefix)


def _list_folder(root: Path, where: str) -> list[str]:
    """The files below the folder ``root`` (POSIX paths relative to it), hidden ones skipped;
    ``ValueError`` for an archive among them."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not _hidden([d]))
        for name in filenames:
            if _hidden([name]):
                continue
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if _is_archive(name):
                raise ValueError(
                    f"{where}/{rel} is an archive inside the folder; extract it there, or give the "
                    "archive itself as data.paths[0] (zip and tar archives of an image folder are read)"
                )
            rels.append(rel)
    return rels


def _list_archive_folder(root: Path, where: str, suffixes) -> tuple[list[str], str]:
    """The files of the archive ``root`` (hidden ones skipped) relative to its one top folder if all
    its images lie below one, and that folder's prefix (``"pets/"``, or ``""``). ``ValueError`` for
    a file that is not an archive, or an archive inside it."""
    if not _is_archive(root.name):
        raise ValueError(
            f"{where} is a file, not a folder or a {'/'.join(ARCHIVE_SUFFIXES)} archive; give a folder "
            "of class sub-folders"
        )
    rels = [r for r in _list_archive(root) if not _hidden(PurePosixPath(r).parts)]
    inner = [r for r in rels if _is_archive(r)]
    if inner:
        raise ValueError(
            f"{where} holds another archive ({inner[0]}); extract it into the archive's folders "
            "(archives inside archives are not read)"
        )
    prefix = ""
    pics = [r for r in rels if PurePosixPath(r).suffix.lower() in suffixes]
    tops = {PurePosixPath(r).parts[0] for r in pics}
    if len(tops) == 1 and all(len(PurePosixPath(r).parts) >= 3 for r in pics):  # one wrapper folder
        prefix = f"{tops.pop()}/"  # (files beside it, e.g. pets/../README.md, are no images: skipped)
        rels = [r[len(prefix) :] for r in rels if r.startswith(prefix)]
    return rels, prefix


def _check_folders_hold_images(rels: list[str], parts: list[tuple], names: dict, where: str) -> None:
    """``ValueError`` for a class (or split) folder none of whose files is an image."""
    dirs = {p[:k] for p in map(lambda r: PurePosixPath(r).parts, rels) for k in (1, 2) if len(p) > k}
    with_images = {p[:k] for p in parts for k in (1, 2) if len(p) > k}
    for d in sorted(dirs - with_images, key=len):  # a class (or split) folder whose files are no images
        if len(d) == 1 or d[0].lower() in names:
            example = next(r for r in rels if PurePosixPath(r).parts[: len(d)] == d)
            raise ValueError(
                f"{where}/{'/'.join(d)} holds no image that Pillow reads ({example}); convert the files "
                "(e.g. to PNG) or remove the folder"
            )


def _split_groups(parts: list[tuple], names: dict, where: str, fix: str) -> tuple[list[str], dict, dict]:
    """The split folders, the image paths of each split (below its folder) and each split's folder
    prefix; one group ``all`` without split folders. ``ValueError`` for split folders mixed with
    others, two folders of one split, no ``train/``, or images beside the split folders."""
    tops = sorted({p[0] for p in parts if len(p) > 1})
    split_dirs = [t for t in tops if t.lower() in names]
    if not split_dirs:
        groups = {"all": parts}
        prefixes = {"all": ""}
    else:
        others = [t for t in tops if t not in split_dirs]
        if others:
            raise ValueError(
                f"{where} mixes split folders ({', '.join(split_dirs)}) with other folders "
                f"({', '.join(others[:3])}); put every class folder below the split folders"
            )
        by_split: dict[str, list[str]] = {}
        for t in split_dirs:
            by_split.setdefault(names[t.lower()], []).append(t)
        for s, dirs in by_split.items():
            if len(dirs) > 1:
                raise ValueError(f"{where} has two folders for the {s} split ({', '.join(dirs)}); merge them")
        if "train" not in by_split:
            raise ValueError(
                f"{where} has {', '.join(d + '/' for d in split_dirs)} but no train/ (or training/); "
                "add the training images there, class folders inside"
            )
        groups = {
            s: [p[1:] for p in parts if len(p) > 1 and p[0] == by_split[s][0]] for s in IMAGE_SPLITS if s in by_split
        }
        prefixes = {s: f"{by_split[s][0]}/" for s in groups}
    loose = [p for p in parts if len(p) == 1]
    if loose and split_dirs:
        raise ValueError(f"{where} holds images beside its split folders ({loose[0][0]}); {fix}")
    return split_dirs, groups, prefixes


def _folder_classes(groups: dict, prefixes: dict, has_splits: bool, where: str, fix: str) -> list[str]:
    """The classes (train/'s, or the folder's), sorted. ``ValueError`` for a split without class
    folders or with images beside them, a class that train/ lacks, or fewer than 2 classes."""
    classes_by: dict[str, list[str]] = {}
    for s, ps in groups.items():
        sub = f"{where}/{prefixes[s].rstrip('/')}" if prefixes[s] else where
        cls = sorted({p[0] for p in ps if len(p) > 1})
        stray = [p[0] for p in ps if len(p) == 1]
        if not cls:
            what = "holds images but no class sub-folders" if stray else "holds no images"
            if not has_splits:
                what = "holds no class sub-folders" + (
                    f" ({len(stray)} images lie in it directly)" if stray else " and no images"
                )
            raise ValueError(f"{sub} {what}; {fix}")
        if stray:
            raise ValueError(
                f"{sub} holds images outside the class sub-folders ({stray[0]}); move them into their "
                "class folder or remove them"
            )
        classes_by[s] = cls
    classes = classes_by["train" if has_splits else "all"]
    for s, cls in classes_by.items():
        extra = sorted(set(cls) - set(classes))
        if extra:
            raise ValueError(
                f"{where}/{prefixes[s]}{extra[0]} is a class that train/ lacks; add its training images "
                f"under train/{extra[0]}/ or remove it"
            )
    if len(classes) < 2:
        raise ValueError(
            f"{where} holds {len(classes)} class sub-folder ({', '.join(classes)}); an imagefolder needs "
            "≥ 2, one per class, images inside"
        )
    return classes


def _open_image(f, name: str):
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        img = Image.open(f)
        if img.getexif().get(0x0112) not in (None, 1):  # EXIF Orientation: turn as cameras mean it
            img = ImageOps.exif_transpose(img)
        return img
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise ValueError(f"data.paths[0]: {name} is not a readable image ({detail}); remove or replace it") from None


def inspect_image_folder(folder: ImageFolder, image_size: int | None = None, channels: int | None = None) -> dict:
    """Open every image's header (no pixels decoded) and check what the data step will need: each
    file is an image Pillow reads, and, without ``image_size``, all have one size.

    Returns ``{"image_shape": (H, W, C), "num_classes": K, "counts": {split: images}}`` (C:
    ``channels``, else :func:`channels_for` the modes found). Raises ``ValueError`` naming the file
    (unreadable) or ``data.image_size`` (:func:`size_refusal`), and the fix.
    """
    modes, sizes = set(), {}
    for rel, f in folder.read():
        img = _open_image(f, folder.display(rel))
        modes.add(img.mode)
        sizes.setdefault(img.size, rel)
    if not sizes:  # the scan listed images that reading the folder did not meet
        raise ValueError(
            f"data.paths[0]: {folder.archive or folder.root}: none of its {sum(map(len, folder.files.values()))} "
            "images could be read back; repack it (e.g. cd pets && zip -r ../pets.zip .)"
        )
    if image_size is None and len(sizes) > 1:
        raise size_refusal(sizes, f"data.paths[0] {folder.root}")
    w, h = (image_size, image_size) if image_size is not None else next(iter(sizes))
    return {
        "image_shape": (h, w, channels or channels_for(modes)),
        "num_classes": len(folder.classes),
        "counts": {s: len(v) for s, v in folder.files.items()},
    }


def read_image_folder(folder: ImageFolder, image_size: int | None = None, channels: int | None = None) -> ImageSet:
    """Decode every image of ``folder`` (:func:`scan_image_folder`) into an :class:`ImageSet`.

    Images are ordered by split (train, val, test) then path; each is converted by
    :func:`to_channels` (``channels``, else :func:`channels_for` the modes found) and resized to
    ``image_size`` when given. ``splits`` holds the split folders' indices (None without split
    folders). Raises ``ValueError`` naming the file that is not a readable image, or naming
    ``data.image_size`` when sizes differ and it is unset.
    """
    decoded = {}
    for rel, f in folder.read():
        img = _open_image(f, folder.display(rel))
        img.load()
        decoded[rel] = img
    channels = channels or channels_for({im.mode for im in decoded.values()})
    order = folder.ordered()
    arrays, sizes = [], {}
    for _, rel, _ in order:
        arrays.append(_as_uint8_hwc(decoded.pop(rel), image_size, channels, folder.display(rel)))
        sizes.setdefault((arrays[-1].shape[1], arrays[-1].shape[0]), rel)
    if len(sizes) > 1:
        raise size_refusal(sizes, f"data.paths[0] {folder.root}")
    labels, splits = folder.labels_and_splits()
    info = {
        "source": "imagefolder",
        "name": str(folder.root),
        "channels": int(channels),
        "folder_splits": folder.given_splits,
    }
    return ImageSet(np.stack(arrays), labels, list(folder.classes), 255, info, splits)


def load_images(
    source: str,
    *,
    hf_name: str | None = None,
    hf_split: str = "train",
    image_column: str = "image",
    label_column: str = "label",
    path: str | None = None,
    image_size: int | None = None,
    channels: int | None = None,
) -> ImageSet:
    """Read the images of ``source`` (one of :data:`IMAGE_SOURCES`) as ``channels`` channels (1 or 3;
    None: 1 when every image is grey, else 3; digits: 1), converted by :func:`to_channels`.

    Raises ``ValueError`` naming the source and the fix for an unknown source, missing columns,
    images of different sizes (without ``image_size``), and every refusal of
    :func:`scan_image_folder` and :func:`read_image_folder` (a folder that is not laid out as
    class folders, an unreadable image or archive); ``FileNotFoundError`` for a missing folder; the
    ``datasets`` errors for an unreachable hub dataset.
    """
    if source == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        images = np.asarray(d.images, dtype=np.uint8)[:, :, :, None]  # 0-16 integers, stored as is
        if image_size is not None:
            raise ValueError("data.image_size does not apply to digits (8×8 as shipped); remove it")
        if channels == 3:
            images = np.repeat(images, 3, axis=-1)
        return ImageSet(
            images,
            np.asarray(d.target, dtype=np.int32),
            [str(n) for n in d.target_names],
            16,
            {"source": "digits", "name": "scikit-learn load_digits (UCI ML hand-written digits)"},
        )
    if source == "hf_images":
        import datasets

        if not hf_name:
            raise ValueError("data.hf_name must name a Hugging Face image dataset for data.source: hf_images")
        ds = datasets.load_dataset(hf_name, split=hf_split)
        out = _from_dataset(ds, image_column, label_column, image_size, f"{hf_name} ({hf_split})", channels)
        out.info = {"source": "hf_images", "name": hf_name, "split": hf_split, "channels": int(out.images.shape[-1])}
        return out
    if source == "imagefolder":
        if not path:
            raise ValueError("data.paths[0] must name a folder of class sub-folders for data.source: imagefolder")
        return read_image_folder(scan_image_folder(path), image_size, channels)
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
        raise ValueError(
            f"class {int(counts.argmin())} has {int(counts.min())} image(s); every class needs ≥ 3 "
            "to appear in train, val and test"
        )
    try:
        rest, test = train_test_split(idx, test_size=test_fraction, stratify=labels, random_state=seed)
        train, val = train_test_split(
            rest, test_size=val_fraction / (1.0 - test_fraction), stratify=labels[rest], random_state=seed
        )
    except ValueError as exc:
        raise ValueError(
            f"cannot split {len(labels)} images into val {val_fraction:.0%} and test "
            f"{test_fraction:.0%} with every class in each ({exc}); raise data.val_fraction "
            "and data.test_fraction or use more images"
        ) from None
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


SPLIT_SOURCES = {
    "folder": "the source's own split folder",
    "train folder, stratified": "cut from the train/ folder, stratified",
    "stratified": "cut from all images, stratified",
}


def complete_splits(
    image_set: ImageSet, val_fraction: float, test_fraction: float, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The train/val/test indices of ``image_set`` and where each came from (:data:`SPLIT_SOURCES`).

    Without given splits: :func:`stratified_split` of all images (fractions of all images). With an
    image folder's split folders: each given split as is; a missing ``val`` or ``test`` is cut from
    ``train/``, stratified, ``val_fraction`` / ``test_fraction`` being shares of the ``train/``
    images (the same labels and seed give the same cut). Raises ``ValueError`` naming the fractions
    when ``train/`` is too small to cut from with every class in each part.
    """
    from sklearn.model_selection import train_test_split

    if not image_set.splits:
        return (
            stratified_split(image_set.labels, val_fraction, test_fraction, seed),
            {s: "stratified" for s in IMAGE_SPLITS},
        )
    splits = {s: np.sort(np.asarray(i, dtype=np.int64)) for s, i in image_set.splits.items()}
    source = {s: "folder" for s in IMAGE_SPLITS if s in splits}
    missing = [s for s in ("val", "test") if s not in splits]
    train = splits["train"]
    labels = image_set.labels[train]
    try:
        if missing == ["val", "test"]:
            cut = stratified_split(np.unique(labels, return_inverse=True)[1], val_fraction, test_fraction, seed)
            splits.update({s: np.sort(train[i]) for s, i in cut.items()})
        elif missing:
            frac = val_fraction if missing == ["val"] else test_fraction
            keep, held = train_test_split(np.arange(len(train)), test_size=frac, stratify=labels, random_state=seed)
            splits.update({"train": np.sort(train[keep]), missing[0]: np.sort(train[held])})
    except ValueError as exc:
        fields = " and ".join(f"data.{s}_fraction" for s in missing)
        raise ValueError(
            f"cannot cut {' and '.join(missing)} from the {len(train)} images of train/ with every class in "
            f"each ({str(exc).splitlines()[0]}); add images to train/, add {'/ and '.join(missing)}/ "
            f"folders, or change {fields}"
        ) from None
    source.update({s: "train folder, stratified" for s in missing})
    return {s: splits[s] for s in IMAGE_SPLITS}, {s: source[s] for s in IMAGE_SPLITS}


def _dataset(images: np.ndarray, labels: np.ndarray, class_names: list[str]):
    from datasets import Array3D, ClassLabel, Dataset, Features

    features = Features(
        {"image": Array3D(shape=images.shape[1:], dtype="uint8"), "label": ClassLabel(names=class_names)}
    )
    return Dataset.from_dict({"image": images, "label": labels.astype(np.int64)}, features=features)


def prepare_images(
    image_set: ImageSet,
    splits: dict[str, np.ndarray],
    learners: int,
    run_dir: str | Path,
    record: dict,
    split_source: dict[str, str] | None = None,
) -> dict:
    """Write ``RUN/data`` (layout in the module docstring) and return its manifest.

    ``splits``: :func:`stratified_split`'s or :func:`complete_splits`' indices; ``split_source``:
    where each split came from (:func:`complete_splits`; default all ``stratified``); ``learners``: M
    shards of the training split, round-robin (``Dataset.shard(..., contiguous=False)``);
    ``record``: what determines the data (``data.text.config_record``), kept in the manifest. Built
    in a temporary folder and renamed into place (a failure never leaves a half-written
    ``RUN/data``). Raises ``ValueError`` when the training split cannot give every learner an image.
    The manifest: ``modality`` "image", ``image_shape`` [H, W, C], ``num_classes``, ``class_names``,
    ``pixel_max``, ``splits`` (per split ``images`` and ``per_class``), ``split_source`` (split →
    ``folder`` | ``train folder, stratified`` | ``stratified``), ``shards`` (``name``, ``path``,
    ``images``), ``learners``.
    """
    import datasets

    t0 = time.perf_counter()
    datasets.disable_progress_bars()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    K = len(image_set.class_names)
    with atomic.folder(run_dir / DATA_DIR) as tmp:  # the old folder goes only once the new one is in
        split_info = {}
        for s in IMAGE_SPLITS:
            idx = splits[s]
            ds = _dataset(image_set.images[idx], image_set.labels[idx], image_set.class_names)
            ds.save_to_disk(str(tmp / s))
            split_info[s] = {
                "images": int(len(idx)),
                "per_class": np.bincount(image_set.labels[idx], minlength=K).tolist(),
            }
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
            "split_source": dict(split_source or {s: "stratified" for s in IMAGE_SPLITS}),
            "shards": shards,
            "versions": {"datasets": datasets.__version__},
            "elapsed_s": round(time.perf_counter() - t0, 3),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log.info(
        "images: %s train, %s val, %s test, %d classes, shape %s",
        *(split_info[s]["images"] for s in IMAGE_SPLITS),
        K,
        manifest["image_shape"],
    )
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
    return {
        "image": np.ascontiguousarray(cols["image"], dtype=np.uint8),
        "label": np.ascontiguousarray(cols["label"], dtype=np.int32),
    }
