"""Image data: the digits load offline, the split is deterministic and stratified, the shards are
disjoint and cover the training split, an image folder reads, bad image configs are refused."""

import json

import numpy as np
import pytest

from configs.schema import ExperimentConfig, validation_lines
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


@pytest.mark.parametrize("data, model, message", [
    ({"source": "digits"}, {"kind": "dense_lm"}, "model.kind dense_lm does not take image data"),
    ({"source": "shakespeare"}, {"kind": "vit"}, "model.kind vit does not take text data"),
    ({"source": "digits", "seq_len": 64}, {"kind": "vit"}, "data.seq_len applies to text sources"),
    ({"source": "shakespeare", "val_fraction": 0.2}, {"kind": "dense_lm"}, "data.val_fraction applies to image"),
    ({"source": "imagefolder"}, {"kind": "vit"}, "data.paths must hold exactly one folder"),
    ({"source": "digits", "val_fraction": 0.45, "test_fraction": 0.45}, {"kind": "vit"}, "leave ≥ 10 %"),
])
def test_bad_image_configs_are_refused(data, model, message):
    with pytest.raises(Exception) as err:
        ExperimentConfig.model_validate({"data": data, "model": model})
    assert message in " | ".join(validation_lines(err.value))


def test_a_validation_split_smaller_than_one_batch_is_refused_before_work(tmp_path):
    from flows.preflight import preflight
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    cfg = ExperimentConfig.model_validate({
        "data": {"source": "imagefolder", "paths": [str(tmp_path / "imgs")]},
        "model": {"kind": "vit", "patch_size": 4},
        "diloco": {"learners": 2, "fragments": 2, "quorum": 1, "batch_size": 4}, "dp": {"batch_size": 8, "workers": 2},
        "train": {"token_budget": 400, "eval_every_tokens": 200, "eval_batches": 1, "eval_batch_size": 16}})
    with pytest.raises(ValueError, match=r"about 4 validation images, fewer than train.eval_batch_size \(16\)"):
        preflight(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
