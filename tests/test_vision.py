"""Vision models: patches cut and put back exactly, both ViT kinds build, train and report accuracy."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.load import validation_lines
from configs.model import ViTConfig, ViTMoEConfig
from configs.schema import ExperimentConfig
from models import InputShape, build_model
from models.layers.moe import moe_blocks
from models.vision.vit import patchify
from training.step import Trainer


def test_patchify_shapes_and_round_trip():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (2, 8, 12, 3), dtype=np.uint8)
    patches = np.asarray(patchify(jnp.asarray(images), 4))
    assert patches.shape == (2, (8 // 4) * (12 // 4), 4 * 4 * 3)
    # patch 1 (row 0, column 1) is pixels [0:4, 4:8], flattened row by row, channels last
    np.testing.assert_array_equal(patches[0, 1], images[0, 0:4, 4:8].reshape(-1))
    back = patches.reshape(2, 2, 3, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(2, 8, 12, 3)
    np.testing.assert_array_equal(back, images)
    with pytest.raises(ValueError, match="must divide"):
        patchify(jnp.asarray(images), 5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [
        ViTConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, patch_size=2),
        ViTMoEConfig(
            d_model=32, n_layers=2, n_heads=2, d_ff=64, patch_size=4, pool="mean", n_experts=4, capacity_factor=None
        ),
    ],
)
def test_vit_kinds_fit_a_few_images(cfg):
    """Both kinds learn 16 random 8×8 digit-like images by heart (accuracy → 1) with microbatches."""
    spec = build_model(cfg, InputShape(image_shape=(8, 8, 1), num_classes=10, pixel_max=16))
    assert spec.batch.unit == "images" and spec.heldout == "ce"
    trainer = Trainer(spec, optax.adam(1e-2), microbatches=2)
    params, rng = trainer.init_params(), np.random.default_rng(0)
    opt = trainer.init_opt(params)
    batch = {
        "image": jnp.asarray(rng.integers(0, 17, (16, 8, 8, 1), dtype=np.uint8)),
        "label": jnp.asarray(np.arange(16) % 10, dtype=jnp.int32),
    }
    first = float(trainer.evaluate(params, batch)["ce"])
    for _ in range(80):
        params, opt, _ = trainer.step(params, opt, batch)
    metrics = trainer.evaluate(params, batch)
    assert float(metrics["accuracy"]) == 1.0 and float(metrics["ce"]) < first / 5
    if cfg.kind == "vit_moe":
        assert moe_blocks(cfg) == [1] and float(metrics["moe/dropped"]) == 0.0  # dropless
        assert spec.extras["total_params"] - spec.extras["active_params"] == 1 * 2 * 3 * 32 * 64


def test_vision_configs_are_checked():
    def refusal(model: dict) -> str:
        with pytest.raises(Exception) as err:
            ExperimentConfig.model_validate({"model": model})
        return " | ".join(validation_lines(err.value))

    assert "model.d_model (30) must be divisible" in refusal({"kind": "vit", "d_model": 30, "n_heads": 4})
    assert "model.pool" in refusal({"kind": "vit", "pool": "max"})
