"""Image data: the digits load offline, the split is deterministic and stratified, the shards are
disjoint and cover the training split, an image folder reads, bad image configs are refused."""

import json
import re

import numpy as np
import pytest

from configs.load import validation_lines
from configs.schema import ExperimentConfig
from data.images import load_image_rows, load_images, prepare_images, stratified_split


@pytest.fixture(scope="module")
def digits():
    return load_images("digits")


def test_digits_are_real_and_offline(digits):
    assert digits.images.shape == (1797, 8, 8, 1) and digits.images.dtype == np.uint8
    assert digits.images.max() == 16 and digits.pixel_max == 16
    assert np.bincount(digits.labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_split_is_deterministic_and_stratified(digits):
    a = stratified_split(digits.labels, 0.1, 0.2, seed=0)
    b = stratified_split(digits.labels, 0.1, 0.2, seed=0)
    c = stratified_split(digits.labels, 0.1, 0.2, seed=1)
    for s in ("train", "val", "test"):
        np.testing.assert_array_equal(a[s], b[s])
    assert not np.array_equal(a["test"], c["test"])
    assert sorted(np.concatenate(list(a.values())).tolist()) == list(range(1797))  # a partition
    total = np.bincount(digits.labels)
    for s, frac in (("val", 0.1), ("test", 0.2)):
        per_class = np.bincount(digits.labels[a[s]], minlength=10)
        assert np.all(np.abs(per_class - frac * total) <= 1.5), (s, per_class)  # every class in proportion


def test_prepare_writes_disjoint_shards_that_cover_train(digits, tmp_path):
    splits = stratified_split(digits.labels, 0.1, 0.2, seed=0)
    manifest = prepare_images(digits, splits, 3, tmp_path, {"data": "test"})
    assert manifest["modality"] == "image" and manifest["image_shape"] == [8, 8, 1]
    assert manifest["num_classes"] == 10 and manifest["splits"]["test"]["images"] == len(splits["test"])
    assert json.loads((tmp_path / "data" / "manifest.json").read_text()) == manifest
    train = load_image_rows(tmp_path, "train")
    np.testing.assert_array_equal(train["image"], digits.images[splits["train"]])
    shards = [load_image_rows(tmp_path, f"shard_{m:02d}") for m in range(3)]
    assert sum(len(s["label"]) for s in shards) == len(train["label"])
    keys = sorted(bytes(x) + bytes([y]) for s in shards for x, y in zip(s["image"], s["label"], strict=True))
    assert keys == sorted(bytes(x) + bytes([y]) for x, y in zip(train["image"], train["label"], strict=True))
    assert not list(tmp_path.glob(".data.tmp-*"))  # the temp folder was renamed into place


def test_an_image_folder_reads_with_its_class_names(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    got = load_images("imagefolder", path=str(tmp_path), image_size=4)
    assert got.images.shape == (8, 4, 4, 3) and got.class_names == ["cat", "dog"]
    assert np.bincount(got.labels).tolist() == [4, 4] and got.pixel_max == 255
    with pytest.raises(ValueError, match="class sub-folder"):
        load_images("imagefolder", path=str(tmp_path / "cat"))


@pytest.mark.parametrize(
    "data, model, message",
    [
        ({"source": "digits"}, {"kind": "dense_lm"}, "model.kind dense_lm does not take image data"),
        ({"source": "shakespeare"}, {"kind": "vit"}, "model.kind vit does not take text data"),
        ({"source": "digits", "seq_len": 64}, {"kind": "vit"}, "data.seq_len applies to text sources"),
        ({"source": "shakespeare", "val_fraction": 0.2}, {"kind": "dense_lm"}, "data.val_fraction applies to image"),
        ({"source": "imagefolder"}, {"kind": "vit"}, "data.paths must hold exactly one folder"),
        ({"source": "digits", "val_fraction": 0.45, "test_fraction": 0.45}, {"kind": "vit"}, "leave ≥ 10 %"),
    ],
)
def test_bad_image_configs_are_refused(data, model, message):
    with pytest.raises(Exception) as err:
        ExperimentConfig.model_validate({"data": data, "model": model})
    assert message in " | ".join(validation_lines(err.value))


def test_a_validation_split_smaller_than_one_batch_is_refused_before_work(tmp_path):
    from PIL import Image

    from flows.preflight import preflight

    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    cfg = ExperimentConfig.model_validate(
        {
            "data": {"source": "imagefolder", "paths": [str(tmp_path / "imgs")]},
            "model": {"kind": "vit", "patch_size": 4},
            "diloco": {"learners": 2, "fragments": 2, "quorum": 1, "batch_size": 4},
            "dp": {"batch_size": 8, "workers": 2},
            "train": {"token_budget": 400, "eval_every_tokens": 200, "eval_batches": 1, "eval_batch_size": 16},
        }
    )
    with pytest.raises(
        ValueError, match=r"of the 40 images holds 4 validation images, fewer than train.eval_batch_size \(16\)"
    ):
        preflight(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# -- issue 25, part 4: image folders as users have them -----------------------------------------
def _save(img, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def _palette(colour, size=(6, 6), transparent=False):
    from PIL import Image

    img = Image.new("P", size, 0)
    img.putpalette([*colour, *([0, 0, 0] * 255)])
    if transparent:
        img.info["transparency"] = 0
    return img


def _modes_folder(root):
    """Two classes, every common mode once, each image one flat colour (file names sort in this order)."""
    from PIL import Image

    _save(_palette((200, 10, 30)), root / "a" / "0_palette.png")
    _save(Image.new("RGBA", (6, 6), (255, 0, 0, 0)), root / "a" / "1_rgba_clear.png")
    _save(Image.new("RGBA", (6, 6), (0, 0, 0, 128)), root / "a" / "2_rgba_half.png")
    _save(_palette((9, 9, 9), transparent=True), root / "a" / "3_palette_clear.png")
    _save(Image.new("L", (6, 6), 100), root / "b" / "0_grey.png")
    _save(Image.new("LA", (6, 6), (0, 0)), root / "b" / "1_grey_clear.png")
    _save(Image.new("RGB", (6, 6), (1, 2, 3)), root / "b" / "2_rgb.png")
    _save(Image.new("1", (6, 6), 1), root / "b" / "3_bilevel.png")
    _save(Image.new("RGB", (6, 6), (200, 10, 30)).convert("CMYK"), root / "b" / "4_cmyk.jpg")


def test_every_mode_is_read_with_its_colours(tmp_path):
    """Palette images give their palette's colours (not the indices), alpha is flattened onto white,
    grey is repeated into RGB, and the colour images set 3 channels unless data.channels says 1."""
    _modes_folder(tmp_path)
    got = load_images("imagefolder", path=str(tmp_path))
    assert got.images.shape == (9, 6, 6, 3) and got.labels.tolist() == [0] * 4 + [1] * 5
    assert np.all(got.images == got.images[:, :1, :1]), "each image is one flat colour"
    px = got.images[:, 0, 0].tolist()
    assert px[:8] == [
        [200, 10, 30],
        [255, 255, 255],
        [127, 127, 127],
        [255, 255, 255],
        [100, 100, 100],
        [255, 255, 255],
        [1, 2, 3],
        [255, 255, 255],
    ]
    assert np.abs(np.array(px[8]) - [200, 10, 30]).max() <= 6  # JPEG, CMYK: near the colour it was saved as
    grey = load_images("imagefolder", path=str(tmp_path), channels=1)
    assert grey.images.shape == (9, 6, 6, 1)
    # ITU-R 601-2 luma (PIL's L): 0.299 R + 0.587 G + 0.114 B
    assert grey.images[[0, 4, 6], 0, 0, 0].tolist() == [69, 100, 2]


def test_grey_folders_stay_one_channel(tmp_path):
    from PIL import Image

    for c in ("a", "b"):
        for i in range(3):
            _save(Image.new("L", (5, 5), 10 * i), tmp_path / c / f"{i}.png")
    assert load_images("imagefolder", path=str(tmp_path)).images.shape == (6, 5, 5, 1)
    assert load_images("imagefolder", path=str(tmp_path), channels=3).images.shape == (6, 5, 5, 3)


def _mixed_sizes(root, per_class=20):
    """Two classes of 8×8 RGB, 6×6 grey, 5×7 palette and 8×8 RGBA images."""
    from PIL import Image

    makers = [
        lambda: Image.new("RGB", (8, 8), (40, 50, 60)),
        lambda: Image.new("L", (6, 6), 70),
        lambda: _palette((1, 200, 3), size=(5, 7)),
        lambda: Image.new("RGBA", (8, 8), (0, 0, 255, 255)),
    ]
    for c in ("a", "b"):
        for i in range(per_class):
            _save(makers[i % 4](), root / c / f"{i:02d}.png")


def _image_cfg(folder, eval_batch_size=2, **data):
    return ExperimentConfig.model_validate(
        {
            "data": {"source": "imagefolder", "paths": [str(folder)], **data},
            "model": {"kind": "vit", "patch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
            "diloco": {"learners": 2, "fragments": 1, "quorum": 1, "batch_size": 4},
            "dp": {"batch_size": 8, "workers": 2},
            "train": {
                "token_budget": 400,
                "eval_every_tokens": 200,
                "eval_batches": 1,
                "eval_batch_size": eval_batch_size,
            },
        }
    )


def test_mixed_modes_and_sizes_are_refused_before_work_with_a_fix_that_works(tmp_path):
    from data.prepare import prepare_data
    from flows.preflight import preflight

    _mixed_sizes(tmp_path / "imgs")
    with pytest.raises(ValueError, match=r"data.image_size.*different sizes.*\(5×7 .*a/02.png.*set data.image_size"):
        preflight(_image_cfg(tmp_path / "imgs"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    cfg = _image_cfg(tmp_path / "imgs", image_size=8)
    run = preflight(cfg, tmp_path / "run")  # the fix it names works
    manifest = prepare_data(cfg, run)
    assert manifest["image_shape"] == [8, 8, 3] and sum(s["images"] for s in manifest["splits"].values()) == 40
    with pytest.raises(ValueError, match=r"model \(vit\) does not fit the data.*patch"):
        preflight(_image_cfg(tmp_path / "imgs", image_size=6), tmp_path / "run2")  # patch 4 ∤ 6, known before work


def _split_folder(root, splits=(("train", 6), ("val", 2), ("test", 3)), classes=("cat", "dog")):
    from PIL import Image

    for s, n in splits:
        for k, c in enumerate(classes):
            for i in range(n):
                _save(Image.new("RGB", (8, 8), (k, i, len(s))), root / s / c / f"{i}.png")


def test_split_folders_are_read_as_splits_with_classes_below(tmp_path):
    from data.prepare import prepare_data

    _split_folder(tmp_path / "full")
    got = load_images("imagefolder", path=str(tmp_path / "full"))
    assert got.class_names == ["cat", "dog"] and len(got.labels) == 22
    assert {s: len(i) for s, i in got.splits.items()} == {"train": 12, "val": 4, "test": 6}
    manifest = prepare_data(_image_cfg(tmp_path / "full"), tmp_path / "run")
    assert manifest["class_names"] == ["cat", "dog"]
    assert {s: v["images"] for s, v in manifest["splits"].items()} == {"train": 12, "val": 4, "test": 6}
    assert manifest["splits"]["test"]["per_class"] == [3, 3] and manifest["split_source"]["test"] == "folder"
    test = load_image_rows(tmp_path / "run", "test")
    assert sorted(set(test["image"][:, 0, 0, 2].tolist())) == [4]  # the blue channel marks "test" (len 4)
    # train/ + validation/ (HF's split names), no test/: the test split is cut from train/, stratified
    _split_folder(tmp_path / "tv", splits=(("train", 10), ("validation", 2)))
    manifest = prepare_data(_image_cfg(tmp_path / "tv", test_fraction=0.2), tmp_path / "run2")
    assert {s: v["images"] for s, v in manifest["splits"].items()} == {"train": 16, "val": 4, "test": 4}
    assert manifest["split_source"] == {"train": "folder", "val": "folder", "test": "train folder, stratified"}


@pytest.mark.parametrize(
    "layout, needle",
    [
        ("train_and_class", "data.paths[0]: {root} mixes split folders (train) with other folders (cats)"),
        ("test_only", "data.paths[0]: {root} has test/ but no train/"),
        ("flat_split", "data.paths[0]: {root}/train holds images but no class sub-folders"),
        ("new_class", "data.paths[0]: {root}/test/bird is a class that train/ lacks"),
        ("two_vals", "data.paths[0]: {root} has two folders for the val split (val, validation)"),
        ("flat", "data.paths[0]: {root} holds no class sub-folders"),
        ("hidden_only", "data.paths[0]: {root} holds no class sub-folders"),
        ("loose_images", "data.paths[0]: {root} holds images outside the class sub-folders (x.png)"),
        ("nested_zip", "data.paths[0]: {root}/more.zip is an archive inside the folder"),
        ("corrupt", "data.paths[0]: {root}/a/bad.png is not a readable image"),
        ("one_class", "data.paths[0]: {root} holds 1 class sub-folder (a); an imagefolder needs ≥ 2"),
        ("unreadable_class", "data.paths[0]: {root}/b holds no image that Pillow reads (b/0.heic)"),
    ],
)
def test_folder_layouts_that_cannot_be_read_are_refused_in_one_line(tmp_path, layout, needle):
    from PIL import Image

    from flows.preflight import check_image_source

    root = tmp_path / "imgs"
    img = Image.new("RGB", (8, 8), (5, 5, 5))
    if layout in ("train_and_class", "test_only", "new_class", "two_vals"):
        _split_folder(
            root,
            splits={
                "train_and_class": (("train", 3),),
                "test_only": (("test", 3),),
                "new_class": (("train", 3),),
                "two_vals": (("train", 3), ("val", 1), ("validation", 1)),
            }[layout],
        )
        if layout == "train_and_class":
            _save(img, root / "cats" / "0.png")
        if layout == "new_class":
            _save(img, root / "test" / "bird" / "0.png")
    elif layout == "flat_split":
        for i in range(3):
            _save(img, root / "train" / f"{i}.png")
    else:
        for i in range(3):
            _save(img, (root if layout in ("flat", "hidden_only") else root / "a") / f"{i}.png")
            if layout == "unreadable_class":
                (root / "b").mkdir(exist_ok=True)
                (root / "b" / f"{i}.heic").write_bytes(b"\0\0\0\x18ftypheic")  # no Pillow plugin reads HEIC
            elif layout not in ("flat", "hidden_only", "one_class"):
                _save(img, root / "b" / f"{i}.png")
        if layout == "hidden_only":  # a notebook's and a Mac zip's folders are not classes
            _save(img, root / ".ipynb_checkpoints" / "0.png")
            _save(img, root / "__MACOSX" / "0.png")
        if layout == "loose_images":
            _save(img, root / "x.png")
        if layout == "nested_zip":
            import zipfile

            with zipfile.ZipFile(root / "more.zip", "w") as z:
                z.writestr("c/0.png", b"")
        if layout == "corrupt":
            (root / "a" / "bad.png").write_bytes(b"not a png")
    cfg = _image_cfg(root)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        check_image_source(cfg)
    line = str(err.value)
    assert "\n" not in line and needle.format(root=root) in line, line
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(needle.format(root=root))):
        load_images("imagefolder", path=str(root))


@pytest.mark.parametrize("suffix", ["zip", "tar.gz", "tar"])
def test_an_archive_is_read_like_the_folder_inside_it(tmp_path, suffix):
    """``data.paths[0]`` may be a .zip or .tar(.gz) archive of the folder (with or without the top folder
    ``zip -r pets.zip pets`` adds)."""
    import shutil

    _split_folder(tmp_path / "pets", splits=(("train", 10), ("test", 3)))
    folder = load_images("imagefolder", path=str(tmp_path / "pets"))
    fmt = {"zip": "zip", "tar.gz": "gztar", "tar": "tar"}[suffix]
    archive = shutil.make_archive(str(tmp_path / "pets"), fmt, root_dir=tmp_path, base_dir="pets")
    assert archive.endswith(suffix)
    got = load_images("imagefolder", path=archive)
    np.testing.assert_array_equal(got.images, folder.images)
    np.testing.assert_array_equal(got.labels, folder.labels)
    assert {s: i.tolist() for s, i in got.splits.items()} == {s: i.tolist() for s, i in folder.splits.items()}
    from flows.preflight import check_image_source

    check_image_source(_image_cfg(archive))
    (tmp_path / "broken.zip").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(
        ValueError, match=re.escape(f"data.paths[0]: {tmp_path / 'broken.zip'} cannot be read as a zip")
    ):
        load_images("imagefolder", path=str(tmp_path / "broken.zip"))


@pytest.mark.parametrize("how", ["dot", "dotted_wrapper", "wrapper_with_readme", "home"])
def test_archives_and_paths_as_users_make_them(tmp_path, monkeypatch, how):
    """``cd pets && tar czf ../pets.tgz .`` (members ``./train/...``), ``tar czf pets.tgz ./pets``, a
    wrapper folder with a README beside the class folders, and a ``~/`` path: each reads as the folder."""
    import tarfile

    _split_folder(tmp_path / "pets", splits=(("train", 10), ("test", 3)))
    folder = load_images("imagefolder", path=str(tmp_path / "pets"))
    path = tmp_path / "pets.tgz"
    if how == "dot":
        with tarfile.open(path, "w:gz") as t:
            t.add(tmp_path / "pets", arcname=".")
    elif how == "dotted_wrapper":
        with tarfile.open(path, "w:gz") as t:
            t.add(tmp_path / "pets", arcname="./pets")
    elif how == "wrapper_with_readme":
        (tmp_path / "pets" / "README.md").write_text("my pets\n")
        with tarfile.open(path, "w:gz") as t:
            t.add(tmp_path / "pets", arcname="pets")
    else:
        monkeypatch.setenv("HOME", str(tmp_path))
        path = "~/pets"
    got = load_images("imagefolder", path=str(path))
    np.testing.assert_array_equal(got.images, folder.images)
    np.testing.assert_array_equal(got.labels, folder.labels)
    from flows.preflight import check_image_source

    check_image_source(_image_cfg(str(path)))


def test_a_hub_style_dataset_converts_modes_too(tmp_path):
    """``hf_images`` (here a local Parquet dataset folder, as ``data.hf_name`` may be) goes through the same
    conversion: palette colours, alpha onto white, grey repeated."""
    from datasets import ClassLabel, Dataset, Features, Image as ImageFeature
    from PIL import Image

    rows = [
        _palette((200, 10, 30)),
        Image.new("RGBA", (6, 6), (0, 0, 0, 0)),
        Image.new("L", (6, 6), 100),
        Image.new("RGB", (6, 6), (1, 2, 3)),
    ] * 2
    ds = Dataset.from_dict(
        {"image": rows, "label": [0, 0, 1, 1] * 2},
        features=Features({"image": ImageFeature(), "label": ClassLabel(names=["x", "y"])}),
    )
    (tmp_path / "hub").mkdir()
    ds.to_parquet(str(tmp_path / "hub" / "train.parquet"))
    got = load_images("hf_images", hf_name=str(tmp_path / "hub"))
    assert got.images.shape == (8, 6, 6, 3) and got.class_names == ["x", "y"]
    assert got.images[:4, 0, 0].tolist() == [[200, 10, 30], [255, 255, 255], [100, 100, 100], [1, 2, 3]]


def test_split_problems_are_found_before_work(tmp_path):
    """The data step's own split runs in preflight on the file list (no image decoded): a class too
    small to split, or a val/ folder smaller than one held-out batch, is refused before anything is
    written; an archive inside the archive is refused naming it."""
    import zipfile

    from PIL import Image

    from flows.preflight import check_image_source

    for c, n in (("a", 30), ("b", 2)):
        for i in range(n):
            _save(Image.new("RGB", (8, 8), (i, 0, 0)), tmp_path / "small" / c / f"{i}.png")
    with pytest.raises(ValueError, match=r"class 1 has 2 image\(s\); every class needs ≥ 3"):
        check_image_source(_image_cfg(tmp_path / "small"))
    _split_folder(tmp_path / "sv", splits=(("train", 10), ("val", 1)))
    with pytest.raises(
        ValueError,
        match=r"the val split folder of .*sv holds 2 validation images, fewer than "
        r"train.eval_batch_size \(4\) for one held-out batch; add validation images",
    ):
        check_image_source(_image_cfg(tmp_path / "sv", eval_batch_size=4))
    with zipfile.ZipFile(tmp_path / "outer.zip", "w") as z:
        z.writestr("a/0.png", b"")
        z.writestr("a/inner.zip", b"")
    with pytest.raises(
        ValueError, match=re.escape(f"data.paths[0]: {tmp_path / 'outer.zip'} holds another archive (a/inner.zip)")
    ):
        load_images("imagefolder", path=str(tmp_path / "outer.zip"))
